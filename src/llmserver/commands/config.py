"""`llmserver config`: the effective settings, or the reference table of every setting."""

from __future__ import annotations

import json
from pathlib import Path

import click
from pydantic import BaseModel

from llmserver.commands import load, settings_options
from llmserver.settings import ModelConfig, Settings

COMPUTED = {
    "data_dir": " Default: the per-user data folder (`~/.local/share/llmserver` on Linux).",
    "threads": " Default: the usable CPUs divided by the sum of all models' min_instances (at least 1).",
}


def _table(model: type[BaseModel], prefix: str, env: bool) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        if name == "models":
            continue
        if field.is_required():
            shown = "(required)"
        elif field.default_factory is not None or name in COMPUTED:
            shown = "(computed)"
        else:
            shown = json.dumps(field.get_default(), default=str)
        env_name = f"`LLMSERVER_{name.upper()}`" if env else ""
        description = (field.description or "") + COMPUTED.get(name, "")
        rows.append(f"| `{prefix}{name}` | {shown} | {env_name} | {description} |")
    return rows


def markdown_reference() -> str:
    lines = ["| setting | default | environment | meaning |", "|---|---|---|---|"]
    lines += _table(Settings, "", env=True)
    lines += _table(ModelConfig, "models[].", env=False)
    return "\n".join(lines)


@click.command()
@settings_options
@click.option("--markdown", is_flag=True, help="Print the reference table of all settings instead.")
def config(config_file: Path | None, data_dir: Path | None, markdown: bool) -> None:
    """Print the effective settings as JSON (secrets hidden)."""
    if markdown:
        click.echo(markdown_reference())
        return
    settings = load(config_file, data_dir=data_dir)
    click.echo(settings.model_dump_json(indent=2))
