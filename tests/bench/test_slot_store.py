"""bench.slot_store measures what it says: a restored state is far quicker than the prompt read again."""

from __future__ import annotations

from pathlib import Path

from bench.slot_store import measure


def test_a_restore_from_each_folder_beats_reading_the_prompt_again(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    (tmp_path / "logs").mkdir()
    figures = measure(tmp_path / "store", tokens=400, rounds=1, logs=tmp_path / "logs")
    assert figures["tokens"] >= 300 and figures["mb"] > 1
    assert figures["warm"] * 5 < figures["recompute"], figures
    assert (tmp_path / "store" / "state.slot").is_file()
