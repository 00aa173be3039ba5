"""Rewrite the settings tables of docs/reference/configuration.md (every setting; the old names and
where each now lives) from the settings themselves (run after changing them; tests/test_docs.py checks
they are current)."""

from pathlib import Path

from llmserver.commands.config import markdown_reference, markdown_renamed

page = Path(__file__).resolve().parent.parent / "docs" / "reference" / "configuration.md"
text = page.read_text()
for name, table in (("settings-table", markdown_reference()), ("renamed-table", markdown_renamed())):
    start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
    head, rest = text.split(start)
    _, tail = rest.split(end)
    text = head + start + table + "\n" + end + tail
page.write_text(text)
