"""OpenAI compatibility beyond plain chat, against the real server with the official SDK and an agent
framework: structured outputs, tool calls, logprobs, sampling parameters, embeddings, and every
field that is refused rather than dropped."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llmserver.models.files import embedded_model_path as model_file
from tests.support import MODEL, Server, assert_error, make_key
from tests.support.jobs import independent_decrypt, new_key, poll_until_done
from tests.support.structured import Person

EMBED = "smol-embed"
NATIVE = "smol-tools"
TEMPLATE = Path(__file__).parent.parent / "templates" / "chatml_tools.jinja"
CONFIG = f"""
[[models]]
name = "{MODEL}"
parallel = 2
ctx_size = 1024
threads = 1

[[models]]
name = "{EMBED}"
path = "{model_file()}"
embedding = true
parallel = 2
ctx_size = 256
threads = 1

[[models]]
name = "{NATIVE}"
path = "{model_file()}"
chat_template_file = "{TEMPLATE}"
parallel = 1
ctx_size = 1024
threads = 1
"""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def compat(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(data_dir=tmp_path_factory.mktemp("compat"), config=CONFIG).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def key(compat: Server) -> str:
    return make_key(compat.data_dir, "compat", quota_tokens=10_000_000, quota_period="month")


@pytest.fixture(scope="module")
def sdk(compat: Server, key: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=compat.url + "/v1", api_key=key, max_retries=0, timeout=120) as client:
        yield client


def post(compat: Server, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(compat.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


# Structured outputs


def test_parse_returns_the_pydantic_object(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format=Person,
        max_tokens=150,
        temperature=0,
    )
    assert isinstance(reply.choices[0].message.parsed, Person)


def test_parse_streamed(sdk: openai.OpenAI) -> None:
    with sdk.chat.completions.stream(
        model=MODEL,
        messages=[{"role": "user", "content": "Invent a person."}],
        response_format=Person,
        max_tokens=150,
        temperature=0,
    ) as stream:
        chunks = [event for event in stream if event.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(chunks) > 3  # streamed token by token, not in one piece
    assert isinstance(final.choices[0].message.parsed, Person)


def test_json_object_mode_answers_a_json_object(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        response_format={"type": "json_object"},
        max_tokens=80,
        temperature=0,
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    else:
        assert (reply.choices[0].message.content or "").lstrip().startswith("{")


def test_native_format_takes_a_schema_or_json(compat: Server, key: str) -> None:
    schema = Person.model_json_schema()
    answer = post(
        compat,
        key,
        "/api/generate",
        {"prompt": "Invent a person.", "format": schema, "max_tokens": 150, "temperature": 0},
    )
    assert answer.status_code == 200, answer.text
    Person.model_validate_json(answer.json()["response"])
    raw = post(
        compat,
        key,
        "/api/generate",
        {"prompt": "A person: ", "raw": True, "format": schema, "max_tokens": 150, "temperature": 0},
    )
    Person.model_validate_json(raw.json()["response"])
    loose = post(compat, key, "/api/generate", {"prompt": "A cat as JSON.", "format": "json", "max_tokens": 40})
    assert loose.json()["response"].lstrip().startswith("{")


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "object", "properties": {"a": {"type": "strin"}}}, "unrecognized type"),
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "[0-9]+"}}}, "#/properties/a"),
    ],
)
def test_a_schema_without_a_grammar_is_400_naming_it(compat: Server, key: str, schema: Any, where: str) -> None:
    form = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {"messages": ASK, "response_format": form, "max_tokens": 4}
    error = assert_error(
        post(compat, key, "/v1/chat/completions", body), 400, "invalid_request_error", "response_format"
    )
    assert where in str(error["message"])


# Tool calls


def test_a_two_turn_tool_conversation(sdk: openai.OpenAI) -> None:
    first = sdk.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=150,  # type: ignore[arg-type, list-item]
        temperature=0,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
    json.loads(call.function.arguments)
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    second = sdk.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=[WEATHER, TIME],
        tool_choice="none",
        max_tokens=30,  # type: ignore[arg-type, list-item]
    )
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    alone = sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    assert (
        second.usage and alone.usage and second.usage.prompt_tokens > alone.usage.prompt_tokens + 15
    )  # the call and result


def test_streamed_tool_calls_assemble_in_the_sdk(sdk: openai.OpenAI) -> None:
    tools = [WEATHER]
    with sdk.chat.completions.stream(
        model=MODEL, messages=ASK, tools=tools, tool_choice="required", max_tokens=150, temperature=0
    ) as stream:  # type: ignore[arg-type, list-item]
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert "city" in json.loads(choice.message.tool_calls[0].function.arguments)


def test_a_named_tool_choice_and_one_call_at_a_time(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        max_tokens=150,
        temperature=0,
    )
    calls = reply.choices[0].message.tool_calls or []
    assert [call.function.name for call in calls] == ["get_time"]  # type: ignore[union-attr]


def test_a_template_with_tools_renders_them_itself(compat: Server, sdk: openai.OpenAI) -> None:
    """The native path: a model whose chat template renders tools gets them (and the conversation's
    calls and results) from llama-server's template, not from the gateway's instructions."""

    def prompt_tokens(model: str, messages: list[Any], **fields: Any) -> int:
        reply = sdk.chat.completions.create(model=model, messages=messages, max_tokens=1, **fields)
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    assert "tool calls: its chat template's" in compat.log()
    bare = prompt_tokens(NATIVE, ASK)
    with_tools = prompt_tokens(NATIVE, ASK, tools=[WEATHER])
    prompted = prompt_tokens(MODEL, ASK, tools=[WEATHER])
    assert with_tools > bare + 30  # the template listed the tool
    assert with_tools != prompted  # and not in the gateway's words
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]  # fmt: skip
    assert prompt_tokens(NATIVE, history, tools=[WEATHER]) > with_tools + 15


def test_tool_calls_through_async_mode(compat: Server, key: str) -> None:
    raw, encoded = new_key()
    body = {
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_tokens": 150,
        "temperature": 0,
        "mode": "async",
        "key": encoded,
    }
    submitted = post(compat, key, "/v1/chat/completions", body).json()
    done = poll_until_done(compat, key, submitted["tracking_id"])
    plain = json.loads(independent_decrypt(done["result"], raw, base64.b64decode(submitted["nonce"])))
    assert plain["choices"][0]["finish_reason"] == "tool_calls"
    assert plain["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_langchain_binds_tools_and_structured_output(compat: Server, key: str) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        base_url=compat.url + "/v1", api_key=key, model=MODEL, max_tokens=150, temperature=0, max_retries=0
    )  # type: ignore[arg-type]
    message = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert message.tool_calls[0]["name"] == "get_weather"  # type: ignore[attr-defined]
    assert isinstance(message.tool_calls[0]["args"], dict)  # type: ignore[attr-defined]
    person = chat.with_structured_output(Person, method="json_schema").invoke("Invent a person.")
    assert isinstance(person, Person)


# Logprobs and sampling


def test_chat_logprobs_have_the_asked_count(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(
        model=MODEL, messages=ASK, logprobs=True, top_logprobs=3, max_tokens=5, temperature=0
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    assert all(len(token.top_logprobs) == 3 and token.logprob <= 0 for token in content)
    assert "".join(token.token for token in content) == reply.choices[0].message.content


def test_completion_logprobs_in_the_legacy_shape(sdk: openai.OpenAI) -> None:
    reply = sdk.completions.create(model=MODEL, prompt="The sky is", logprobs=2, max_tokens=4, temperature=0)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and len(logprobs.tokens) == 4
    assert all(len(top) == 2 for top in logprobs.top_logprobs or [])
    assert logprobs.text_offset and logprobs.text_offset[0] == len("The sky is")


def test_streamed_logprobs(sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(
        model=MODEL, messages=ASK, logprobs=True, top_logprobs=1, max_tokens=4, stream=True
    )
    tokens = [
        t
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for t in chunk.choices[0].logprobs.content or []
    ]
    assert len(tokens) == 4


def test_seed_repeats_an_answer(sdk: openai.OpenAI) -> None:
    def ask(seed: int) -> str:
        reply = sdk.chat.completions.create(model=MODEL, messages=ASK, seed=seed, temperature=1.5, max_tokens=12)
        return reply.choices[0].message.content or ""

    assert ask(7) == ask(7)
    assert len({ask(seed) for seed in (1, 2, 3)}) > 1


def test_logit_bias_and_penalties_reach_the_sampler(compat: Server, sdk: openai.OpenAI) -> None:
    def first_token(**fields: Any) -> str:
        reply = sdk.chat.completions.create(
            model=MODEL, messages=ASK, temperature=0, max_tokens=1, logprobs=True, **fields
        )
        return reply.choices[0].logprobs.content[0].token  # type: ignore[index, union-attr]

    greedy = first_token()
    token_id = compat.instance_post("/tokenize", {"content": greedy})["tokens"][0]
    assert first_token(logit_bias={str(token_id): -100}) != greedy
    assert first_token(
        presence_penalty=1.0, frequency_penalty=1.0, extra_body={"min_p": 0.05, "top_k": 20, "repeat_penalty": 1.1}
    )


REFUSED = [
    ("/v1/chat/completions", {"n": 2}, "n"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("/v1/chat/completions", {"verbosity": "low"}, "verbosity"),
    ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logit_bias": {"hello": 5}}, "logit_bias.hello"),
    ("/v1/chat/completions", {"logit_bias": {"42": 101}}, "logit_bias.42"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    (
        "/v1/chat/completions",
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ("/v1/chat/completions", {"tools": [WEATHER, WEATHER]}, "tools"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"seed": "x"}, "seed"),
    ("/v1/chat/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/chat/completions", {"temperatur": 0.5}, "temperatur"),
    ("/v1/completions", {"n": 3}, "n"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/api/generate", {"format": "yaml"}, "format"),
    ("/api/generate", {"n_predict": 5}, "n_predict"),
]


@pytest.mark.parametrize(("path", "extra", "param"), REFUSED, ids=[f"{p}:{param}" for p, _, param in REFUSED])
def test_each_refused_parameter_is_400_naming_it(
    compat: Server, key: str, path: str, extra: dict[str, Any], param: str
) -> None:
    base: dict[str, Any] = {"prompt": "Hi"} if path != "/v1/chat/completions" else {"messages": ASK}
    assert_error(post(compat, key, path, {**base, "max_tokens": 2, **extra}), 400, "invalid_request_error", param)


def test_bad_messages_are_400_naming_the_message(compat: Server, key: str) -> None:
    tool_without_id = [*ASK, {"role": "tool", "content": "x"}]
    assert_error(
        post(compat, key, "/v1/chat/completions", {"messages": tool_without_id}),
        400,
        "invalid_request_error",
        "messages.1",
    )
    unknown = [{"role": "user", "content": "x", "mood": "happy"}]
    error = assert_error(
        post(compat, key, "/v1/chat/completions", {"messages": unknown}),
        400,
        "invalid_request_error",
        "messages.0.mood",
    )
    assert error["message"] == "Unrecognized request argument supplied: messages.0.mood"


def test_harmless_fields_are_accepted(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=2, user="u1", metadata={"team": "a"}, store=False,
        service_tier="auto", safety_identifier="s", prompt_cache_key="conv-1", n=1, modalities=["text"],
        stream_options=None,
    )  # fmt: skip
    assert reply.choices[0].message.content


# Embeddings


def test_embeddings_differ_and_have_the_model_dimension(sdk: openai.OpenAI) -> None:
    result = sdk.embeddings.create(model=EMBED, input=["The cat sat on the mat.", "Stock prices fell sharply."])
    first, second = (item.embedding for item in result.data)
    assert len(first) == len(second) == 576  # SmolLM2-135M's hidden size
    assert first != second and [item.index for item in result.data] == [0, 1]
    assert result.usage.prompt_tokens > 8 and result.usage.total_tokens == result.usage.prompt_tokens
    assert result.model == EMBED


def test_an_embeddings_answer_of_over_a_megabyte_comes_whole(sdk: openai.OpenAI) -> None:
    """120 inputs: llama-server's answer is about 1.5 MB, past the instance client's 1 MiB pause
    threshold, where a whole-body read once stalled until the request's timeout (504)."""
    inputs = [f"Sentence number {n} is about the weather on day {n}." for n in range(120)]
    result = sdk.embeddings.create(model=EMBED, input=inputs, timeout=120)
    assert [item.index for item in result.data] == list(range(120))
    assert all(len(item.embedding) == 576 for item in result.data)


