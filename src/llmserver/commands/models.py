"""`llmserver models`: the configured models and their files; `models pull` downloads ahead of time."""

from __future__ import annotations

from pathlib import Path

import click

from llmserver.catalog import BUILTIN, ModelFileError, mmproj_path, model_path
from llmserver.commands import load, models_from_args, settings_options


@click.group(invoke_without_command=True)
@settings_options
@click.pass_context
def models(ctx: click.Context, config_file: Path | None, data_dir: Path | None) -> None:
    """List the configured models and their GGUF files (without downloading)."""
    if ctx.invoked_subcommand is not None:
        return
    settings = load(config_file, data_dir=data_dir)
    missing = False
    for model in settings.models:
        try:
            location = str(model_path(model, settings.model_cache_dir, settings.hf_endpoint, download=False))
        except ModelFileError as exc:
            location, missing = f"MISSING: {exc}", True
        click.echo(
            f"{model.name}  instances={model.min_instances}-{model.max_instances} parallel={model.parallel} "
            f"ctx={model.ctx_size} threads={model.threads}  {location}"
        )
    click.echo(f"built-in names for --model: {', '.join(BUILTIN)}", err=True)
    if missing:
        raise click.ClickException("some models have no GGUF file yet")


@models.command()
@settings_options
@click.argument("names", nargs=-1, required=True)
def pull(config_file: Path | None, data_dir: Path | None, names: tuple[str, ...]) -> None:
    """Download models (configured or built-in names) into the data folder now."""
    settings = load(config_file, data_dir=data_dir)
    for model in models_from_args(names, settings.models, param="NAMES") or []:
        try:
            path = model_path(model, settings.model_cache_dir, settings.hf_endpoint)
            mmproj = mmproj_path(model, settings.model_cache_dir, settings.hf_endpoint)
        except ModelFileError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"{model.name}: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
        if mmproj is not None:
            click.echo(f"{model.name} (vision): {mmproj} ({mmproj.stat().st_size / 2**20:.1f} MiB)")
