"""The README's settings table is the one the settings generate."""

from __future__ import annotations

from pathlib import Path

from llmserver.commands.config import markdown_reference

README = Path(__file__).resolve().parent.parent / "README.md"


def test_settings_table_is_current() -> None:
    text = README.read_text()
    start = text.index("<!-- settings-table:start -->\n") + len("<!-- settings-table:start -->\n")
    end = text.index("<!-- settings-table:end -->")
    assert text[start:end].strip() == markdown_reference().strip(), "run .venv/bin/python scripts/readme_settings.py"
