"""`llmserver keys`: create, list and revoke API keys in the data folder's database."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, TypeVar

import click

from llmserver.auth.keys import KeyService, check_limits, describe
from llmserver.commands import F, load, settings_options, with_store
from llmserver.errors import APIError, FieldProblem
from llmserver.metrics.usage import parse_time, summarise
from llmserver.store import KeyLimits

T = TypeVar("T")


def _keys(config_file: Path | None, data_dir: Path | None, use: Callable[[KeyService], Awaitable[T]]) -> T:
    return with_store(load(config_file, data_dir=data_dir), lambda store: use(KeyService(store)))


@click.group()
def keys() -> None:
    """Manage API keys (changes take effect at once, also on a running server)."""


def limit_options(func: F) -> F:
    func = click.option(
        "--models", default=None, help="Comma-separated model names or patterns the key may use (default: all)."
    )(func)
    func = click.option("--max-concurrency", type=int, default=None, help="Requests in flight at once.")(func)
    func = click.option("--rpm", type=int, default=None, help="Requests per minute.")(func)
    func = click.option(
        "--quota-period", type=click.Choice(["day", "month", "total"]), default=None, help="The quota's period."
    )(func)
    func = click.option("--quota-tokens", type=int, default=None, help="Token quota (prompt + completion).")(func)
    return func


def _limits(
    quota_tokens: int | None,
    quota_period: str | None,
    rpm: int | None,
    max_concurrency: int | None,
    models: str | None,
) -> KeyLimits:
    limits = KeyLimits(quota_tokens, quota_period, rpm, max_concurrency, _models(models))
    try:
        return check_limits(limits)
    except FieldProblem as exc:
        raise click.UsageError(f"{exc.param}: {exc}") from None


def _models(listed: str | None) -> tuple[str, ...] | None:
    """The allow-list given: absent, every model; "" none; an empty entry (`a,,b`, `,,,`) is refused rather
    than read as nothing (which would be every model or none, and neither is what was typed)."""
    if listed is None:
        return None
    if not listed.strip():
        return ()
    names = tuple(name.strip() for name in listed.split(","))
    if not all(names):
        raise click.BadParameter(f"{listed!r} has an empty entry between its commas", param_hint="--models")
    return names


@keys.command()
@settings_options
@click.option("--name", required=True, help="Who or what the key is for.")
@click.option("--admin", is_flag=True, help="Allow the admin API.")
@limit_options
def create(
    config_file: Path | None,
    data_dir: Path | None,
    name: str,
    admin: bool,
    quota_tokens: int | None,
    quota_period: str | None,
    rpm: int | None,
    max_concurrency: int | None,
    models: str | None,
) -> None:
    """Create a key and print it, alone on the last line. It is shown only this once."""
    limits = _limits(quota_tokens, quota_period, rpm, max_concurrency, models)
    record, key = _keys(config_file, data_dir, lambda service: service.create(name, admin=admin, limits=limits))
    click.echo(
        f"created {'admin ' if record.is_admin else ''}key {record.id} ({record.name}); it is shown only once:",
        err=True,
    )
    click.echo(key)


@keys.command("list")
@settings_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def list_keys(config_file: Path | None, data_dir: Path | None, as_json: bool) -> None:
    """List keys (never the keys themselves: their id, name and fingerprint)."""
    records = _keys(config_file, data_dir, lambda service: service.list())
    if as_json:
        click.echo(json.dumps([describe(record) for record in records], indent=2))
        return
    click.echo(f"{'ID':<18} {'NAME':<24} {'ADMIN':<6} {'FINGERPRINT':<12} {'QUOTA':<16} {'CREATED':<26} REVOKED")
    for r in records:
        quota = f"{r.limits.quota_tokens}/{r.limits.quota_period}" if r.limits.quota_tokens else "-"
        click.echo(
            f"{r.id:<18} {r.name[:24]:<24} {'yes' if r.is_admin else 'no':<6} {r.fingerprint:<12} {quota:<16} "
            f"{r.created_at:<26} {r.revoked_at or '-'}"
        )


CLEARABLE = {"quota": ("quota_tokens", "quota_period"), "rpm": ("rpm",),
             "max-concurrency": ("max_concurrency",), "models": ("models",)}  # fmt: skip


@keys.command()
@settings_options
@click.argument("key_id")
@limit_options
@click.option(
    "--clear", "cleared", multiple=True, type=click.Choice(list(CLEARABLE)), help="Remove a limit. Repeatable."
)
def update(
    config_file: Path | None,
    data_dir: Path | None,
    key_id: str,
    quota_tokens: int | None,
    quota_period: str | None,
    rpm: int | None,
    max_concurrency: int | None,
    models: str | None,
    cleared: tuple[str, ...],
) -> None:
    """Change the limits given (as PATCH /api/keys/ID does); the others stay; --clear removes one."""

    async def change(service: KeyService) -> bool:
        record = await service.get(key_id)
        if record is None:
            return False
        given = KeyLimits(quota_tokens, quota_period, rpm, max_concurrency, _models(models))
        changes: dict[str, Any] = {name: value for name, value in asdict(given).items() if value is not None}
        changes.update({field: None for name in cleared for field in CLEARABLE[name]})
        try:
            return await service.update(key_id, replace(record.limits, **changes))
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None

    if not _keys(config_file, data_dir, change):
        raise click.ClickException(f"no key with id {key_id}")
    click.echo(f"updated {key_id}")


@keys.command()
@settings_options
@click.argument("key_id")
@click.option("--since", default=None, help="Unix seconds or ISO-8601 (default: the beginning).")
@click.option("--until", default=None, help="Unix seconds or ISO-8601 (default: now).")
def usage(config_file: Path | None, data_dir: Path | None, key_id: str, since: str | None, until: str | None) -> None:
    """Summarise a key's usage from the ledger, as JSON."""
    settings = load(config_file, data_dir=data_dir)
    try:
        start, end = parse_time(since, 0.0, "since"), parse_time(until, time.time() + 1, "until")
    except APIError as exc:
        raise click.UsageError(exc.message) from None
    summary = with_store(settings, lambda store: summarise(store, key_id, start, end))
    click.echo(json.dumps(summary, indent=2))


@keys.command()
@settings_options
@click.argument("key_id")
def revoke(config_file: Path | None, data_dir: Path | None, key_id: str) -> None:
    """Revoke the key with this id."""
    if not _keys(config_file, data_dir, lambda service: service.revoke(key_id)):
        raise click.ClickException(f"no active key with id {key_id}")
    click.echo(f"revoked {key_id}")
