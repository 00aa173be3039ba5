"""Prompt-cache affinity through the real server: conversations with their own long system prompts,
run in lockstep on one model with two instances, with `affinity` and with `least_loaded` routing
(the workload is the benchmark's, bench/affinity.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from bench.affinity import Later, balanced_systems, converse, instance_addresses
from tests.support import MODEL, Server, create_key, metric

# Starts servers of its own and processes long prompts: selected out by -m 'not slow'.
pytestmark = pytest.mark.slow

ADMIN = "test-admin-key-affinity"
CONVERSATIONS = 4
TURNS = 6


def config(routing: str) -> str:
    model = f'name = "{MODEL}"\nmin_instances = 2\nmax_instances = 2\nparallel = 2\nctx_size = 2048\n'
    return f'router.policy = "{routing}"\n[[models]]\n{model}'


def test_affinity_keeps_conversations_on_their_cached_instance(start_server: Callable[..., Server]) -> None:
    results: dict[str, Later] = {}
    for routing in ("affinity", "least_loaded"):
        server = start_server(config(routing), env={"LLMSERVER_ADMIN_KEY": ADMIN})
        systems = balanced_systems(MODEL, instance_addresses(server.url, ADMIN), CONVERSATIONS)
        headers = {"Authorization": f"Bearer {create_key(server.data_dir, 'talker')}"}
        results[routing] = asyncio.run(converse(server.url, headers, systems, TURNS))
        # /metrics counts the cached prompt tokens the answers reported (turn 1's included).
        counted = metric(server, ADMIN, "llmserver_cached_prompt_tokens_total", model=MODEL)
        assert counted >= results[routing].cached_tokens > 0
        server.stop()
    affinity, least = results["affinity"], results["least_loaded"]
    print(
        f"\nturns 2-{TURNS} of {CONVERSATIONS} conversations, affinity vs least_loaded: "
        f"median TTFT {affinity.median_ms:.0f} vs {least.median_ms:.0f} ms, "
        f"mean {affinity.mean_ms:.0f} vs {least.mean_ms:.0f} ms, "
        f"prompt tokens from cache {affinity.cached_share:.1%} vs {least.cached_share:.1%}"
    )
    assert affinity.cached_share > 0.9 and affinity.cached_share > least.cached_share
    assert affinity.mean_ms < least.mean_ms
