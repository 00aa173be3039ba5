"""`llmserver ask`: one prompt to a running server, sync or async (encrypted), from the shell."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from llmserver.client import Client, LLMServerError, described
from llmserver.commands import server_url, settings_options


@click.command()
@settings_options
@click.argument("prompt")
@click.option("--url", default=None, help="The server (default: http://HOST:PORT from the settings).")
@click.option("--key", default=None, help="API key (default: $LLMSERVER_API_KEY).")
@click.option("--model", default=None, help="Model name (default: the server's first).")
@click.option("--system", default=None, help="A system message.")
@click.option(
    "--max-tokens",
    type=int,
    default=None,
    help="Tokens to generate at most (default: the server's default_max_tokens).",
)
@click.option("--temperature", type=float, default=None, help="Sampling temperature (default: the model's).")
@click.option("--async", "use_async", is_flag=True, help="Submit as an async job, poll, and decrypt the result here.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole response object.")
def ask(
    config_file: Path | None,
    data_dir: Path | None,
    prompt: str,
    url: str | None,
    key: str | None,
    model: str | None,
    system: str | None,
    max_tokens: int | None,
    temperature: float | None,
    use_async: bool,
    as_json: bool,
) -> None:
    """Send PROMPT to the native API and print the answer."""
    url = server_url(config_file, data_dir, url)
    key = key or os.environ.get("LLMSERVER_API_KEY")
    if not key:
        raise click.UsageError("give an API key with --key or $LLMSERVER_API_KEY")
    params = {
        name: value
        for name, value in {
            "model": model,
            "system": system,
            "max_tokens": max_tokens,
            "temperature": temperature,
        }.items()
        if value is not None
    }
    client = Client(url, api_key=key)
    try:
        answer = client.generate_async(prompt, **params) if use_async else client.generate(prompt, **params)
    except LLMServerError as exc:
        raise click.ClickException(described(exc)) from None
    click.echo(json.dumps(answer, indent=2, ensure_ascii=False) if as_json else answer["response"])
