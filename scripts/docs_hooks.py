"""mkdocs hook: the benchmark's charts (bench/results/*.png) serve as the pages' images (img/NAME.png)
without a copy in docs/ that would go stale when the benchmark is run again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def on_files(files: Files, config: Any) -> Files:
    for chart in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"img/{chart.name}", abs_src_path=str(chart)))
    return files
