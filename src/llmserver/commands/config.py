"""`llmserver config`: the effective settings, or the reference table of every setting."""

from __future__ import annotations

import json
from pathlib import Path

import click
from pydantic import BaseModel

from llmserver import settings as settings_module
from llmserver.commands import load, settings_options
from llmserver.settings import ModelConfig, Settings

COMPUTED = {
    "data_dir": " Default: the per-user data folder (`~/.local/share/llmserver` on Linux).",
    "threads": " Default: the usable CPUs divided by the sum of all models' min_instances (at least 1).",
}


def _row(model: type[BaseModel], path: tuple[str, ...], prefix: str, env: bool) -> str:
    name = path[-1]
    field = model.model_fields[name]
    if field.is_required():
        shown = "(required)"
    elif field.default_factory is not None or name in COMPUTED:
        shown = (
            "(computed)" if name in COMPUTED else json.dumps(field.get_default(call_default_factory=True), default=str)
        )
    else:
        shown = json.dumps(field.get_default(), default=str)
    env_name = f"`{settings_module.env_name(path)}`" if env else ""
    description = (field.description or "") + COMPUTED.get(name, "")
    return f"| `{prefix}{'.'.join(path)}` | {shown} | {env_name} | {description} |"


def _owner(path: tuple[str, ...]) -> type[BaseModel]:
    """The model (Settings or a section) that holds the last part of `path`."""
    model: type[BaseModel] = Settings
    for part in path[:-1]:
        kind = model.model_fields[part].annotation
        assert isinstance(kind, type) and issubclass(kind, BaseModel)
        model = kind
    return model


def markdown_reference() -> str:
    lines = ["| setting | default | environment | meaning |", "|---|---|---|---|"]
    lines += [_row(_owner(path), path, "", env=True) for path in settings_module.setting_paths()]
    lines += [_row(ModelConfig, (name,), "models[].", env=False) for name in ModelConfig.model_fields]
    return "\n".join(lines)


def markdown_renamed() -> str:
    """The names settings had before they were put in sections, and where each is now."""
    lines = ["| old name (TOML key, `LLMSERVER_…`) | now |", "|---|---|"]
    for old, path in settings_module.RENAMED.items():
        lines.append(f"| `{old}` | `{'.'.join(path)}` (`{settings_module.env_name(path)}`) |")
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
