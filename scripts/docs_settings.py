"""Rewrite the settings table of docs/reference/configuration.md from the settings' own descriptions
(run after changing them; tests/test_docs.py checks it is current)."""

from pathlib import Path

from llmserver.commands.config import markdown_reference

START, END = "<!-- settings-table:start -->\n", "<!-- settings-table:end -->"
page = Path(__file__).resolve().parent.parent / "docs" / "reference" / "configuration.md"
text = page.read_text()
head, rest = text.split(START)
_, tail = rest.split(END)
page.write_text(head + START + markdown_reference() + "\n" + END + tail)
