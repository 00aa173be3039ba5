"""`llmserver instances`: the running server's instances, as a table (via the admin API)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import click

from llmserver.client import unreachable
from llmserver.commands import server_url, settings_options

COLUMNS = [
    ("instance_id", "ID", 14),
    ("model", "MODEL", 28),
    ("status", "STATUS", 9),
    ("node", "NODE", 12),
    ("host", "HOST", 15),
    ("port", "PORT", 6),
    ("pid", "PID", 8),
    ("active_users", "USERS", 6),
    ("ram_used_mb", "RAM_MB", 7),
    ("cpu_percent", "CPU%", 6),
    ("uptime_seconds", "UPTIME_S", 9),
    ("last_activity", "LAST_ACTIVITY", 25),
]


def admin_call(url: str, key: str, path: str, method: str = "GET") -> Any:
    """One call to the running server's admin API; its JSON answer, or a CLI error with the envelope's message."""
    request = urllib.request.Request(url.rstrip("/") + path, method=method, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        try:
            error = json.load(exc)["error"]
            message, kind = str(error["message"]), str(error["type"])
        except (ValueError, KeyError, TypeError):
            message, kind = str(exc.reason), "http_error"
        raise click.ClickException(f"{message} ({exc.code} {kind})") from None
    except (urllib.error.URLError, OSError) as exc:
        raise click.ClickException(unreachable(url, exc)) from None


def admin_key(key: str | None) -> str:
    key = key or os.environ.get("LLMSERVER_API_KEY") or os.environ.get("LLMSERVER_ADMIN_KEY")
    if not key:
        raise click.UsageError("give an admin key with --key or $LLMSERVER_API_KEY")
    return key


def fetch_instances(url: str, key: str) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = admin_call(url, key, "/api/instances")["data"]
    return data


def table(records: list[dict[str, Any]]) -> str:
    lines = [" ".join(f"{title:<{width}}" for _, title, width in COLUMNS).rstrip()]
    for record in records:
        # An instance this gateway runs itself has no node: "-".
        lines.append(" ".join(f"{record.get(name, '-')!s:<{width}}" for name, _, width in COLUMNS).rstrip())
    return "\n".join(lines)


url_option = click.option("--url", default=None, help="The server (default: http://HOST:PORT from the settings).")
key_option = click.option(
    "--key", default=None, help="An admin key (default: $LLMSERVER_API_KEY, else $LLMSERVER_ADMIN_KEY)."
)


@click.command()
@settings_options
@url_option
@key_option
@click.option("--json", "as_json", is_flag=True, help="Print the records as JSON.")
def instances(config_file: Path | None, data_dir: Path | None, url: str | None, key: str | None, as_json: bool) -> None:
    """List the running server's model instances."""
    records = fetch_instances(server_url(config_file, data_dir, url), admin_key(key))
    click.echo(json.dumps(records, indent=2) if as_json else table(records))
