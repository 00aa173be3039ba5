"""`llmserver teams`: create, list, change and delete teams (keys that share limits) in the database."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from llmserver.auth.keys import KeyService, limit_fields
from llmserver.auth.teams import TeamService
from llmserver.commands import Audited, load, settings_options, with_store
from llmserver.commands.keys import CLEARABLE, changed, checked, limit_options, team_id_of
from llmserver.errors import APIError, FieldProblem
from llmserver.store import KeyLimits, Store

TEAM_CLEARABLE = {name: fields for name, fields in CLEARABLE.items() if fields}


def _service(store: Store) -> TeamService:
    return TeamService(store, KeyService(store))


def _run(config_file: Path | None, data_dir: Path | None, use: Any, audited: Audited | None = None) -> Any:
    try:
        return with_store(load(config_file, data_dir=data_dir), use, audited)
    except FieldProblem as exc:
        raise click.UsageError(f"{exc.param}: {exc}") from None
    except APIError as exc:
        raise click.ClickException(exc.message) from None


@click.group()
def teams() -> None:
    """Manage teams: keys whose requests must also fit their team's limits (changes take effect at once)."""


@teams.command()
@settings_options
@click.argument("name")
@limit_options
def create(
    config_file: Path | None,
    data_dir: Path | None,
    name: str,
    given: KeyLimits,
) -> None:
    """Create a team with these limits (for all its keys together) and print its id."""
    limits = checked(given)
    change = {"name": name, **{k: v for k, v in asdict(limits).items() if v is not None}}
    audited = Audited("teams.create", change=change, target_of=lambda made: made.id)
    team = _run(config_file, data_dir, lambda store: _service(store).create(name, limits), audited)
    click.echo(f"created team {team.id} ({team.name})", err=True)
    click.echo(team.id)


@teams.command("list")
@settings_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def list_teams(config_file: Path | None, data_dir: Path | None, as_json: bool) -> None:
    """List teams, their limits and their active keys."""

    async def read(store: Store) -> list[dict[str, Any]]:
        members = [key for key in await store.list_keys() if key.active]
        return [
            {"id": team.id, "name": team.name, "created_at": team.created_at, **limit_fields(team.limits),
             "keys": [key.id for key in members if key.team_id == team.id]}
            for team in await store.list_teams()
        ]  # fmt: skip

    found = _run(config_file, data_dir, read)
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    click.echo(f"{'ID':<18} {'NAME':<24} {'QUOTA':<16} {'RPM':<6} {'IN FLIGHT':<10} {'MODELS':<24} KEYS")
    for t in found:
        quota = f"{t['quota_tokens']}/{t['quota_period']}" if t["quota_tokens"] else "-"
        listed = ",".join(t["models"]) if t["models"] is not None else "all"
        click.echo(
            f"{t['id']:<18} {t['name'][:24]:<24} {quota:<16} {t['rpm'] or '-'!s:<6} "
            f"{t['max_concurrency'] or '-'!s:<10} {listed[:24]:<24} {len(t['keys'])}"
        )


@teams.command()
@settings_options
@click.argument("team")
@click.option("--name", default=None, help="A new name.")
@limit_options
@click.option(
    "--clear", "cleared", multiple=True, type=click.Choice(list(TEAM_CLEARABLE)), help="Remove a limit. Repeatable."
)
def update(
    config_file: Path | None,
    data_dir: Path | None,
    team: str,
    name: str | None,
    given: KeyLimits,
    cleared: tuple[str, ...],
) -> None:
    """Change the team's (id or name) name and the limits given; the others stay; --clear removes one."""

    async def change(store: Store) -> str:
        service = _service(store)
        record = await service.get(await team_id_of(store, team))
        assert record is not None
        updated = await service.update(record.id, name or record.name, changed(record.limits, given, cleared))
        assert updated is not None
        return updated.id

    asked = {"name": name, **{k: v for k, v in asdict(given).items() if v is not None}, **dict.fromkeys(cleared)}
    audited = Audited("teams.update", change=asked, target_of=lambda team_id: team_id)
    click.echo(f"updated {_run(config_file, data_dir, change, audited)}")


@teams.command()
@settings_options
@click.argument("team")
def delete(config_file: Path | None, data_dir: Path | None, team: str) -> None:
    """Delete a team (id or name) that has no active keys (move them out or revoke them first)."""

    async def remove(store: Store) -> str:
        team_id = await team_id_of(store, team)
        await _service(store).delete(team_id)
        return team_id

    audited = Audited("teams.delete", change={"team": team}, target_of=lambda team_id: team_id)
    click.echo(f"deleted {_run(config_file, data_dir, remove, audited)}")
