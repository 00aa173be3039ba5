"""Files in chat through the real server: extracted text reaches the model, hostile files get their
exact status, and the server keeps serving."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.support import MODEL, Server, assert_error, cli, documents


def chat(*parts: dict[str, object], text: str = "Reply with one word.", **extra: object) -> dict[str, object]:
    content = [*parts, {"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0, **extra}


def extracted_by_cli(server: Server, tmp_path: Path, files: dict[str, bytes]) -> str:
    paths = []
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        paths.append(str(tmp_path / name))
    result = cli(server.data_dir, "extract", *paths)
    assert result.returncode == 0, result.stderr
    return result.stdout.removesuffix("\n")


def prompt_tokens_of(server: Server, content: str) -> int:
    messages = [{"role": "user", "content": content}]
    templated = server.instance_post("/apply-template", {"messages": messages})["prompt"]
    tokens = server.instance_post("/tokenize", {"content": templated, "add_special": True})
    return len(tokens["tokens"])


def test_the_cli_prints_each_document_marker(server: Server, tmp_path: Path) -> None:
    output = extracted_by_cli(
        server,
        tmp_path,
        {
            "report.docx": documents.make_docx(),
            "sheet.xlsx": documents.make_xlsx(),
            "deck.pptx": documents.make_pptx(),
            "paper.pdf": documents.make_pdf(),
            "bundle.zip": documents.make_zip(
                {"a/report.docx": documents.make_docx(), "b.zip": documents.make_zip({"p.pdf": documents.make_pdf()})}
            ),
        },
    )
    flat = " ".join(output.split())
    for key in ("docx", "xlsx", "pptx", "pdf"):
        assert documents.MARKERS[key] in flat
    assert '<file name="bundle.zip" format="ZIP archive">' in output
    assert "--- a/report.docx ---" in output and "--- b.zip/p.pdf ---" in output


def test_the_prompt_holds_exactly_what_extract_prints(server: Server, client: httpx.Client, tmp_path: Path) -> None:
    docx = documents.make_docx()
    block = extracted_by_cli(server, tmp_path, {"report.docx": docx})
    without = client.post("/v1/chat/completions", json=chat()).json()["usage"]["prompt_tokens"]
    response = client.post("/v1/chat/completions", json=chat(documents.file_part("report.docx", docx)))
    assert response.status_code == 200, response.text
    with_file = response.json()["usage"]["prompt_tokens"]
    assert with_file == prompt_tokens_of(server, block + "\nReply with one word.")
    # The growth is the block: the marker sentence plus the few tokens of the delimiters.
    marker_tokens = prompt_tokens_of(server, documents.MARKERS["docx"]) - prompt_tokens_of(server, "")
    assert marker_tokens < with_file - without < marker_tokens + 40


def test_streamed_and_native_requests_take_files(client: httpx.Client) -> None:
    part = documents.file_part("notes.md", b"# Notes\n\nThe launch code word is pineapple.")
    with client.stream("POST", "/v1/chat/completions", json=chat(part, stream=True)) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    plain = client.post("/api/generate", json={"prompt": "One word.", "max_tokens": 2}).json()
    native = client.post("/api/generate", json={"prompt": "One word.", "max_tokens": 2, "files": [part]})
    assert native.status_code == 200, native.text
    assert native.json()["prompt_tokens"] > plain["prompt_tokens"] + 10
    inner = client.post("/api/generate", json={"prompt": "One word.", "max_tokens": 2, "files": [part["file"]]})
    assert inner.json()["prompt_tokens"] == native.json()["prompt_tokens"]


def test_the_openai_sdk_sends_files(server: Server, api_key: str) -> None:
    pdf = documents.make_pdf()
    file = {"filename": "paper.pdf", "file_data": documents.data_uri(pdf)}
    with openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0) as sdk:
        answer = sdk.chat.completions.create(
            model=MODEL,
            max_tokens=2,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "file", "file": file}, {"type": "text", "text": "Summarize."}],
                }
            ],
        )
    assert answer.usage is not None and answer.usage.prompt_tokens > 30


def test_a_file_larger_than_the_context(client: httpx.Client) -> None:
    text = ("The quick brown fox jumps over the lazy dog. " * 1000).encode()  # cut to 40,000 characters
    error = assert_error(
        client.post("/v1/chat/completions", json=chat(documents.file_part("long.txt", text))),
        400,
        "context_length_exceeded",
    )
    assert "maximum context length is 1024 tokens" in str(error["message"])


HOSTILE = [
    ("42.zip", documents.nested_bomb, 422, "unprocessable_file"),
    ("zeros.zip", lambda: documents.zeros_entry_zip("z.txt", 50 * 1024 * 1024), 422, "unprocessable_file"),
    ("entries.zip", documents.many_entries_zip, 422, "unprocessable_file"),
    ("inflate.pdf", documents.pdf_stream_bomb, 422, "unprocessable_file"),
    ("deep.zip", documents.deeply_nested_zip, 422, "unprocessable_file"),
    ("broken.docx", documents.corrupt_docx, 422, "unprocessable_file"),
    ("locked.pdf", lambda: documents.make_pdf(user_password="pw"), 422, "unprocessable_file"),
    ("huge.txt", lambda: b"a" * (16 * 1024 * 1024), 413, "request_too_large"),
    ("clip.mp4", lambda: documents.MP4, 415, "unsupported_media_type"),
    ("image.txt", lambda: documents.PNG, 415, "unsupported_media_type"),
]


@pytest.mark.parametrize(("name", "build", "status", "type_"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_files_get_their_status_and_the_server_keeps_serving(
    server: Server, client: httpx.Client, name: str, build: object, status: int, type_: str
) -> None:
    assert callable(build)
    response = client.post("/v1/chat/completions", json=chat(documents.file_part(name, build())))
    error = assert_error(response, status, type_)
    assert name in str(error["message"])
    assert httpx.get(server.url + "/health").status_code == 200
    assert client.post("/api/generate", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_refusals_before_extraction(client: httpx.Client) -> None:
    part = documents.file_part("a.txt", b"hello")
    assert_error(client.post("/v1/chat/completions", json=chat(*[part] * 6)), 400, "invalid_request_error")
    url_part = {"type": "file", "file": {"filename": "a.pdf", "data": "https://example.com/a.pdf"}}
    error = assert_error(client.post("/v1/chat/completions", json=chat(url_part)), 400, "invalid_request_error")
    assert "URLs are not accepted" in str(error["message"])
    assert error["param"] == "messages.0.content.0.file"
    # An async request with a bad file is refused at once, not in its result.
    async_body = chat(
        *[part] * 6, mode="async", key=documents.data_uri(bytes(32))[len("data:application/octet-stream;base64,") :]
    )
    assert_error(client.post("/v1/chat/completions", json=async_body), 400, "invalid_request_error")


def test_a_stored_zip_with_a_pdf_inside_is_read_whole(server: Server, tmp_path: Path) -> None:
    """Python's zipfile stores by default: the PDF's header sits at byte 0x84, and the upload was read
    as that PDF alone (issue 39, row 5)."""
    import zipfile

    members = {"t.csv": b"animal,count\nwalrus,42\n", "n.md": b"# Notes\n\nOtters juggle.\n"}
    archive = documents.make_zip({**members, "report.pdf": documents.make_pdf()}, compression=zipfile.ZIP_STORED)
    assert b"%PDF-" in archive[:1024]
    output = extracted_by_cli(server, tmp_path, {"bundle.zip": archive})
    assert '<file name="bundle.zip" format="ZIP archive">' in output
    for name in ("t.csv", "n.md", "report.pdf"):
        assert f"--- {name} ---" in output
    assert "walrus" in output and "Otters juggle" in output
    assert documents.MARKERS["pdf"] in " ".join(output.split())
