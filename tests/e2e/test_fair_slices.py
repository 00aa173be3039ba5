"""Fair shares bounded in time, through the real server and the OpenAI SDK: while one key's long streams
hold every slot of a model, another key's request starts within `limits.fair_slice` seconds (a stream
gives its slot back and goes on from where it stopped), and the streams that gave way lose nothing —
every token they were asked for, counted once, in order.

The streams count ("1, 2, 3, 4," → " 5, 6, 7, …"; a chat's "1234567890…"), so a token lost or repeated
where a stream stopped and went on shows as a gap or a repeat in the count."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import anthropic
import httpx
import pytest

from tests.support import MODEL, Server, busy_slots, create_key, metric, wait_for
from tests.support.counting import Result, completion_stream, consecutive, openai_client, openai_stream

pytestmark = pytest.mark.slow

# 2 slots and 2 places in the instance's own queue: 4 streams of one key fill them all.
CONFIG = f'[[models]]\nname = "{MODEL}"\nparallel = 2\nctx_size = 4096\n'
STREAMS = 4
CHAT_COUNT = [{"role": "user", "content": "Count from 1 to 300, separated by commas."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(
        data_dir=tmp_path_factory.mktemp("fair"), config=CONFIG, env={"LLMSERVER_LIMITS__FAIR_SLICE": "1"}
    ).start()
    yield server
    server.stop()


def in_flight(server: Server, admin: str) -> float:
    return metric(server, admin, "llmserver_in_flight", model=MODEL)


def chat_stream(server: Server, key: str, max_tokens: int) -> Result:
    stream = openai_client(server, key).chat.completions.create(
        model=MODEL, messages=CHAT_COUNT, max_tokens=max_tokens, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )  # fmt: skip
    return openai_stream(stream, lambda choice: choice.delta.content)


def messages_stream(server: Server, key: str, max_tokens: int) -> Result:
    """The same chat through the Anthropic SDK's Messages stream (the stream in Anthropic's events)."""
    client = anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=300)
    with client, client.messages.stream(
        model=MODEL, max_tokens=max_tokens, messages=CHAT_COUNT, extra_body={"temperature": 0},  # type: ignore[arg-type]
    ) as stream:  # fmt: skip
        message = stream.get_final_message()
    text = "".join(block.text for block in message.content if block.type == "text")
    usage = message.usage  # Anthropic's input_tokens leave out those read from the cache
    return text, message.stop_reason, (usage.input_tokens + (usage.cache_read_input_tokens or 0), usage.output_tokens)


def contended(server: Server, admin: str, send: object, max_tokens: int) -> tuple[list[str], list[tuple]]:
    """One key's STREAMS long streams fill every slot and queue place; then another key's tiny request.
    The order they ended in, and each long stream's (text, finish reason, usage)."""
    heavy = create_key(server.data_dir, "heavy")
    light = create_key(server.data_dir, "light")
    done: list[str] = []
    results: list[tuple] = []
    lock = threading.Lock()

    def long(name: str) -> None:
        result = send(server, heavy, max_tokens)  # type: ignore[operator]
        with lock:
            done.append(name)
            results.append(result)

    threads = [threading.Thread(target=long, args=(f"A{n}",)) for n in range(STREAMS)]
    for thread in threads:
        thread.start()
    assert wait_for(lambda: in_flight(server, admin) == STREAMS and busy_slots(server) == 2, 60)
    answer = httpx.post(
        server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
        headers={"Authorization": f"Bearer {light}"}, timeout=120,
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    with lock:
        done.append("B")
    for thread in threads:
        thread.join()
    return done, results


def test_a_key_below_its_share_is_served_within_the_slice_and_the_streams_that_gave_way_lose_nothing(
    server: Server,
) -> None:
    admin = create_key(server.data_dir, "admin", admin=True)
    alone = create_key(server.data_dir, "alone")
    solo_text, solo_finish, solo_usage = completion_stream(server, alone, 300)  # one key alone: nothing gives way
    assert solo_finish == "length" and solo_usage[1] == 300
    consecutive(solo_text)
    assert metric(server, admin, "llmserver_slot_yields_total", model=MODEL) == 0

    done, results = contended(server, admin, completion_stream, 300)
    # The light key's request ended first: it did not wait for a long stream to end. Before, it started
    # only once three of them had ended (the one whose end freed a place, two ahead of it in llama-server's
    # own queue).
    assert done[0] == "B", done
    assert metric(server, admin, "llmserver_slot_yields_total", model=MODEL) >= 1
    for text, finish, usage in results:
        # Every token asked for, the prompt counted once, the count unbroken where the stream went on.
        assert finish == "length"
        assert usage == (solo_usage[0], 300)
        assert len(consecutive(text)) >= len(consecutive(solo_text)) - 2


@pytest.mark.parametrize("send", [chat_stream, messages_stream], ids=["openai-chat", "anthropic-messages"])
def test_a_chat_stream_that_gave_way_goes_on_without_repeating_itself(server: Server, send: object) -> None:
    admin = create_key(server.data_dir, "admin", admin=True)
    before = metric(server, admin, "llmserver_slot_yields_total", model=MODEL)
    solo_text, _, solo_usage = send(server, create_key(server.data_dir, "alone"), 200)  # type: ignore[operator]
    cycle = "1234567890"
    assert solo_text == (cycle * 100)[: len(solo_text)] and len(solo_text) > 150  # the model's way of counting

    done, results = contended(server, admin, send, 200)
    assert done[0] == "B", done
    assert metric(server, admin, "llmserver_slot_yields_total", model=MODEL) > before
    for text, finish, usage in results:
        assert finish in ("length", "max_tokens")
        assert usage == (solo_usage[0], 200)
        # Where a stream went on, llama-server repeats the text it continues: cut, not sent twice.
        assert text == (cycle * 100)[: len(text)] and len(text) > 150, text
