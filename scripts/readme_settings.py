"""Rewrite the README's settings table from the settings' own descriptions (run after changing them)."""

from pathlib import Path

from llmserver.commands.config import markdown_reference

START, END = "<!-- settings-table:start -->\n", "<!-- settings-table:end -->"
readme = Path(__file__).resolve().parent.parent / "README.md"
text = readme.read_text()
head, rest = text.split(START)
_, tail = rest.split(END)
readme.write_text(head + START + markdown_reference() + "\n" + END + tail)
