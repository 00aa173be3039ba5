"""bench.tenants at its smallest (bench/tenants.py): two keys' conversations on one slot, with the per-key
tier and without — the benchmark measures what it says, and the tier is what makes later turns cached."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.tenants import measure, report


def test_later_turns_come_from_the_cache_with_the_tier_and_not_without(tmp_path: Path) -> None:
    results = [measure(setting, 2, 2, 1, 400, 0.1, tmp_path) for setting in ("key", "key, tier off")]
    tier, without = results
    assert len(tier.turns) == len(without.turns) == 4
    assert tier.cached_fraction() > 0.8 and without.cached_fraction() == 0
    assert tier.saved["files"] == 2 and not without.saved.get("files")
    assert "| key | " in report(results, 2, 2, 1, 0.1)


def test_the_reference_is_plain_llama_server_with_its_own_prompt_cache(tmp_path: Path) -> None:
    result = measure("llama-server", 2, 2, 1, 400, 0.1, tmp_path)
    assert len(result.turns) == 4 and result.cached_fraction() > 0.8  # its cache_n, read from its timings


@pytest.mark.slow
def test_through_two_gateways_and_a_node_later_turns_come_from_the_cache(tmp_path: Path) -> None:
    """`--gateways 2`: the per-key tier runs on the node's instance, through both gateways."""
    result = measure("key", 2, 2, 1, 400, 0.1, tmp_path, gateways=2)
    assert len(result.turns) == 4
    assert result.cached_fraction() > 0.8, result.turns
    assert result.saved["files"] >= 2  # on the node
    assert "through two gateways" in report([result], 2, 2, 1, 0.1, gateways=2)
