"""Uploads: the checks before extraction, and extraction in real child processes, hostile files included."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llmserver.errors import APIError
from llmserver.inputs import documents as uploads
from llmserver.inputs.documents import DocumentService, UnprocessableFile, Upload, count_check, native_file_parts
from llmserver.inputs.limits import FileLimits
from tests.support import documents

MEMORY_MB = 512
LIMITS = FileLimits()
MAX_FILE_BYTES = LIMITS.max_bytes


def decode_upload(file: dict[str, object], param: str) -> Upload:
    return uploads.decode_upload(file, param, LIMITS)


@pytest.fixture(scope="module")
def service() -> Iterator[DocumentService]:
    yield DocumentService(timeout=60, memory_mb=MEMORY_MB, limits=LIMITS, workers=2)


def error_of(call: object) -> APIError:
    assert callable(call)
    with pytest.raises(APIError) as caught:
        call()
    return caught.value


def check(status: int, type_: str, call: object) -> str:
    error = error_of(call)
    assert (error.status, error.type) == (status, type_), error.message
    return error.message


# Before extraction


def test_file_data_must_be_a_base64_data_uri() -> None:
    for data in ("https://example.com/a.pdf", "http://10.0.0.1/a.pdf", "JVBERi0xLjQK", None):
        message = check(
            400, "invalid_request_error", lambda d=data: decode_upload({"filename": "a.pdf", "data": d}, "p")
        )
        assert "must be a data: URI" in message
        # only what looks like a URL is called one
        assert ("URLs are not accepted" in message) == (data is not None and data.startswith("http"))
    message = check(400, "invalid_request_error", lambda: decode_upload({"data": "data:text/plain,hello"}, "p"))
    assert "base64" in message
    message = check(400, "invalid_request_error", lambda: decode_upload({"data": "data:text/plain;base64,@@@"}, "p"))
    assert "not valid base64" in message
    check(400, "invalid_request_error", lambda: decode_upload({"file_id": "file-abc"}, "p"))


def test_openai_file_data_field_is_accepted() -> None:
    upload = decode_upload({"filename": "a.txt", "file_data": documents.data_uri(b"hello there")}, "p")
    assert (upload.filename, upload.data, upload.format) == ("a.txt", b"hello there", "text")


def test_file_size_limit_is_on_the_raw_bytes() -> None:
    at_limit = decode_upload({"filename": "big.txt", "data": documents.data_uri(b"a" * MAX_FILE_BYTES)}, "p")
    assert len(at_limit.data) == MAX_FILE_BYTES
    over = documents.data_uri(b"a" * (MAX_FILE_BYTES + 1))
    message = check(413, "request_too_large", lambda: decode_upload({"filename": "big.txt", "data": over}, "p"))
    assert message.startswith("big.txt is larger than 15 MB")
    # Judged from the base64 length alone: this one is never decoded.
    huge = "data:text/plain;base64," + "A" * (22 * 1024 * 1024)
    check(413, "request_too_large", lambda: decode_upload({"filename": "huge.txt", "data": huge}, "p"))


def test_media_files_are_refused_by_their_bytes_not_their_names() -> None:
    for name, data, kind in (
        ("notes.txt", documents.PNG, "PNG image"),
        ("clip.mp4", documents.MP4, "MPEG-4/QuickTime video"),
        ("song.txt", b"ID3\x04\x00" + bytes(100), "MP3 audio"),
    ):
        part = {"filename": name, "data": documents.data_uri(data, "text/plain")}
        message = check(415, "unsupported_media_type", lambda p=part: decode_upload(p, "p"))
        assert message.startswith(f"{name} is a {kind}")
    empty = {"filename": "empty.txt", "data": "data:text/plain;base64,"}
    check(422, "unprocessable_file", lambda: decode_upload(empty, "p"))


def test_at_most_five_files_per_request() -> None:
    count_check(5, "messages", LIMITS)
    message = check(400, "invalid_request_error", lambda: count_check(6, "messages", LIMITS))
    assert message == "The request has 6 files; at most 5 are accepted."


def test_native_files_take_both_forms() -> None:
    part = documents.file_part("a.txt", b"hello")
    inner = part["file"]
    assert [p.file for p in native_file_parts([part, inner])] == [inner, inner]
    check(400, "invalid_request_error", lambda: native_file_parts([{"type": "file", "file": "nope"}]))


# Extraction in the child


@pytest.mark.parametrize(
    ("name", "build", "marker"),
    [
        ("report.docx", documents.make_docx, documents.MARKERS["docx"]),
        ("sheet.xlsx", documents.make_xlsx, documents.MARKERS["xlsx"]),
        ("deck.pptx", documents.make_pptx, documents.MARKERS["pptx"]),
        ("paper.pdf", documents.make_pdf, documents.MARKERS["pdf"]),
        ("docx.zip", lambda: documents.make_zip({"a/report.docx": documents.make_docx()}), documents.MARKERS["docx"]),
        (
            "pdf-in-zip.zip",
            lambda: documents.make_zip({"inner.zip": documents.make_zip({"paper.pdf": documents.make_pdf()})}),
            documents.MARKERS["pdf"],
        ),
    ],
)
def test_documents_give_their_text(service: DocumentService, name: str, build: object, marker: str) -> None:
    assert callable(build)
    data = build()
    result = service.extract_blocking(decode_upload({"filename": name, "data": documents.data_uri(data)}, "p"))
    assert marker in " ".join(result.text.split())
    assert result.peak_rss_kb > 0


def test_encrypted_and_corrupt_documents(service: DocumentService) -> None:
    encrypted = decode_upload(
        {"filename": "locked.pdf", "data": documents.data_uri(documents.make_pdf(user_password="pw"))}, "p"
    )
    message = check(422, "unprocessable_file", lambda: service.extract_blocking(encrypted))
    assert message == "locked.pdf is an encrypted PDF; remove the password and send it again."
    corrupt = decode_upload({"filename": "broken.docx", "data": documents.data_uri(documents.corrupt_docx())}, "p")
    message = check(422, "unprocessable_file", lambda: service.extract_blocking(corrupt))
    assert message.startswith("broken.docx could not be read")


@pytest.mark.parametrize(
    ("name", "build", "says"),
    [
        ("42.zip", documents.nested_bomb, "levels deep"),
        ("zeros.zip", lambda: documents.zeros_entry_zip("zeros.txt", 200 * 1024 * 1024), "unpacks to more than"),
        ("ratio.zip", lambda: documents.zeros_entry_zip("zeros.txt", 50 * 1024 * 1024), "expands more than 200"),
        ("entries.zip", documents.many_entries_zip, "too many entries"),
        ("deep.zip", documents.deeply_nested_zip, "levels deep"),
        ("inflate.pdf", documents.pdf_stream_bomb, f"more than the {MEMORY_MB} MB of memory"),
    ],
)
def test_hostile_files_are_contained(service: DocumentService, name: str, build: object, says: str) -> None:
    assert callable(build)
    upload = decode_upload({"filename": name, "data": documents.data_uri(build())}, "p")
    error = error_of(lambda: service.extract_blocking(upload))
    assert (error.status, error.type) == (422, "unprocessable_file")
    assert name in error.message and says in error.message
    assert isinstance(error, UnprocessableFile) and error.peak_rss_kb is not None and error.limit_kb is not None
    assert error.peak_rss_kb < error.limit_kb  # the child was held under its limit …
    if name.endswith(".zip"):  # … and archives are refused from their directories, before any inflating
        assert error.peak_rss_kb < 300 * 1024


def test_a_slow_extraction_is_stopped_at_the_timeout() -> None:
    hurried = DocumentService(timeout=0.05, memory_mb=MEMORY_MB, limits=LIMITS)
    upload = decode_upload({"filename": "report.docx", "data": documents.data_uri(documents.make_docx())}, "p")
    message = check(422, "unprocessable_file", lambda: hurried.extract_blocking(upload))
    assert message == "report.docx took longer than the 0.05 s allowed for extracting one file."
