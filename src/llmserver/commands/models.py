"""`llmserver models`: the configured models and their files; `models pull` downloads ahead of time;
`models list|add|update|remove`: the model catalog in the database."""

from __future__ import annotations

import time
import tomllib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from llmserver.commands import Audited, load, models_from_args, server_url, settings_options, with_store
from llmserver.commands.instances import admin_call, admin_key, key_option, url_option
from llmserver.errors import APIError
from llmserver.models import catalog as model_catalog
from llmserver.models.files import BUILTIN, ModelFileError, mmproj_path, model_path
from llmserver.settings import FileRoots
from llmserver.store import CatalogEntry, Store

T = TypeVar("T")


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


# The model catalog (models/catalog.py): what every gateway serves, in the shared database.


def _settings_from(pairs: tuple[str, ...]) -> dict[str, Any]:
    """`--set KEY=VALUE` pairs: each value read as TOML (2, 1.5, true, "text", ["a", "b"]), else as text."""
    fields: dict[str, Any] = {}
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if not equals or not key.strip():
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--set")
        try:
            fields[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            fields[key.strip()] = value
    return fields


def _catalog(
    settings_file: Path | None,
    data_dir: Path | None,
    use: Callable[[Store, FileRoots], Awaitable[T]],
    audited: Audited | None = None,
) -> T:
    try:
        settings = load(settings_file, data_dir=data_dir)
        return with_store(settings, lambda store: use(store, settings.model_file_roots()), audited)
    except APIError as exc:
        raise click.ClickException(exc.message) from None


def _show(entry: CatalogEntry) -> str:
    return f"{entry.name}  revision {entry.revision}  ({entry.origin})  {entry.config}"


@models.command("list")
@settings_options
@click.option("--status", is_flag=True, help="Also how each model runs, from the running server's admin API.")
@url_option
@key_option
def list_catalog(
    config_file: Path | None, data_dir: Path | None, status: bool, url: str | None, key: str | None
) -> None:
    """The model catalog: every model the gateways serve, with its settings (those not at their default);
    with --status, also its instances, why it cannot run (blocked), its file downloading and its last
    failed start, as the running server sees them."""
    entries = _catalog(config_file, data_dir, lambda store, _: store.catalog())
    running: dict[str, dict[str, Any]] = {}
    if status:
        answer = admin_call(server_url(config_file, data_dir, url), admin_key(key), "/api/models")
        running = {row["name"]: row for row in answer["data"]}
    for entry in entries:
        click.echo(_show(entry))
        if entry.name in running:
            for line in _how_it_runs(running[entry.name]):
                click.echo(f"    {line}")
    if not entries:
        click.echo("the model catalog is empty: add a model with `llmserver models add NAME`", err=True)


def _how_it_runs(row: dict[str, Any]) -> list[str]:
    lines = [f"{row.get('ready_instances', 0)} ready of {row.get('instances', 0)}, {row.get('queue_depth', 0)} waiting"]
    if row.get("blocked"):
        lines.append(f"blocked: {row['blocked']}")
    for fetch in row.get("fetching") or []:
        where = f" on {fetch['node']}" if fetch.get("node") else ""
        total = f" of {fetch['total'] / 2**20:.1f}" if fetch.get("total") else ""
        lines.append(f"downloading its file{where}: {fetch['bytes'] / 2**20:.1f}{total} MiB")
    failed = row.get("last_start_failure")
    if failed:
        where = f" on {failed['node']}" if failed.get("node") else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(failed["at"]))
        lines.append(f"last start failed{where} at {when}: {failed['message']}")
        lines += [f"  | {line}" for line in failed.get("log") or []]
    return lines


set_option = click.option(
    "--set", "pairs", multiple=True, metavar="KEY=VALUE",
    help="A model setting (repeatable), as in a [[models]] table: --set min_instances=2 --set ctx_size=8192.",
)  # fmt: skip


@models.command()
@settings_options
@click.argument("name")
@click.option("--path", default=None, help="The GGUF file, as the nodes see it (default: the embedded model).")
@click.option("--hf-repo", default=None, help="A Hugging Face repo to fetch the GGUF from (with --hf-file).")
@click.option("--hf-file", default=None, help="The GGUF file in --hf-repo.")
@set_option
def add(
    config_file: Path | None, data_dir: Path | None, name: str, path: str | None, hf_repo: str | None,
    hf_file: str | None, pairs: tuple[str, ...],
) -> None:  # fmt: skip
    """Add a model to the catalog; running gateways serve it within seconds."""
    given = {"path": path, "hf_repo": hf_repo, "hf_file": hf_file}
    fields = {
        "name": name,
        **{key: value for key, value in given.items() if value is not None},
        **_settings_from(pairs),
    }
    audited = Audited("models.create", name, fields)
    click.echo(
        _show(_catalog(config_file, data_dir, lambda store, roots: model_catalog.add(store, fields, roots), audited))
    )


@models.command()
@settings_options
@click.argument("name")
@set_option
@click.option("--reset", multiple=True, metavar="KEY", help="A setting back to its default (repeatable).")
def update(
    config_file: Path | None, data_dir: Path | None, name: str, pairs: tuple[str, ...], reset: tuple[str, ...]
) -> None:
    """Change a model's settings; its instances roll over to them one at a time where they must restart."""
    changes: dict[str, Any] = {**_settings_from(pairs), **dict.fromkeys(reset)}
    if not changes:
        raise click.UsageError("nothing to change: give --set KEY=VALUE or --reset KEY")
    click.echo(
        _show(
            _catalog(
                config_file,
                data_dir,
                lambda store, roots: model_catalog.update(store, name, changes, roots),
                Audited("models.update", name, changes),
            )
        )
    )


@models.command()
@settings_options
@click.argument("name")
def stop(config_file: Path | None, data_dir: Path | None, name: str) -> None:
    """Stop a model now and keep it in the catalog (max_instances 0): its instances drain, its requests are
    answered 503 at once, until `llmserver models start`."""
    entry = _catalog(
        config_file, data_dir, lambda store, roots: model_catalog.stop(store, name, roots), Audited("models.stop", name)
    )
    click.echo(f"stopped {entry.name} (revision {entry.revision}): its instances drain")


@models.command()
@settings_options
@click.argument("name")
@click.option("--instances", type=click.IntRange(0, 64), default=1, show_default=True,
              help="Instances kept running (min_instances); 0: started on demand.")  # fmt: skip
def start(config_file: Path | None, data_dir: Path | None, name: str, instances: int) -> None:
    """Start a model again (or keep more of it running): min_instances INSTANCES, max_instances at least that."""
    entry = _catalog(
        config_file,
        data_dir,
        lambda store, roots: model_catalog.start(store, name, instances, roots),
        Audited("models.start", name, {"instances": instances}),
    )
    click.echo(_show(entry))


@models.command()
@settings_options
@click.argument("name")
def remove(config_file: Path | None, data_dir: Path | None, name: str) -> None:
    """Remove a model from the catalog: its instances drain, and its requests are answered 404."""
    entry = _catalog(
        config_file, data_dir, lambda store, _: model_catalog.remove(store, name), Audited("models.delete", name)
    )
    click.echo(f"removed {entry.name} (revision {entry.revision})")
