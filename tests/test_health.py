"""Readiness scoped to what a load balancer needs: a gateway (or node) is ready while it can serve
models, whatever one model's trouble (health.models_probe); `server.ready_models` names the ones that
must serve."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from llmserver.health import models_probe
from llmserver.llama.client import LlamaServerClient
from llmserver.pool.instance import Instance, Status
from llmserver.pool.pool import ModelPool
from llmserver.settings import ModelConfig


def pool(name: str, *, serving: bool, min_instances: int = 1, unstartable: str | None = None) -> ModelPool:
    made = ModelPool(ModelConfig(name=name, min_instances=min_instances), queue_timeout=1, on_pressure=lambda p: None)
    if serving:  # a ready instance (never called: the probe reads only the pool's state)
        instance = Instance(model=made.config, host="127.0.0.1", port=1, log_path=Path("/dev/null"))
        instance.client, instance.status = LlamaServerClient(instance.base_url), Status.READY
        made.instances.append(instance)
    made.unstartable = made.blocked = unstartable
    return made


def probe(pools: list[ModelPool], required: tuple[str, ...] = ()) -> str | None:
    async def run() -> str | None:
        try:
            return await models_probe({p.name: p for p in pools}, required)()
        finally:
            await asyncio.gather(*(i.client.close() for p in pools for i in p.instances if i.client is not None))

    return asyncio.run(run())


def test_one_model_that_cannot_run_leaves_the_gateway_ready_and_says_so() -> None:
    bad = pool("bad", serving=False, unstartable="its model file cannot be had here (not found)")
    detail = probe([pool("good", serving=True), bad])
    assert detail == "not serving: bad (bad: its model file cannot be had here (not found))"


def test_no_model_serving_is_not_ready() -> None:
    with pytest.raises(RuntimeError, match="no model serves: a, b"):
        probe([pool("a", serving=False), pool("b", serving=False, min_instances=0, unstartable="no file")])


def test_a_model_started_on_demand_counts_as_able_to_serve() -> None:
    assert probe([pool("kept", serving=False), pool("on-demand", serving=False, min_instances=0)]) == (
        "not serving: kept"
    )
    assert probe([]) is None  # no model at all (a node before the scheduler assigns it one)


def test_required_models_must_each_serve() -> None:
    pools = [pool("a", serving=True), pool("b", serving=False, unstartable="no node can place it")]
    with pytest.raises(RuntimeError, match=r"no instance serves b \(b: no node can place it\)"):
        probe(pools, required=("a", "b"))
    assert probe(pools, required=("a",)) == "not serving: b (b: no node can place it)"
    with pytest.raises(RuntimeError, match="no instance serves typo"):
        probe(pools, required=("typo",))
