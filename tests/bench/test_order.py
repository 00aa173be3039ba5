"""The benchmark's order of targets and the ratio its throughput targets are held to."""

from __future__ import annotations

from bench.load import LevelResult, Sample, turn
from bench.report import _level_ratio


def test_each_pair_of_orders_gives_every_target_the_same_mean_place() -> None:
    targets = list("ABCDE")
    for pair in range(8):
        first, second = turn(targets, 2 * pair), turn(targets, 2 * pair + 1)  # type: ignore[arg-type]
        assert sorted(first) == targets and second == first[::-1]
        places = {t: first.index(t) + second.index(t) for t in targets}
        assert set(places.values()) == {len(targets) - 1}


def test_each_target_takes_each_place_as_the_pairs_go_on() -> None:
    targets = list("ABCDE")
    orders = [turn(targets, i) for i in range(0, 2 * len(targets), 2)]  # type: ignore[arg-type]
    for place in range(len(targets)):
        assert sorted(order[place] for order in orders) == targets


def test_the_ratio_is_the_median_of_the_rounds_and_one_slow_round_does_not_move_it() -> None:
    direct = LevelResult("direct", 1, blocks=[100.0, 100.0, 100.0, 100.0, 100.0])
    gateway = LevelResult("gateway", 1, blocks=[99.0, 100.0, 98.0, 60.0, 101.0])
    assert _level_ratio(gateway, direct) == 0.99


def test_with_one_round_the_ratio_is_the_pooled_one() -> None:
    direct = LevelResult("direct", 1, [Sample(0.01, [], 10.0, 1000)], seconds=10.0, blocks=[100.0])
    gateway = LevelResult("gateway", 1, [Sample(0.01, [], 20.0, 1000)], seconds=20.0, blocks=[50.0])
    assert _level_ratio(gateway, direct) == 0.5


def test_every_target_serves_an_uncounted_request_per_client_before_each_level(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from bench import load, run
    from bench import plan as plan_module

    calls: list[tuple[str, int, int, int]] = []

    async def fake_level(target, concurrency, per_client, max_tokens):  # type: ignore[no-untyped-def]
        calls.append((target.name, concurrency, per_client, max_tokens))
        return [Sample(0.01, [0.01], 1.0, 10) for _ in range(concurrency * per_client)], 1.0

    monkeypatch.setattr(load, "run_level", fake_level)
    monkeypatch.setattr(load, "settle", lambda: 0.0)
    plan = plan_module.FULL
    targets = [run.Target(name, "http://127.0.0.1:1", None) for name in ("a", "b", "c")]  # type: ignore[arg-type]
    results = plan_module.Results(plan, [t.name for t in targets])
    run._throughput(plan, targets, results)

    measured = [call for call in calls if call[3] in (plan.warm_tokens, plan.max_tokens)]
    for concurrency in plan.levels:
        level = [call for call in measured if call[1] == concurrency]
        assert level[:3] == [(name, concurrency, 1, plan.warm_tokens) for name in ("a", "b", "c")]
        assert all(call[2:] == (plan.per_client, plan.max_tokens) for call in level[3:])
        for name in ("a", "b", "c"):  # the counted blocks alone are in the results
            samples = results.levels[name][concurrency].samples
            assert len(samples) == run.blocks(plan, concurrency) * concurrency * plan.per_client


def test_the_benchmark_reads_each_apis_stream_as_llmserver_writes_it() -> None:
    """bench/load.py counts text events and the completion's tokens in each API's stream: checked on the
    events the dialects' voices write (dialects/), the very bytes a /v1/messages or /v1/responses stream
    carries."""
    import json

    from bench import load
    from llmserver.dialects import anthropic, responses
    from llmserver.engine import shapes
    from llmserver.schemas.responses import ResponsesRequest

    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    voices = {
        "messages": anthropic.Voice("m"),
        "responses": responses.Voice(ResponsesRequest.model_validate({"input": "x"}), "m"),
    }
    for api, voice in voices.items():
        raw = voice.opening() + voice.text(shapes.CHAT_TOKEN, b'"a"') + voice.pieces(
            [{"index": 0, "delta": {"content": "b"}, "finish_reason": "stop"}]
        ) + voice.closing(usage)  # fmt: skip
        events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
        read = [load._text_and_count(api, event) for event in events]
        assert sum(text for text, _ in read) == 2, api
        assert [count for _, count in read if count is not None] == [2], api
