"""Where saved prompt caches should live: a slot's state restored from a folder on disk against one in RAM
(tmpfs, /dev/shm), with the file in the page cache (as after a recent save) and out of it (dropped, as after
memory pressure or a reboot; needs root), against reading the prompt again.

    python -m bench.slot_store [--tokens 1500] [--rounds 7] [--disk DIR] [--out bench/results/slot-store.md]

One llama-server (the embedded model, one slot) per folder, started with `--slot-save-path` there. Its slot
reads a prompt of about `--tokens` tokens and is saved; then, `--rounds` times, the slot is erased and the
state restored (timed), the page cache dropped first for the cold figure. The prompt read again from an erased
slot is the recompute figure. Medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench.targets import Target, free_port, model_config, wait_ready
from llmserver.models.files import embedded_model_path, llama_server_binary
from llmserver.pool.instance import llama_server_args

WORDS = ["river", "stone", "light", "paper", "garden", "window", "music", "engine", "forest", "letter", "copper"]


def _drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        return False
    return True


def measure(folder: Path, tokens: int, rounds: int, logs: Path) -> dict[str, float]:
    model = model_config(parallel=1, ctx_size=max(2048, tokens * 2), threads=2)
    port = free_port()
    args = llama_server_args(llama_server_binary(None), embedded_model_path(), model, "127.0.0.1", port)
    with (logs / "llama-server.log").open("ab") as log:
        process = subprocess.Popen([*args, "--slot-save-path", str(folder)], stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)  # fmt: skip
    target = wait_ready(Target("llama-server", f"http://127.0.0.1:{port}", process), "/health")
    try:
        with httpx.Client(base_url=target.url, timeout=300) as client:
            prompt = " ".join(WORDS[i % len(WORDS)] for i in range(int(tokens / 1.3)))

            def read() -> float:
                began = time.perf_counter()
                answer = client.post("/completion", json={"prompt": prompt, "n_predict": 1, "id_slot": 0,
                                                          "cache_prompt": True})  # fmt: skip
                answer.raise_for_status()
                return time.perf_counter() - began

            read()
            saved = client.post("/slots/0?action=save", json={"filename": "state.slot"}).json()
            size = (folder / "state.slot").stat().st_size
            warm, cold, again = [], [], []
            for _ in range(rounds):
                for times, drop in ((warm, False), (cold, True)):
                    client.post("/slots/0?action=erase").raise_for_status()
                    if drop and not _drop_page_cache():
                        continue
                    began = time.perf_counter()
                    client.post("/slots/0?action=restore", json={"filename": "state.slot"}).raise_for_status()
                    times.append(time.perf_counter() - began)
                client.post("/slots/0?action=erase").raise_for_status()
                again.append(read())
            return {
                "tokens": float(saved.get("n_saved", 0)), "mb": size / 1e6,
                "warm": statistics.median(warm) * 1000,
                "cold": statistics.median(cold) * 1000 if cold else float("nan"),
                "recompute": statistics.median(again) * 1000,
            }  # fmt: skip
    finally:
        target.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--disk", type=Path, default=Path("/var/tmp"), help="a folder on disk")
    parser.add_argument("--ram", type=Path, default=Path("/dev/shm"), help="a folder on tmpfs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for label, base in (("disk", args.disk), ("RAM (tmpfs)", args.ram)):
            with tempfile.TemporaryDirectory(dir=base) as folder:
                figures = measure(Path(folder), args.tokens, args.rounds, Path(logs))
            rows.append(
                f"| {label} ({base}) | {figures['tokens']:.0f} | {figures['mb']:.1f} | {figures['warm']:.0f} | "
                f"{figures['cold']:.0f} | {figures['recompute']:.0f} |"
            )
    report = "\n".join([
        f"Slot state restored from disk and from RAM, medians of {args.rounds} (ms)",
        "",
        "| folder | tokens | MB | restore, in page cache | restore, page cache dropped | prompt read again |",
        "|---|---:|---:|---:|---:|---:|",
        *rows,
    ])  # fmt: skip
    print(report)
    if args.out is not None:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
