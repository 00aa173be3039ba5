"""The GPUs of this host, as `nvidia-smi` reports them (none where it is absent or fails): a node counts
their memory in what the scheduler may place on it (cluster/scheduler.py)."""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)

QUERY = ["--query-gpu=index,name,memory.total,memory.used", "--format=csv,noheader,nounits"]


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_total_mb: int
    memory_used_mb: int

    def record(self) -> dict[str, object]:
        return asdict(self)


def detect(binary: str = "nvidia-smi") -> list[Gpu]:
    """The host's NVIDIA GPUs; [] without `nvidia-smi`, or when it fails (no driver, no device)."""
    found = shutil.which(binary)
    if found is None:
        return []
    try:
        ran = subprocess.run([found, *QUERY], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("nvidia-smi did not answer (%s): no GPU memory counted", exc)
        return []
    if ran.returncode != 0:
        log.warning("nvidia-smi failed (%s): no GPU memory counted", ran.stderr.strip() or ran.returncode)
        return []
    gpus = []
    for line in ran.stdout.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 4:
            continue
        try:
            gpus.append(Gpu(int(fields[0]), fields[1], int(float(fields[2])), int(float(fields[3]))))
        except ValueError:
            log.warning("nvidia-smi line not understood: %r", line)
    return gpus


def budget_mb(gpus: list[Gpu], configured: int) -> int:
    """GPU memory instances may take on this host: `gpu_memory_budget_mb` if set, else 90% of the GPUs'."""
    return configured or int(sum(g.memory_total_mb for g in gpus) * 0.9)
