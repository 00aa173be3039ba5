"""Rewrite the command reference of docs/reference/cli.md from the CLI's own definitions (click):
every command's usage, help and options. `--check`: exit 1 if the page is not current (the suite runs it)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import click

from llmserver.cli import cli

START, END = "<!-- cli-reference:start -->\n", "<!-- cli-reference:end -->"
PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "cli.md"


def commands(command: click.Command, path: list[str]) -> Iterator[tuple[list[str], click.Command]]:
    if isinstance(command, click.Group):
        if command.invoke_without_command or not command.commands:
            yield path, command
        for name, sub in sorted(command.commands.items()):
            yield from commands(sub, [*path, name])
    else:
        yield path, command


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    parts: list[str] = []
    for path, command in commands(cli, []):
        if not path:
            continue
        name = "llmserver " + " ".join(path)
        context = click.Context(command, info_name=name)
        usage = command.get_usage(context).removeprefix("Usage: ")
        parts += [f"### `{name}`", "", "```", usage, "```", "", cell(command.help or ""), ""]
        rows = []
        for param in command.get_params(context):
            if not isinstance(param, click.Option) or param.hidden or "--help" in param.opts:
                continue
            names = ", ".join(f"`{opt}`" for opt in [*param.opts, *param.secondary_opts])
            if param.metavar or not param.is_flag:
                names += f" {param.make_metavar(context)}" if hasattr(param, "make_metavar") else ""
            rows.append(f"| {cell(names)} | {cell(param.help or '')} |")
        if rows:
            parts += ["| option | meaning |", "|---|---|", *rows, ""]
    return "\n".join(parts).rstrip() + "\n"


def main() -> None:
    text = PAGE.read_text()
    head, rest = text.split(START)
    _, tail = rest.split(END)
    current = head + START + render() + END + tail
    if "--check" in sys.argv:
        sys.exit(0 if current == text else 1)
    PAGE.write_text(current)


if __name__ == "__main__":
    main()
