"""The fuzz harnesses: each takes one input's bytes and returns quietly for any answer the server
would give (our errors, which become 4xx); anything else it raises is a defect atheris reports.

- `data_uri`: the base64 data: URI decoders of files and images (and the upload checks after them);
- `sniffer`: the format sniffer, the text decoder and the ZIP directory count;
- `zip_walker`: the archive walker (limits, nesting, members) as the extraction child runs it;
- `image`: the image header checks, decoding, downscale and re-encode;
- `body`: the request body parser and the three generating endpoints' schemas, then what is built
  from a valid request before admission (the prompt bound, the schema checks, llama-server's payload);
- `http_request`: raw bytes from a client through the gateway's HTTP/1.1 protocol (`http_protocol`),
  split in two reads, to an app that reads the body and answers: whatever comes, the connection gives
  well-formed answers (or none) and ends without an error of its own.

Replayed over the committed corpus in the fast tests (tests/test_fuzz_corpus.py); fuzzed for a
bounded time by `python -m fuzz.run` (tests/test_fuzz_corpus.py, slow).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

from uvicorn.config import Config
from uvicorn.server import ServerState

from llmserver.api.deps import parse_json, validate
from llmserver.engine import tools, translate
from llmserver.errors import APIError
from llmserver.inputs import archives, documents, extraction, formats, images
from llmserver.inputs.archives import ArchiveLimits, ArchiveRejected
from llmserver.inputs.documents import DocumentService
from llmserver.inputs.limits import FileLimits, ImageLimits
from llmserver.inputs.prepare import InputService, parts_of
from llmserver.schemas.native import GenerateRequest
from llmserver.schemas.openai import ChatRequest, CompletionRequest, FilePart
from llmserver.server.http_protocol import Limits, protocol_with

MIB = 1024 * 1024
# Small limits, so the fuzzer reaches them with small inputs.
FILES = FileLimits(max_bytes=64 * 1024, max_chars=2000)
IMAGES = ImageLimits(max_bytes=256 * 1024, max_side=64, max_pixels=1_000_000)
ARCHIVE = ArchiveLimits(max_entries=64, max_total_bytes=MIB, max_ratio=100, ratio_floor=4096, max_depth=3)
FAMILIES = {"document", "archive", "text", "image", "audio", "video", "encrypted", "binary"}


def data_uri(data: bytes) -> None:
    text = data.decode("utf-8", "replace")
    try:
        upload = documents.decode_upload({"filename": "fuzz.bin", "data": text}, "files.0", FILES)
        assert upload.data is not None
    except APIError:
        pass
    try:
        raw = images.decode_data_uri(text, "images.0", IMAGES)
        assert len(raw) <= IMAGES.max_bytes
    except APIError:
        pass


def sniffer(data: bytes) -> None:
    kind = formats.sniff(data)
    assert kind.family in FAMILIES, kind
    if kind.family == "text":
        formats.decode_text(data)
        formats.is_html(data)
    count = archives.declared_entries(data)
    assert count is None or count >= 0


def zip_walker(data: bytes) -> None:
    if formats.sniff(data).family != "archive":
        return
    try:
        result = extraction.extract("fuzz.zip", data, max_chars=FILES.max_chars, limits=ARCHIVE)
    except (extraction.Unextractable, ArchiveRejected):
        return
    assert len(result.text) <= FILES.max_chars


def image(data: bytes) -> None:
    try:
        prepared = images.prepare(data, "images.0", IMAGES)
    except APIError:
        return
    assert max(prepared.width, prepared.height) <= IMAGES.max_side


_INPUTS: InputService | None = None


def _inputs() -> InputService:
    global _INPUTS
    if _INPUTS is None:
        image_service = images.ImageService(timeout=1.0, limits=IMAGES, allow_hosts=[])
        _INPUTS = InputService(image_service, DocumentService(timeout=1.0, memory_mb=64, limits=FILES), [])
    return _INPUTS


def body(data: bytes) -> None:
    try:
        parsed = parse_json(data)
    except APIError:
        return
    for model in (ChatRequest, CompletionRequest, GenerateRequest):
        try:
            request = validate(model, parsed)
        except APIError:
            continue
        try:
            if isinstance(request, ChatRequest):
                tools.check_request(request)
                _inputs().bound(request.messages)
                tools.added_prompt(request)
                # Files are replaced by their text before the payload is built (InputService.prepare).
                if parts_of(request.messages, FilePart):
                    continue
                payload = translate.chat_payload(request, 16, {"messages": translate.chat_messages(request.messages)})
            elif isinstance(request, CompletionRequest):
                prompt = request.prompt if isinstance(request.prompt, str) else json.dumps(request.prompt)
                payload = translate.completion_payload(request, 16, prompt)
            else:
                messages = translate.native_messages(request.system, request.prompt, [], [])
                _inputs().bound(messages)
                payload = translate.sampling_payload(request, 16, request.stop)
        except APIError:
            continue
        json.dumps(payload, allow_nan=False)  # what goes to llama-server is plain JSON


class _Transport(asyncio.Transport):
    """What the protocol writes, kept; closing is recorded (no socket)."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed or not data, "written after close"
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 9), "sockname": ("127.0.0.1", 8000)}.get(name, default)


async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    body, more = b"", True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        more = message.get("more_body", False)
    answer = b"%d %d" % (len(scope["headers"]), len(body))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(answer))]})
    await send({"type": "http.response.body", "body": answer})


_PROTOCOL = protocol_with(Limits(max_header_bytes=4096, max_header_count=20, max_connections=1000))
_STATUS = re.compile(rb"HTTP/1\.1 (100|200|400|431|500|503) ")
_LOOP: asyncio.AbstractEventLoop | None = None
_CONFIG: Config | None = None


def http_request(data: bytes) -> None:
    global _LOOP, _CONFIG
    if _LOOP is None or _CONFIG is None:
        _LOOP = asyncio.new_event_loop()
        _CONFIG = Config(app=_echo, lifespan="off", log_level="critical", access_log=False)
        _CONFIG.load()
    _LOOP.run_until_complete(_serve_bytes(data, _CONFIG))


async def _serve_bytes(data: bytes, config: Config) -> None:
    state = ServerState()
    transport = _Transport()
    protocol = _PROTOCOL(config=config, server_state=state, app_state={})
    protocol.connection_made(transport)
    cut = data[0] % (len(data) + 1) if data else 0
    for piece in (data[:cut], data[cut:]):
        if piece and not transport.closed:
            protocol.data_received(piece)
        for _ in range(20):  # the app's tasks run (each answer may start the next pipelined one)
            await asyncio.sleep(0)
    protocol.connection_lost(None)  # what still waits for a body hears the client has gone
    if state.tasks:
        await asyncio.wait(list(state.tasks), timeout=1)
    written = bytes(transport.written)
    assert not written or _STATUS.match(written), written[:200]
    assert not state.tasks, "an answer never ended"


HARNESSES: dict[str, Callable[[bytes], None]] = {
    "data_uri": data_uri,
    "sniffer": sniffer,
    "zip_walker": zip_walker,
    "image": image,
    "body": body,
    "http_request": http_request,
}
