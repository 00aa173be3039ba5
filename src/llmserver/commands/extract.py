"""`llmserver extract`: print the text of files exactly as a request would put it in the prompt."""

from __future__ import annotations

from pathlib import Path

import click

from llmserver.commands import load, settings_options
from llmserver.errors import APIError, RequestTooLarge
from llmserver.inputs.documents import DocumentService, check_upload, count_check, render, too_large


@click.command()
@settings_options
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
def extract(config_file: Path | None, data_dir: Path | None, files: tuple[Path, ...]) -> None:
    """Extract FILES (up to 5, 15 MB each) with the server's own code path, limits and settings,
    and print the blocks a chat request would carry. Nothing is sent anywhere."""
    settings = load(config_file, data_dir=data_dir)
    limits = settings.limits.files
    service = DocumentService(
        timeout=settings.limits.files.extract_timeout,
        memory_mb=settings.limits.files.extract_memory_mb,
        limits=limits,
        workers=settings.limits.files.extract_workers or None,
    )
    try:
        service.warm_up()
        count_check(len(files), "files", limits)
        uploads = []
        for path in files:
            if path.stat().st_size > limits.max_bytes:
                raise RequestTooLarge(too_large(path.name, limits))
            uploads.append(check_upload(path.name, path.read_bytes()))
        blocks = [render(service.extract_blocking(upload)) for upload in uploads]
    except APIError as exc:
        raise click.ClickException(f"{exc.message} ({exc.status} {exc.type})") from None
    finally:
        service.close()
    click.echo("\n".join(blocks))
