"""`llmserver keys`: create, list, change, rotate and revoke API keys in the data folder's database."""

from __future__ import annotations

import datetime
import functools
import json
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any, TypeVar

import click

from llmserver.auth.keys import DEFAULT_GRACE, MAX_GRACE, KeyService, check_expiry, check_limits, describe
from llmserver.commands import Audited, load, settings_options, with_store
from llmserver.errors import APIError, FieldProblem
from llmserver.metrics.usage import parse_time, summarise
from llmserver.store import KeyLimits, KeyRecord, Store, TeamStore

T = TypeVar("T")


def _keys(
    config_file: Path | None,
    data_dir: Path | None,
    use: Callable[[KeyService], Awaitable[T]],
    audited: Audited | None = None,
) -> T:
    return with_store(load(config_file, data_dir=data_dir), lambda store: use(KeyService(store)), audited)


def _limits_change(limits: KeyLimits) -> dict[str, Any]:
    return {name: value for name, value in asdict(limits).items() if value is not None}


@click.group()
def keys() -> None:
    """Manage API keys (changes take effect at once, also on a running server)."""


# The limits a key and a team share, one option each, in KeyLimits' order (a new limit is added here only).
PERIODS = click.Choice(["day", "month", "total"])
LIMIT_OPTIONS = (
    click.option("--quota-tokens", type=int, default=None, help="Token quota (prompt + completion)."),
    click.option("--quota-period", type=PERIODS, default=None, help="The quota's period."),
    click.option("--rpm", type=int, default=None, help="Requests per minute."),
    click.option("--max-concurrency", type=int, default=None, help="Requests in flight at once."),
    click.option(
        "--models", default=None, help="Comma-separated model names or patterns the key may use (default: all)."
    ),
    click.option("--budget", type=float, default=None, help="What requests may cost, in billing.currency."),
    click.option("--budget-period", type=PERIODS, default=None, help="The budget's period."),
)
LIMIT_NAMES = tuple(field.name for field in fields(KeyLimits))


def limit_options(func: Callable[..., None]) -> Callable[..., None]:
    """The limit options, handed to the command as one `given` KeyLimits: each limit as given, None where its
    option was not (the allow-list read by `models_given`), not yet checked together."""

    @functools.wraps(func)
    def command(*args: Any, **options: Any) -> None:
        values = {name: options.pop(name) for name in LIMIT_NAMES}
        func(*args, given=replace(KeyLimits(**values), models=models_given(values["models"])), **options)

    for option in reversed(LIMIT_OPTIONS):
        command = option(command)
    return command


def checked(limits: KeyLimits) -> KeyLimits:
    """The limits, if they make sense together; else a usage error naming the field."""
    try:
        return check_limits(limits)
    except FieldProblem as exc:
        raise click.UsageError(f"{exc.param}: {exc}") from None


def changed(limits: KeyLimits, given: KeyLimits, cleared: Iterable[str]) -> KeyLimits:
    """`limits` with the limits given set and those of the `--clear` options named removed."""
    changes: dict[str, Any] = {name: value for name, value in asdict(given).items() if value is not None}
    changes.update({field: None for name in cleared for field in CLEARABLE[name]})
    return replace(limits, **changes)


def models_given(listed: str | None) -> tuple[str, ...] | None:
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


def _expiry(expires: str | None) -> float | None:
    if expires is None:
        return None
    try:
        return check_expiry(parse_time(expires, 0.0, "--expires"))
    except APIError as exc:
        raise click.BadParameter(exc.message, param_hint="--expires") from None
    except FieldProblem as exc:
        raise click.BadParameter(str(exc), param_hint="--expires") from None


expires_option = click.option(
    "--expires", default=None, help="When the key stops being accepted: Unix seconds or ISO-8601 (UTC if no offset)."
)
team_option = click.option(
    "--team", default=None, help="The team (its id or name) whose limits apply around the key's own."
)


async def team_id_of(store: TeamStore, team: str) -> str:
    """The id of the team named or numbered `team`; a usage error when there is none."""
    for record in await store.list_teams():
        if team in (record.id, record.name):
            return record.id
    raise click.BadParameter(f"no team with id or name {team!r}", param_hint="--team")


