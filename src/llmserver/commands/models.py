"""`llmserver models`: the configured models and the files they resolve to."""

from __future__ import annotations

from pathlib import Path

import click

from llmserver.catalog import ModelFileError, model_path
from llmserver.commands import load, settings_options


@click.command()
@settings_options
def models(config_file: Path | None, data_dir: Path | None) -> None:
    """List the configured models; fail if a model's GGUF file is missing."""
    settings = load(config_file, data_dir=data_dir)
    missing = False
    for model in settings.models:
        try:
            location = str(model_path(model))
        except ModelFileError as exc:
            location, missing = f"MISSING: {exc}", True
        click.echo(
            f"{model.name}  instances={model.min_instances}-{model.max_instances} parallel={model.parallel} "
            f"ctx={model.ctx_size} threads={model.threads}  {location}"
        )
    if missing:
        raise click.ClickException("some models have no GGUF file")
