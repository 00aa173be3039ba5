"""The fuzz harnesses: each takes one input's bytes and returns quietly for any answer the server
would give (our errors, which become 4xx); anything else it raises is a defect atheris reports.

- `data_uri`: the base64 data: URI decoders of files and images (and the upload checks after them);
- `sniffer`: the format sniffer, the text decoder and the ZIP directory count;
- `zip_walker`: the archive walker (limits, nesting, members) as the extraction child runs it;
- `image`: the image header checks, decoding, downscale and re-encode;
- `body`: the request body parser and the three generating endpoints' schemas, then what is built
  from a valid request before admission (the prompt bound, the schema checks, llama-server's payload).

Replayed over the committed corpus in the fast tests (tests/test_fuzz_corpus.py); fuzzed for a
bounded time by `python -m fuzz.run` (tests/test_fuzz_corpus.py, slow).
"""

from __future__ import annotations

import json
from collections.abc import Callable

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


HARNESSES: dict[str, Callable[[bytes], None]] = {
    "data_uri": data_uri,
    "sniffer": sniffer,
    "zip_walker": zip_walker,
    "image": image,
    "body": body,
}