def test_embeddings_as_base64_are_the_same_floats(compat: Server, key: str) -> None:
    floats = post(compat, key, "/v1/embeddings", {"model": EMBED, "input": "hello"}).json()["data"][0]["embedding"]
    encoded = post(compat, key, "/v1/embeddings", {"model": EMBED, "input": "hello", "encoding_format": "base64"})
    raw = base64.b64decode(encoded.json()["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert len(decoded) == 576 and max(abs(a - b) for a, b in zip(decoded, floats, strict=True)) < 1e-6


def test_embeddings_are_counted_in_the_quota(compat: Server) -> None:
    key = make_key(compat.data_dir, "embed-quota", quota_tokens=1000, quota_period="day")
    answer = post(compat, key, "/v1/embeddings", {"model": EMBED, "input": ["one two three", "four"]})
    assert answer.status_code == 200
    used = answer.json()["usage"]["prompt_tokens"]
    after = post(compat, key, "/v1/embeddings", {"model": EMBED, "input": "x"})
    assert int(after.headers["x-ratelimit-remaining-tokens"]) <= 1000 - used


@pytest.mark.parametrize(
    ("body", "status", "type_", "param"),
    [
        ({"model": EMBED, "input": "x", "dimensions": 64}, 400, "invalid_request_error", "dimensions"),
        ({"model": MODEL, "input": "x"}, 400, "invalid_request_error", "model"),
        ({"model": "nope", "input": "x"}, 404, "model_not_found", "model"),
        ({"model": EMBED, "input": ""}, 400, "invalid_request_error", "input"),
        ({"model": EMBED, "input": []}, 400, "invalid_request_error", "input"),
        ({"model": EMBED, "input": ["x"] * 2049}, 400, "invalid_request_error", "input"),
        ({"model": EMBED, "input": "word " * 1000}, 400, "context_length_exceeded", "input"),
        ({"model": EMBED, "input": "x", "encoding_format": "int8"}, 400, "invalid_request_error", "encoding_format"),
        ({"model": EMBED, "input": "x", "mode": "async"}, 400, "invalid_request_error", "mode"),
    ],
)
def test_embedding_limits(compat: Server, key: str, body: dict[str, Any], status: int, type_: str, param: str) -> None:
    assert_error(post(compat, key, "/v1/embeddings", body), status, type_, param)


def test_an_embedding_model_does_not_chat_and_is_listed(compat: Server, key: str, sdk: openai.OpenAI) -> None:
    body = {"model": EMBED, "messages": ASK}
    assert_error(post(compat, key, "/v1/chat/completions", body), 400, "invalid_request_error", "model")
    listed = {model.id: model for model in sdk.models.list().data}
    assert listed[EMBED].model_extra and listed[EMBED].model_extra["embedding"] is True
    assert listed[MODEL].model_extra and listed[MODEL].model_extra["embedding"] is False


def test_an_earlier_answer_echoed_back_is_accepted(compat: Server, key: str) -> None:
    echoed = {
        "role": "assistant",
        "content": "Hi!",
        "refusal": None,
        "annotations": [],
        "audio": None,
        "function_call": None,
    }
    history = [{"role": "user", "content": "Hello"}, echoed, {"role": "user", "content": "Bye"}]
    assert post(compat, key, "/v1/chat/completions", {"messages": history, "max_tokens": 2}).status_code == 200
    # What reasoning models return and clients (litellm, OpenRouter's) copy back: accepted, not used.
    echoed.update(
        audio={"id": "audio_1"}, reasoning_content="Greet back.", reasoning="Greet back.", reasoning_details=[],
        thinking_blocks=[], provider_specific_fields={"refusal": None},
    )  # fmt: skip
    assert post(compat, key, "/v1/chat/completions", {"messages": history, "max_tokens": 2}).status_code == 200
    # A field no client echoes is still refused, as an unknown top-level one is.
    echoed["mood"] = "happy"
    body = {"messages": history, "max_tokens": 2}
    assert_error(post(compat, key, "/v1/chat/completions", body), 400, "invalid_request_error", "messages.1.mood")
