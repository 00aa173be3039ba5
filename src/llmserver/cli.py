"""The `llmserver` command group. Commands live in `llmserver.commands`; only this module exits."""

from __future__ import annotations

import os
import sys
import tomllib

import click

from llmserver import __version__
from llmserver.commands import ask, audit, config, db, extract, instances, keys, models, node, nodes, serve, teams
from llmserver.models.files import ModelFileError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="llmserver")
def cli() -> None:
    """llmserver: a self-hosted server for GGUF language models."""


cli.add_command(serve.serve)
cli.add_command(keys.keys)
cli.add_command(teams.teams)
cli.add_command(models.models)
cli.add_command(config.config)
cli.add_command(instances.instances)
cli.add_command(ask.ask)
cli.add_command(extract.extract)
cli.add_command(db.db)
cli.add_command(node.node)
cli.add_command(nodes.nodes)
cli.add_command(audit.audit)


def main() -> None:
    """Run the CLI with one way to fail: one line on stderr ("Error: …"), exit status 2 for usage and
    configuration errors and 1 for the rest, no traceback unless --debug or LLMSERVER_DEBUG=1."""
    args = sys.argv[1:]
    debug = "--debug" in args or os.environ.get("LLMSERVER_DEBUG", "") not in ("", "0")
    args = [arg for arg in args if arg != "--debug"]
    if debug:  # the commands read it too (`serve` and `node` then log at debug level)
        os.environ["LLMSERVER_DEBUG"] = "1"
    try:
        code = cli.main(args=args, prog_name="llmserver", standalone_mode=False)
    except click.UsageError as exc:
        _fail(exc.format_message(), 2, exc.ctx.command_path if exc.ctx else "llmserver")
    except click.ClickException as exc:
        _fail(exc.format_message(), exc.exit_code)
    except (click.Abort, KeyboardInterrupt):
        _fail("interrupted", 130)
    except (ModelFileError, tomllib.TOMLDecodeError) as exc:
        if debug:
            raise
        _fail(str(exc), 2)
    except Exception as exc:
        if debug:
            raise
        _fail(f"{type(exc).__name__}: {exc} (run with --debug for the traceback)", 1)
    sys.exit(code if isinstance(code, int) else 0)


def _fail(message: str, status: int, command: str | None = None) -> None:
    first = message.strip().splitlines()[0] if message.strip() else "failed"
    hint = f" (see `{command} --help`)" if command else ""
    click.echo(f"Error: {first}{hint}", err=True)
    sys.exit(status)
