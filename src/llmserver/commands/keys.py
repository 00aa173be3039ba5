"""`llmserver keys`: create, list and revoke API keys in the data folder's database."""

from __future__ import annotations

import json
from pathlib import Path

import click

from llmserver.auth.keys import KeyService
from llmserver.commands import load, settings_options
from llmserver.store import SQLiteStore


def _service(config_file: Path | None, data_dir: Path | None) -> KeyService:
    settings = load(config_file, data_dir=data_dir)
    return KeyService(SQLiteStore(settings.db_path))


@click.group()
def keys() -> None:
    """Manage API keys (changes take effect at once, also on a running server)."""


@keys.command()
@settings_options
@click.option("--name", required=True, help="Who or what the key is for.")
@click.option("--admin", is_flag=True, help="Allow the admin API.")
def create(config_file: Path | None, data_dir: Path | None, name: str, admin: bool) -> None:
    """Create a key and print it, alone on the last line. It is shown only this once."""
    record, key = _service(config_file, data_dir).create(name, admin=admin)
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
    records = _service(config_file, data_dir).list()
    if as_json:
        click.echo(json.dumps([record.__dict__ for record in records], indent=2))
        return
    click.echo(f"{'ID':<18} {'NAME':<24} {'ADMIN':<6} {'FINGERPRINT':<12} {'CREATED':<26} REVOKED")
    for r in records:
        click.echo(
            f"{r.id:<18} {r.name[:24]:<24} {'yes' if r.is_admin else 'no':<6} {r.fingerprint:<12} "
            f"{r.created_at:<26} {r.revoked_at or '-'}"
        )


@keys.command()
@settings_options
@click.argument("key_id")
def revoke(config_file: Path | None, data_dir: Path | None, key_id: str) -> None:
    """Revoke the key with this id."""
    if not _service(config_file, data_dir).revoke(key_id):
        raise click.ClickException(f"no active key with id {key_id}")
    click.echo(f"revoked {key_id}")
