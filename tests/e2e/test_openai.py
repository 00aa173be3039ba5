"""The OpenAI-compatible endpoints, driven by the official openai SDK and by raw HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support import MODEL, Server


@pytest.fixture(scope="module")
def sdk(server: Server, api_key: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=120) as client:
        yield client


MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is recursion?"},
]


def test_chat(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)  # type: ignore[arg-type]
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.model == MODEL
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"  # 16 tokens cannot finish an explanation of recursion
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 16
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 16


def test_finish_reason_stop(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say OK."}], max_tokens=200, temperature=0, seed=3
    )
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens < 200


def test_streamed_chat_equals_plain_chat(sdk: openai.OpenAI) -> None:
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 30, "temperature": 0, "seed": 11}
    plain = sdk.chat.completions.create(**args)  # type: ignore[call-overload]
    chunks = list(sdk.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert (usage.prompt_tokens, usage.completion_tokens) == (plain.usage.prompt_tokens, 30)  # type: ignore[union-attr]


def test_answers_name_the_instance_that_served_them(sdk: openai.OpenAI, client: httpx.Client) -> None:
    # The session's server runs one instance of the model: the native API names it too.
    listed = {client.post("/api/generate", json={"prompt": "Hi", "max_tokens": 1}).json()["instance_id"]}
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    plain = sdk.chat.completions.with_raw_response.create(**args)  # type: ignore[call-overload]
    with sdk.chat.completions.with_streaming_response.create(**args, stream=True) as streamed:  # type: ignore[call-overload]
        streamed_instance = streamed.headers["x-llmserver-instance"]
    completion = sdk.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=2)
    served = [plain.headers["x-llmserver-instance"], streamed_instance, completion.headers["x-llmserver-instance"]]
    assert set(served) <= listed, (served, listed)


def test_raw_stream_is_the_seeds_sse(client: httpx.Client) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all(line.startswith("data: ") for line in lines)
    for event in events:
        assert event["object"] == "chat.completion.chunk" and event["id"].startswith("chatcmpl-")
        assert "delta" in event["choices"][0] and "finish_reason" in event["choices"][0]
    assert events[-1]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "length"}
    assert all("usage" not in event for event in events)  # not asked for
    # the role comes once, in the first chunk (llama.cpp repeats it in its progress events)
    assert [event["choices"][0]["delta"].get("role") for event in events if "role" in event["choices"][0]["delta"]] == [
        "assistant"
    ]
    assert events[0]["choices"][0]["delta"].get("role") == "assistant"


def test_completions(sdk: openai.OpenAI) -> None:
    reply = sdk.completions.create(
        model=MODEL, prompt="Once upon a time, in a land far away,", max_tokens=10, temperature=0
    )
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert reply.choices[0].text and reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 10


def test_streamed_completions(sdk: openai.OpenAI) -> None:
    args = {"model": MODEL, "prompt": "The sky is", "max_tokens": 12, "temperature": 0, "seed": 5}
    plain = sdk.completions.create(**args)  # type: ignore[call-overload]
    chunks = list(sdk.completions.create(**args, stream=True, stream_options={"include_usage": True}))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert (usage.prompt_tokens, usage.completion_tokens) == (plain.usage.prompt_tokens, 12)  # type: ignore[union-attr]
    assert all(c.usage is None for c in chunks[:-1])


def test_models(sdk: openai.OpenAI, client: httpx.Client) -> None:
    client.post("/api/generate", json={"prompt": "hi", "max_tokens": 4})  # some traffic, whatever ran before
    listed = sdk.models.list()
    assert [m.id for m in listed.data] == [MODEL]
    raw = client.get("/v1/models").json()
    assert raw["object"] == "list"
    entry = raw["data"][0]
    assert entry["object"] == "model" and entry["owned_by"] == "5cbot_llm_server"
    assert entry["vision_capable"] is False
    assert isinstance(entry["created"], int)
    # After traffic the 30-day speed is known (test_usage covers its absence before any).
    assert isinstance(entry["avg_tokens_per_second"], float) and entry["avg_tokens_per_second"] > 0


def test_sdk_sees_errors_as_errors(sdk: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert caught.value.body["type"] == "model_not_found"  # type: ignore[index]
    with (
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as bad,
        pytest.raises(openai.AuthenticationError),
    ):
        bad.models.list()
