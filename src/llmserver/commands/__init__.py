"""One module per CLI command, sharing the options that locate the settings."""

from __future__ import annotations

import logging
import os
import tomllib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from pydantic import ValidationError

from llmserver import logs
from llmserver.auth.audit import RECORDED
from llmserver.models.files import BUILTIN, known_model
from llmserver.settings import DEFAULT_MODEL_NAME, ModelConfig, Settings, load_settings, meant

if TYPE_CHECKING:
    from llmserver.store import Store

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def debugging() -> bool:
    """--debug (or LLMSERVER_DEBUG=1): tracebacks instead of one-line errors, and debug logs."""
    return os.environ.get("LLMSERVER_DEBUG", "") not in ("", "0")


def remember(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        ctx.meta[f"llmserver.{param.name}"] = value


def settings_options(func: F) -> F:
    """--config, --data-dir and --database-url, which every command that touches state accepts."""
    func = click.option(
        "--database-url", default=None, expose_value=False, callback=remember,
        help="sqlite:///PATH or postgresql://… (default: $LLMSERVER_STATE__DATABASE_URL, else the data folder's "
        "SQLite file).",
    )(func)  # fmt: skip
    func = click.option(
        "--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
        help="Data folder (default: $LLMSERVER_DATA_DIR, else the per-user data folder).",
    )(func)  # fmt: skip
    func = click.option(
        "--config", "config_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
        help="TOML configuration file.",
    )(func)  # fmt: skip
    return func


def load(config_file: Path | None, *, logged: bool = False, **overrides: Any) -> Settings:
    """Settings, or a clean CLI error that says what is wrong with them. Options that every command
    takes without naming them (--database-url) are applied here. A deprecated setting name they were
    read with is a line on stderr each, or (`logged`: serve and node) in the log (`configure_logs`)."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        for name, path in (("database_url", ("state", "database_url")), ("redis_url", ("state", "redis_url")),
                           ("role", ("role",))):  # fmt: skip
            value = ctx.meta.get(f"llmserver.{name}")  # shared by every context of the command line
            if value is not None:
                section = overrides
                for part in path[:-1]:
                    section = overrides[part] = dict(overrides.get(part) or {})
                section.setdefault(path[-1], value)
    try:
        settings = load_settings(config_file, **overrides)
    except FileNotFoundError as exc:
        raise click.UsageError(str(exc)) from None
    except tomllib.TOMLDecodeError as exc:
        raise click.UsageError(f"config file {config_file} is not valid TOML: {exc}") from None
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc']) or 'settings'}: {error['msg']}{_did_you_mean(error)}"
            for error in exc.errors()
        )
        raise click.UsageError(f"invalid settings: {problems}") from None
    if not logged:
        for line in settings.deprecations:
            click.echo(f"warning: {line}", err=True)
    return settings


def _did_you_mean(error: Any) -> str:
    if error.get("type") != "extra_forbidden" or not error.get("loc"):
        return ""
    close = meant(tuple(error["loc"]))
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def configure_logs(settings: Settings) -> None:
    """The logs as the settings say, then a warning for each deprecated setting name they were read with."""
    logs.configure(settings.observability.log_level, settings.observability.log_format)
    for line in settings.deprecations:
        logging.getLogger("llmserver.settings").warning("%s", line)


def models_from_args(
    specs: tuple[str, ...], configured: list[ModelConfig], param: str = "--model"
) -> list[ModelConfig] | None:
    """`--model` values: a configured model's name, a built-in name, or a .gguf path."""
    if not specs:
        return None
    chosen: list[ModelConfig] = []
    by_name = {m.name: m for m in configured}
    for spec in specs:
        if spec in by_name:
            chosen.append(by_name[spec])
        elif (known := known_model(spec)) is not None:
            chosen.append(known)
        elif spec.endswith(".gguf"):
            path = Path(spec).expanduser()
            chosen.append(ModelConfig(name=path.stem, path=path))
        else:
            raise click.BadParameter(
                f"{spec!r} is neither a configured model, a built-in one "
                f"({', '.join([DEFAULT_MODEL_NAME, *BUILTIN])}), nor a .gguf file",
                param_hint=param,
            )
    return chosen


def server_url(config_file: Path | None, data_dir: Path | None, url: str | None) -> str:
    """The running server to talk to: --url, else the settings' host and port."""
    if url is not None:
        return url
    settings = load(config_file, data_dir=data_dir)
    host = "127.0.0.1" if settings.server.host in ("0.0.0.0", "::") else settings.server.host
    return f"http://{host}:{settings.server.port}"


async def open_cli_store(settings: Settings, *, migrate: bool = False) -> Store:
    """The configured store, or a CLI error that says what to do: a wrong URL or schema (usage, exit 2),
    a database that cannot be reached (exit 1)."""
    from llmserver.errors import APIError
    from llmserver.store import SchemaError, open_store

    try:
        return await open_store(settings.state.database_url, migrate=migrate)
    except (ValueError, SchemaError) as exc:
        raise click.UsageError(str(exc)) from None
    except APIError as exc:
        raise click.ClickException(exc.message) from None


@dataclass
class Audited:
    """A change the command makes, for the audit log (auth/audit.py `operator_row`): its action and target,
    what it asks to change, and whether what `use` returned means it was found (else the row says 404)."""

    action: str
    target: str | None = None
    change: Mapping[str, Any] | None = None
    target_of: Callable[[Any], str | None] = lambda result: None  # a create's target: what it made
    found: Callable[[Any], bool] = bool


def with_store(settings: Settings, use: Callable[[Store], Awaitable[T]], audited: Audited | None = None) -> T:
    """Run `use` on the configured store, closed afterwards (the CLI's one event loop per command); with
    `audited`, the change is written to the audit log with the outcome it had, as the API's are."""

    import asyncio

    from llmserver.auth.audit import operator_row
    from llmserver.errors import APIError, FieldProblem
    from llmserver.settings import ModelConfig

    async def run() -> T:
        store = await open_cli_store(settings)
        try:
            if audited is None:
                return await use(store)
            status, target = 500, audited.target
            try:
                result = await use(store)
                target = target or audited.target_of(result)
                status = (201 if audited.action.endswith(".create") else 200) if audited.found(result) else 404
                return result
            except (FieldProblem, click.UsageError):
                status = 400
                raise
            except APIError as exc:
                status = exc.status
                raise
            finally:
                recorded = RECORDED | frozenset(ModelConfig.model_fields)
                try:
                    await store.audit_append(operator_row(audited.action, target, audited.change, status, recorded))
                except APIError as exc:
                    logging.getLogger(__name__).error("the audit row of %s was not written: %s", audited.action,
                                                      exc.message)  # fmt: skip
        finally:
            await store.close()

    return asyncio.run(run())


def open_checked_store(settings: Settings, *, migrate: bool = False) -> int:
    """Open the configured store and close it again: the schema version it has (CLI errors as above)."""
    import asyncio

    async def check() -> int:
        store = await open_cli_store(settings, migrate=migrate)
        try:
            return store.schema_version
        finally:
            await store.close()

    return asyncio.run(check())


def check_catalog(settings: Settings) -> None:
    """The config file's models brought into the model catalog before a server starts: a file and a
    catalog that disagree (models/catalog.py) are one clean line, exit status 1."""
    import asyncio

    from llmserver.models.catalog import CatalogConflict, seed

    async def check() -> None:
        store = await open_cli_store(settings)
        try:
            await seed(store, settings)
        finally:
            await store.close()

    try:
        asyncio.run(check())
    except CatalogConflict as exc:
        raise click.ClickException(str(exc)) from None


def check_model_files(settings: Settings, models: list[ModelConfig] | None = None) -> None:
    """Every model file found (or downloaded) before a server or node starts (`models`, else the
    configured ones): a missing one is one clean line (ModelFileError, exit status 2), not a start-up
    traceback."""
    from llmserver.models.files import mmproj_path, model_path

    for model in settings.models if models is None else models:
        model_path(model, settings.model_cache_dir, settings.hf_endpoint)
        mmproj_path(model, settings.model_cache_dir, settings.hf_endpoint)


log_level_option = click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default=None,
    help="Log level (default: log_level, info).",
)
