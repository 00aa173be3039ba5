"""`llmserver db`: the database's schema."""

from __future__ import annotations

from pathlib import Path

import click

from llmserver.commands import load, open_checked_store, settings_options
from llmserver.store import redact


@click.group()
def db() -> None:
    """The database (SQLite by default, or PostgreSQL shared by many gateways)."""


@db.command()
@settings_options
def migrate(config_file: Path | None, data_dir: Path | None) -> None:
    """Apply the schema migrations the database lacks (safe to run from several hosts at once)."""
    settings = load(config_file, data_dir=data_dir)
    version = open_checked_store(settings, migrate=True)
    click.echo(f"{redact(settings.state.database_url)}: schema version {version}")
