"""A host's GPUs as nvidia-smi reports them (llmserver/gpu.py). This machine has no GPU: the real call
finds none; what nvidia-smi prints on one (its CSV query output) comes from a stand-in script, the one
fake here, for hardware the suite cannot have."""

from __future__ import annotations

import stat
from pathlib import Path

from llmserver import gpu


def stand_in(folder: Path, output: str, status: int = 0) -> str:
    script = folder / "nvidia-smi"
    script.write_text(f'#!/bin/sh\n[ "$1" = "{gpu.QUERY[0]}" ] || exit 9\nprintf \'{output}\'\nexit {status}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_a_host_without_nvidia_smi_has_no_gpu() -> None:
    assert gpu.detect("nvidia-smi-that-is-not-installed") == []
    assert gpu.budget_mb([], 0) == 0 and gpu.budget_mb([], 4096) == 4096


def test_two_gpus_are_read_and_their_memory_budgeted(tmp_path: Path) -> None:
    found = gpu.detect(stand_in(tmp_path, "0, NVIDIA H200, 143771, 512\\n1, NVIDIA H200, 143771, 0\\n"))
    assert found == [gpu.Gpu(0, "NVIDIA H200", 143771, 512), gpu.Gpu(1, "NVIDIA H200", 143771, 0)]
    assert gpu.budget_mb(found, 0) == int(2 * 143771 * 0.9)
    assert gpu.budget_mb(found, 100_000) == 100_000


def test_a_failing_nvidia_smi_counts_no_gpu(tmp_path: Path) -> None:
    assert gpu.detect(stand_in(tmp_path, "NVIDIA-SMI has failed\\n", status=9)) == []
    assert gpu.detect(stand_in(tmp_path, "0, NVIDIA H200, N/A, N/A\\n")) == []  # a line it cannot read