@keys.command()
@settings_options
@click.option("--name", required=True, help="Who or what the key is for.")
@click.option("--admin", is_flag=True, help="Allow the admin API.")
@limit_options
@expires_option
@team_option
@click.option("--team-admin", is_flag=True, help="The key manages its team's keys (with --team).")
def create(
    config_file: Path | None,
    data_dir: Path | None,
    name: str,
    admin: bool,
    given: KeyLimits,
    expires: str | None,
    team: str | None,
    team_admin: bool,
) -> None:
    """Create a key and print it, alone on the last line. It is shown only this once."""
    limits = checked(given)
    expires_at = _expiry(expires)
    if team_admin and team is None:
        raise click.UsageError("--team-admin needs --team")

    async def make(store: Store) -> tuple[KeyRecord, str]:
        team_id = await team_id_of(store, team) if team is not None else None
        try:
            return await KeyService(store).create(
                name, admin=admin, limits=limits, expires_at=expires_at, team_id=team_id, team_admin=team_admin
            )
        except FieldProblem as exc:
            raise click.UsageError(f"{exc.param}: {exc}") from None

    flags = {"admin": admin, "expires_at": expires_at, "team_id": team, "team_admin": team_admin}
    change = {"name": name, **_limits_change(limits), **{k: v for k, v in flags.items() if v not in (None, False)}}
    audited = Audited("keys.create", change=change, target_of=lambda made: made[0].id)
    record, key = with_store(load(config_file, data_dir=data_dir), make, audited)
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
    click.echo(
        f"{'ID':<18} {'NAME':<24} {'ADMIN':<6} {'FINGERPRINT':<12} {'QUOTA':<16} {'TEAM':<18} {'CREATED':<26} "
        f"{'EXPIRES':<20} {'LAST USED':<20} REVOKED"
    )
    for r in records:
        quota = f"{r.limits.quota_tokens}/{r.limits.quota_period}" if r.limits.quota_tokens else "-"
        click.echo(
            f"{r.id:<18} {r.name[:24]:<24} {'yes' if r.is_admin else 'no':<6} {r.fingerprint:<12} {quota:<16} "
            f"{r.team_id or '-':<18} {r.created_at:<26} {_when(r.expires_at):<20} {_when(r.last_used_at):<20} "
            f"{r.revoked_at or '-'}"
        )


def _when(moment: float | None) -> str:
    return (
        "-" if moment is None else datetime.datetime.fromtimestamp(moment, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    )


CLEARABLE = {"quota": ("quota_tokens", "quota_period"), "rpm": ("rpm",),
             "max-concurrency": ("max_concurrency",), "models": ("models",), "budget": ("budget", "budget_period"),
             "expires": (), "team": ()}  # fmt: skip


@keys.command()
@settings_options
@click.argument("key_id")
@limit_options
@expires_option
@team_option
@click.option(
    "--clear", "cleared", multiple=True, type=click.Choice(list(CLEARABLE)), help="Remove a limit. Repeatable."
)
def update(
    config_file: Path | None,
    data_dir: Path | None,
    key_id: str,
    given: KeyLimits,
    expires: str | None,
    team: str | None,
    cleared: tuple[str, ...],
) -> None:
    """Change the limits, expiry and team given (as PATCH /api/keys/ID does); the others stay; --clear
    removes one (--clear expires: the key never expires; --clear team: it leaves its team)."""
    expires_at = _expiry(expires)

    async def change(store: Store) -> bool:
        service = KeyService(store)
        record = await service.get(key_id)
        if record is None:
            return False
        try:
            updated = await service.update(key_id, changed(record.limits, given, cleared))
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        if expires_at is not None or "expires" in cleared:
            await service.set_expiry(key_id, expires_at)
        if team is not None or "team" in cleared:
            team_id = await team_id_of(store, team) if team is not None else None
            try:
                updated = await service.set_team(key_id, team_id) and updated
            except FieldProblem as exc:
                raise click.UsageError(f"{exc.param}: {exc}") from None
        return updated

    asked = {**_limits_change(given), **dict.fromkeys(cleared), "expires_at": expires_at, "team_id": team}
    audited = Audited("keys.update", key_id, {name: value for name, value in asked.items() if value is not None or
                                              name in cleared})  # fmt: skip
    if not with_store(load(config_file, data_dir=data_dir), change, audited):
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
    summary = with_store(settings, lambda store: summarise(store, key_id, start, end, settings.billing.currency))
    click.echo(json.dumps(summary, indent=2))


@keys.command()
@settings_options
@click.argument("key_id")
@click.option(
    "--grace",
    type=click.FloatRange(0, MAX_GRACE),
    default=DEFAULT_GRACE,
    show_default=True,
    help="Seconds the old secret is still accepted (0: not at all; at most 30 days).",
)
def rotate(config_file: Path | None, data_dir: Path | None, key_id: str, grace: float) -> None:
    """Give the key a new secret and print it, alone on the last line (shown only this once); the old
    one keeps working for --grace seconds."""
    audited = Audited("keys.rotate", key_id, {"grace_seconds": grace}, found=lambda made: made is not None)
    rotated = _keys(config_file, data_dir, lambda service: service.rotate(key_id, grace), audited)
    if rotated is None:
        raise click.ClickException(f"no active key with id {key_id}")
    record, key = rotated
    click.echo(f"rotated key {record.id} ({record.name}); the old secret works for {grace:.0f} s more; the new one "
               "is shown only once:", err=True)  # fmt: skip
    click.echo(key)


@keys.command()
@settings_options
@click.argument("key_id")
def revoke(config_file: Path | None, data_dir: Path | None, key_id: str) -> None:
    """Revoke the key with this id."""
    if not _keys(config_file, data_dir, lambda service: service.revoke(key_id), Audited("keys.delete", key_id)):
        raise click.ClickException(f"no active key with id {key_id}")
    click.echo(f"revoked {key_id}")
