"""Which streams can go on after giving their slot back, and what is asked for to go on (engine/resume.py).
Through the real server and llama-server: tests/e2e/test_fair_slices.py."""

from __future__ import annotations

from llmserver.engine import resume
from llmserver.settings import ModelConfig

MODEL = ModelConfig(name="m")
CHAT = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 100, "stream": True}
COMPLETION = {"prompt": "1, 2, 3,", "max_tokens": 100, "stream": True}


def test_plain_text_streams_are_resumable_and_what_a_continuation_could_not_redo_is_not() -> None:
    assert resume.resumable(resume.CHAT, CHAT, MODEL, raw_tokens=True)
    assert resume.resumable(resume.COMPLETION, COMPLETION, MODEL, raw_tokens=True)
    assert resume.resumable(resume.COMPLETION, {**COMPLETION, "logprobs": None}, MODEL, raw_tokens=True)
    for field, value in (
        ("tools", [{"type": "function"}]), ("json_schema", {"type": "object"}), ("grammar", "root ::= x"),
        ("response_format", {"type": "json_object"}), ("logprobs", True), ("n_probs", 2), ("n", 2),
    ):  # fmt: skip
        assert not resume.resumable(resume.CHAT, {**CHAT, field: value}, MODEL, raw_tokens=True), field
    assert not resume.resumable(resume.CHAT, CHAT, MODEL, raw_tokens=False)  # a prompted tool plan's
    thinking = {**CHAT, "chat_template_kwargs": {"enable_thinking": True}}
    assert not resume.resumable(resume.CHAT, thinking, MODEL, raw_tokens=True)
    no_prefill = ModelConfig(name="m", llama_server_args=["--no-prefill-assistant"])
    assert not resume.resumable(resume.CHAT, CHAT, no_prefill, raw_tokens=True)
    assert not resume.resumable(resume.COMPLETION, {**COMPLETION, "prompt": [1, 2, 3]}, MODEL, raw_tokens=True)
    assert not resume.resumable("/v1/embeddings", {"input": "x"}, MODEL, raw_tokens=True)


def test_the_rest_is_asked_for_from_the_text_so_far_with_what_is_left_of_max_tokens() -> None:
    said = resume.said([b'" 4"', b'","', " 5"])  # token texts as llama-server wrote them, or parsed
    assert said == " 4, 5"
    payload, cut = resume.rest(resume.COMPLETION, COMPLETION, said, 3) or ({}, -1)
    assert payload == {**COMPLETION, "prompt": "1, 2, 3, 4, 5", "max_tokens": 97} and cut == 0
    payload, cut = resume.rest(resume.CHAT, CHAT, "One, two", 2) or ({}, -1)
    assert payload["messages"][-1] == {"role": "assistant", "content": "One, two"}
    assert payload["messages"][:-1] == CHAT["messages"] and payload["max_tokens"] == 98
    assert cut == len("One, two")  # llama-server repeats the text it continues: that much is cut
    assert resume.rest(resume.CHAT, CHAT, "", 0) == ({**CHAT, "max_tokens": 100}, 0)  # nothing said: the same
    assert resume.rest(resume.CHAT, CHAT, "All of it", 100) is None  # max_tokens reached as it stopped
