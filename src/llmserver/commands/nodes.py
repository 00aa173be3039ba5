"""`llmserver nodes list|cordon|uncordon|drain`: the worker nodes, and the operator's marks on them
(via the running gateway's admin API, /api/nodes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from llmserver.commands import server_url, settings_options
from llmserver.commands.instances import admin_call, admin_key, key_option, url_option

COLUMNS = [("node", "NODE", 16), ("state", "STATE", 9), ("up", "UP", 4), ("instances", "INSTANCES", 9)]


def _line(node: dict[str, Any]) -> str:
    shown = {**node, "up": "yes" if node.get("up") else "no"}
    cells = " ".join(f"{shown.get(name, '-')!s:<{width}}" for name, _, width in COLUMNS)
    assigned = ", ".join(f"{name} {count}" for name, count in sorted((node.get("assigned") or {}).items())) or "-"
    waiting = "; ".join(node.get("waiting") or [])
    return f"{cells} {assigned}" + (f"  (waiting: {waiting})" if waiting else "")


def _table(described: list[dict[str, Any]]) -> str:
    header = " ".join(f"{title:<{width}}" for _, title, width in COLUMNS) + " ASSIGNED"
    return "\n".join([header, *(_line(node).rstrip() for node in described)])


@click.group()
def nodes() -> None:
    """The worker nodes of a cluster: list them; cordon, drain or uncordon one."""


@nodes.command("list")
@settings_options
@url_option
@key_option
@click.option("--json", "as_json", is_flag=True, help="Print the records as JSON.")
def list_nodes(
    config_file: Path | None, data_dir: Path | None, url: str | None, key: str | None, as_json: bool
) -> None:
    """Every node that publishes or carries a mark: its state, whether it is up, what runs there."""
    described = admin_call(server_url(config_file, data_dir, url), admin_key(key), "/api/nodes")["data"]
    click.echo(json.dumps(described, indent=2) if as_json else _table(described))
    if not described:
        click.echo("no worker node: this server runs its instances itself, or no node publishes", err=True)


def _marking(action: str, summary: str) -> click.Command:
    @settings_options
    @url_option
    @key_option
    @click.argument("node")
    def command(config_file: Path | None, data_dir: Path | None, url: str | None, key: str | None, node: str) -> None:
        path = f"/api/nodes/{node}/{action}"
        described = admin_call(server_url(config_file, data_dir, url), admin_key(key), path, method="POST")
        click.echo(_table([described]))

    command.__doc__ = summary
    return click.command(action)(command)


nodes.add_command(_marking("cordon", "No new instances on NODE; what runs there stays."))
nodes.add_command(
    _marking("drain", "Move NODE's instances to other nodes (each started elsewhere before it stops), and cordon it.")
)
nodes.add_command(_marking("uncordon", "Lift NODE's mark: it takes new instances again (and gets its share back)."))
