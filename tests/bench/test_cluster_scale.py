"""The many-hosts simulation (bench/cluster_scale.py) runs, small: its stand-in nodes are read back whole,
the scheduler places every new instance, and Redis's counters saw the reads."""

from __future__ import annotations

import asyncio

from bench.cluster_scale import measure, report


def test_the_simulation_measures_what_it_says() -> None:
    figures = asyncio.run(measure(nodes=20, per_node=5, rounds=2, window=1.0))
    assert figures["instances"] == 100
    assert figures["registry_read_ms"] > 0 and figures["plan_100_new_ms"] > 0
    assert figures["redis_commands_per_s"] > 0 and figures["redis_kib_out_per_s"] > 0
    assert "20 nodes, 100 instances" in report(figures)
