"""`llmserver audit list`: the audit log (via the running gateway's admin API, /api/audit)."""

from __future__ import annotations

import datetime
import json
import urllib.parse
from pathlib import Path
from typing import Any

import click

from llmserver.commands import server_url, settings_options
from llmserver.commands.instances import admin_call, admin_key, key_option, url_option


def _line(row: dict[str, Any]) -> str:
    when = datetime.datetime.fromtimestamp(float(row["time"]), datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
    change = json.dumps(row["change"], sort_keys=True) if row["change"] else "-"
    who = f"{row['key']['name']} ({row['key']['id']})"
    return f"{when}Z  {row['action']:<18} {row['target'] or '-':<24} {row['status']}  {who}  {change}"


@click.group()
def audit() -> None:
    """The audit log: every admin action through the API (who, what, on what, the change, the outcome)."""


@audit.command("list")
@settings_options
@url_option
@key_option
@click.option("--action", default=None, help="Only this action (keys.create, models.delete, nodes.drain, ...).")
@click.option("--target", default=None, help="Only actions on this key id, model, instance or node.")
@click.option("--by", "by_key", default=None, help="Only actions by this admin key's id.")
@click.option("--since", default=None, help="Unix seconds or ISO-8601 (default: the beginning).")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 500), help="Rows, newest first.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def list_rows(
    config_file: Path | None,
    data_dir: Path | None,
    url: str | None,
    key: str | None,
    action: str | None,
    target: str | None,
    by_key: str | None,
    since: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """The latest admin actions, newest first: time (UTC), action, target, status, admin key, change."""
    wanted = {"action": action, "target": target, "key": by_key, "since": since, "limit": str(limit)}
    query = urllib.parse.urlencode({name: value for name, value in wanted.items() if value is not None})
    rows = admin_call(server_url(config_file, data_dir, url), admin_key(key), f"/api/audit?{query}")["data"]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif rows:
        click.echo("\n".join(_line(row) for row in rows))
    else:
        click.echo("no admin action recorded (that matches)", err=True)
