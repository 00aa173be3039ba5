"""Files in chat: data URIs checked and decoded here, text extracted in a contained child process.

Every check that the bytes allow runs for every file before any extraction starts: the count
(5 per request by default), the form (a base64 `data:` URI, never a URL), the size (15 MB raw), the real type
(images, audio, video and other binaries are refused with 415). Extraction then runs in a child
forked from a forkserver that has the converters loaded (so a child starts in milliseconds), under
an address-space limit and a wall-clock timeout; a file that breaks either gets 422 naming it, and
the server itself never holds a decompressed document.

The text goes into the prompt as one delimited block per file, in the order given, before the
message's own text; `render()` is the single place that writes the block, for requests and for
`llmserver extract` alike.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llmserver.errors import APIError, InvalidRequest, UnsupportedMediaType
from llmserver.inputs import data_uri
from llmserver.inputs.extraction import Extracted, child_main
from llmserver.inputs.fair import FairSlots
from llmserver.inputs.formats import sniff
from llmserver.inputs.limits import FileLimits
from llmserver.schemas.openai import ChatMessage, FilePart, TextPart

log = logging.getLogger(__name__)

# The forkserver listens on an AF_UNIX socket at $TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, and such a path holds
# at most 107 bytes: under a longer TMPDIR the server could not start ("AF_UNIX path too long").
SOCKET_PATH_MAX = 107
SOCKET_TAIL = len("/pymp-XXXXXXXX/listener-XXXXXXXX")
SHORT_TEMP = ("/tmp", "/var/tmp", "/dev/shm")  # where both folders go then: the first writable
PRIVATE_PREFIX = "llmserver-extract-"


class UnprocessableFile(APIError):
    status = 422
    type = "unprocessable_file"

    # The extraction child's peak resident memory and its limit, when it got as far as reporting them.
    peak_rss_kb: int | None = None
    limit_kb: int | None = None


@dataclass(frozen=True)
class Upload:
    filename: str
    data: bytes
    format: str


def count_check(count: int, param: str, limits: FileLimits) -> None:
    if count > limits.max_files:
        raise InvalidRequest(f"The request has {count} files; at most {limits.max_files} are accepted.", param=param)


def decode_upload(file: dict[str, Any], param: str, limits: FileLimits) -> Upload:
    """One `file` object (`filename` and `data`, or OpenAI's `file_data`) → its checked bytes."""
    filename = file.get("filename")
    if filename is not None and not isinstance(filename, str):
        raise InvalidRequest("file.filename must be a string.", param=param)
    name = (filename or "").strip()[:255] or "file"
    data = file.get("data", file.get("file_data"))
    if "file_id" in file and data is None:
        raise InvalidRequest(
            "Uploaded file ids are not supported: send the file inline in file.data as a data: URI.", param=param
        )
    if not isinstance(data, str) or not data.startswith("data:"):
        url = isinstance(data, str) and data.lower().startswith(("http://", "https://", "ftp://", "file:"))
        raise InvalidRequest(
            f"{name}: file.data must be a data: URI (data:<mime>;base64,...)"
            + ("; URLs are not accepted for files." if url else "."),
            param=param,
        )
    uri = data_uri.parse(data)
    if uri is None:
        raise InvalidRequest(f"{name}: file.data must be a base64 data: URI (data:<mime>;base64,...).", param=param)
    raw = data_uri.decode(
        uri,
        max_bytes=limits.max_bytes,
        too_large=too_large(name, limits),
        invalid=f"{name}: file.data is not valid base64.",
        param=param,
    )
    return check_upload(name, raw, param)


def check_upload(name: str, raw: bytes, param: str | None = None) -> Upload:
    """The checks on the bytes themselves: something there, and a format that can hold text."""
    if not raw:
        raise UnprocessableFile(f"{name} is empty: there is no text to extract.", param=param)
    kind = sniff(raw)
    if kind.family in ("image", "audio", "video", "binary"):
        raise UnsupportedMediaType(
            f"{name} is a {kind.format}, which has no extractable text. Files must be documents, archives or text"
            " (PDF, Office, OpenDocument, EPUB, HTML, ZIP, source and config files…).",
            param=param,
        )
    if kind.family == "encrypted":
        raise UnprocessableFile(f"{name} is encrypted (a {kind.format}); remove the password and send it again.")
    return Upload(name, raw, kind.format)


def decode_parts(
    found: Sequence[tuple[int, int, FilePart]], params: Sequence[str], limits: FileLimits
) -> list[tuple[int, Upload]]:
    """File parts (with their message's index and place), checked and decoded; `params` name them."""
    return [
        (index, decode_upload(part.file, param, limits)) for (index, _, part), param in zip(found, params, strict=True)
    ]


def native_file_parts(items: Sequence[dict[str, Any]]) -> list[FilePart]:
    """The native API's `files` as chat file parts: each is one already, or just its inner `file` object."""
    parts = []
    for item in items:
        file = item.get("file") if item.get("type") == "file" else item
        if not isinstance(file, dict):
            raise InvalidRequest('Each file must be {"type": "file", "file": {"filename", "data"}}.', param="files")
        parts.append(FilePart(type="file", file=file))
    return parts


def merged_messages(
    messages: Sequence[ChatMessage], owners: Sequence[int], extracted: Sequence[Extracted]
) -> list[ChatMessage]:
    """The messages with their files' text blocks first, in the order given, then their own parts."""
    blocks: dict[int, list[TextPart]] = {}
    for index, result in zip(owners, extracted, strict=True):
        blocks.setdefault(index, []).append(TextPart(type="text", text=render(result)))
    merged = []
    for index, message in enumerate(messages):
        if index in blocks and isinstance(message.content, list):
            rest = [part for part in message.content if not isinstance(part, FilePart)]
            message = message.model_copy(update={"content": [*blocks[index], *rest]})
        merged.append(message)
    return merged


def too_large(name: str, limits: FileLimits) -> str:
    return f"{name} is larger than {limits.max_bytes / 2**20:g} MB, the limit per file (before encoding)."


def render(extracted: Extracted) -> str:
    """The block one file becomes in the prompt: named, delimited, visibly truncated, skips listed."""
    lines = [f'<file name="{_attribute(extracted.filename)}" format="{extracted.format}">', extracted.text]
    if extracted.truncated:
        lines.append(f"[truncated: only the first {extracted.max_chars:,} characters of this file are included]")
    if extracted.skipped:
        shown = extracted.skipped[:50]
        more = len(extracted.skipped) - len(shown)
        lines.append("[skipped: " + "; ".join(shown) + (f"; and {more} more" if more else "") + "]")
    lines.append("</file>")
    return "\n".join(lines)


def _attribute(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;").replace("\n", " ")


class DocumentService:
    """Runs extractions in child processes, a bounded number at a time."""

    def __init__(
        self,
        *,
        timeout: float,
        memory_mb: int,
        limits: FileLimits,
        workers: int | None = None,
        on_extraction: Callable[[str, float], None] = lambda outcome, seconds: None,
    ) -> None:
        self.timeout = timeout
        self.limits = limits
        self._on_extraction = on_extraction  # told each child's outcome (the metrics)
        self.memory_bytes = memory_mb * 1024 * 1024
        slots = workers or os.cpu_count() or 1
        self._slots = threading.BoundedSemaphore(slots)
        # Waiting for a slot happens here, not in a worker thread: waiting threads would take the
        # event loop's thread pool from the image and upload decoding that share it.
        self._waiting = FairSlots(slots)  # shared fairly between keys
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["llmserver.inputs.extraction", "markitdown.converters"])
        self._temp_dir: str | None = None
        self._starting = threading.Lock()

    def warm_up(self) -> None:
        """Start the forkserver (it imports the converters once: about 2 s) so the first file is fast.

        It and its children (the converters) get a private TMPDIR, removed by close(): what a converter
        leaves there (onnxruntime writes a `.ses` file at import; a child killed at its limit leaves
        whatever it had open) goes with it."""
        from multiprocessing import forkserver

        with self._starting:
            if self._temp_dir is not None:
                return
            base = _private_base()
            self._temp_dir = tempfile.mkdtemp(prefix=PRIVATE_PREFIX, dir=base)
            saved, saved_dir = os.environ.get("TMPDIR"), tempfile.tempdir
            os.environ["TMPDIR"] = self._temp_dir
            # And this process's socket folder (multiprocessing's pymp-*, made on first use under tempfile's).
            tempfile.tempdir = base
            try:
                forkserver.ensure_running()
            finally:
                tempfile.tempdir = saved_dir
                if saved is None:
                    del os.environ["TMPDIR"]
                else:
                    os.environ["TMPDIR"] = saved

    def close(self) -> None:
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    async def extract(self, upload: Upload, owner: str = "") -> Extracted:
        async with self._waiting.slot(owner):
            return await asyncio.to_thread(self.extract_blocking, upload)

    async def extract_all(self, uploads: Sequence[Upload], owner: str = "") -> list[Extracted]:
        """Every file's text; `owner` (the API key) shares the extraction slots fairly with other keys."""
        return list(await asyncio.gather(*(self.extract(upload, owner) for upload in uploads)))

    def extract_blocking(self, upload: Upload) -> Extracted:
        with self._slots:
            started = time.perf_counter()
            outcome = self._run_child(upload)
            seconds = time.perf_counter() - started
        kind = outcome[0]
        self._on_extraction(kind, seconds)
        if kind == "ok":
            result: Extracted = outcome[1]
            log.info(
                "extracted one file (%s): %d chars%s, %d skipped, %.2f s, peak RSS %d MB",
                result.format,
                len(result.text),
                " (truncated)" if result.truncated else "",
                len(result.skipped),
                result.seconds,
                result.peak_rss_kb // 1024,
            )
            return result
        log.info("extraction refused one file (%s): %s", upload.format, kind)
        if kind == "unextractable":
            error = UnprocessableFile(outcome[1])
        elif kind == "memory":
            error = UnprocessableFile(
                f"{upload.filename} needs more than the {self.memory_bytes // (1024 * 1024)} MB of memory allowed "
                "for extracting one file."
            )
        elif kind == "timeout":
            error = UnprocessableFile(
                f"{upload.filename} took longer than the {self.timeout:g} s allowed for extracting one file."
            )
        else:
            error = UnprocessableFile(f"{upload.filename} could not be extracted: the extractor stopped unexpectedly.")
        if len(outcome) > 3:
            error.peak_rss_kb, error.limit_kb = outcome[2], outcome[3]
        raise error

    def _run_child(self, upload: Upload) -> tuple[Any, ...]:
        receiver, sender = self._context.Pipe(duplex=False)
        cpu_seconds = int(self.timeout) + 5
        process = self._context.Process(
            target=child_main,
            args=(
                sender,
                upload.filename,
                upload.data,
                self.memory_bytes,
                cpu_seconds,
                self.limits.max_chars,
                self.limits.archive,
            ),
            daemon=True,
        )
        process.start()
        sender.close()
        try:
            if not receiver.poll(self.timeout):
                return ("timeout",)
            outcome: tuple[Any, ...] = receiver.recv()
            return outcome
        except (EOFError, OSError):
            return ("crashed",)
        finally:
            receiver.close()
            process.kill()
            process.join()
            process.close()


def _private_base() -> str:
    """Where the forkserver's socket folder and the converters' private TMPDIR are made: the system's temp
    folder (TMPDIR), or a short one when TMPDIR is too long for the socket's path."""
    base = tempfile.gettempdir()  # read (and kept) now: this process's own temp folder stays the system's
    if len(base) + SOCKET_TAIL <= SOCKET_PATH_MAX:
        return base
    for short in SHORT_TEMP:
        if os.path.isdir(short) and os.access(short, os.W_OK | os.X_OK):
            log.warning(
                "TMPDIR %s is too long for the document converters' socket path (at most %d characters): "
                "their socket and private folder go under %s",
                base, SOCKET_PATH_MAX - SOCKET_TAIL, short,
            )  # fmt: skip
            return short
    return base  # and the forkserver's start fails with the system's own message
