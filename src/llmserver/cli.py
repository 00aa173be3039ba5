"""The `llmserver` command group. Commands live in `llmserver.commands`; only this module exits."""

from __future__ import annotations

import sys

import click

from llmserver import __version__
from llmserver.commands import ask, config, extract, instances, keys, models, serve


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmserver")
def cli() -> None:
    """llmserver: a self-hosted server for GGUF language models."""


cli.add_command(serve.serve)
cli.add_command(keys.keys)
cli.add_command(models.models)
cli.add_command(config.config)
cli.add_command(instances.instances)
cli.add_command(ask.ask)
cli.add_command(extract.extract)


def main() -> None:
    sys.exit(cli.main(standalone_mode=True))
