"""Writes the seed corpus in fuzz/corpus/ (committed; run again only to change the seeds):

.venv/bin/python -m fuzz.seeds
"""

from __future__ import annotations

import base64
import io
import json
import zipfile

from PIL import Image

from fuzz.run import CORPUS
from tests.support import documents


def _image(format: str, mode: str = "RGB", size: tuple[int, int] = (8, 6), **options: object) -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, 90).save(out, format=format, **options)
    return out.getvalue()


def _gif_two_frames() -> bytes:
    out = io.BytesIO()
    frames = [Image.new("P", (4, 4), colour) for colour in (1, 2)]
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], transparency=0)
    return out.getvalue()


def _zip(members: dict[str, bytes], compression: int = zipfile.ZIP_DEFLATED) -> bytes:
    return documents.make_zip(members, compression=compression)


def seeds() -> dict[str, dict[str, bytes]]:
    png = _image("PNG")
    jpeg = _image("JPEG")
    text_zip = _zip({"a.txt": b"hello\n", "dir/b.md": b"# title\n", "c.json": b'{"k": 1}'})
    nested = _zip({"inner.zip": text_zip, "note.txt": b"outer"})
    stored = _zip({"s.txt": b"stored " * 10, "empty/": b""}, compression=zipfile.ZIP_STORED)
    docx = documents.make_docx("Fuzz seed.")
    uri = "data:{};base64,{}".format
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return {
        "data_uri": {
            "png": uri("image/png", base64.b64encode(png).decode()).encode(),
            "text": uri("text/plain", "aGVsbG8=").encode(),
            "empty": b"data:;base64,",
            "not_base64": b"data:image/png,plain",
            "padding": b"data:application/pdf;base64,JVBERi0xLjQ===",
        },
        "sniffer": {
            "png": png,
            "jpeg": jpeg,
            "gif": _gif_two_frames(),
            "webp": _image("WEBP"),
            "pdf": b"%PDF-1.4\n1 0 obj\n<<>>\nendobj\n",
            "zip": text_zip,
            "cfb": bytes.fromhex("d0cf11e0a1b11ae1") + b"\0" * 64,
            "riff": b"RIFF\x24\0\0\0WAVEfmt ",
            "ftyp": b"\0\0\0\x18ftypheic" + b"\0" * 16,
            "text": "plain text, with ünïcode\n".encode(),
            "html": b"<!doctype html><html><body><p>hi</p></body></html>",
            "utf16": "text".encode("utf-16"),
        },
        "zip_walker": {
            "text": text_zip,
            "nested": nested,
            "stored": stored,
            "docx_inside": _zip({"report.docx": docx}),
        },
        "image": {
            "png": png,
            "png_rgba": _image("PNG", "RGBA"),
            "png_palette": _image("PNG", "P", transparency=0),
            "jpeg": jpeg,
            "gif": _gif_two_frames(),
            "webp": _image("WEBP"),
            "one_pixel": _image("PNG", "L", (1, 1)),
        },
        "http_request": {
            "get": b"GET /v1/models?x=1 HTTP/1.1\r\nHost: t\r\n\r\n",
            "post": b"POST /api/generate HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello",
            "chunked": b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            "pipelined": b"GET /a HTTP/1.1\r\nHost: t\r\n\r\nGET /b HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
            "continue": b"POST / HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nhi",
            "http10": b"GET / HTTP/1.0\r\n\r\n",
            "smuggle": b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"0\r\n\r\n",
            "many_headers": b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % n for n in range(25)) + b"\r\n",
            "big_header": b"GET / HTTP/1.1\r\nX: " + b"a" * 5000 + b"\r\n\r\n",
            "upgrade": b"GET / HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
            "garbage": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
        },
        "body": {
            "chat": json.dumps(chat).encode(),
            "chat_parts": json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": "be brief"},
                        {
                            "role": "user",
                            "content": [
                                {"type": "text", "text": "see"},
                                {"type": "image_url", "image_url": {"url": uri("image/png", "AAAA")}},
                                {"type": "file", "file": {"filename": "a.txt", "file_data": uri("text/plain", "aGk=")}},
                            ],
                        },
                    ],
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "logprobs": True,
                    "top_logprobs": 2,
                }
            ).encode(),
            "chat_tools": json.dumps(
                {
                    **chat,
                    "tools": [
                        {
                            "type": "function",
                            "function": {
                                "name": "f",
                                "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
                            },
                        }
                    ],
                    "tool_choice": "required",
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {
                            "name": "s",
                            "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
                        },
                    },
                }
            ).encode(),
            "completions": json.dumps(
                {"prompt": "once", "max_tokens": 3, "logprobs": 2, "stop": ["\n"], "seed": 1, "logit_bias": {"1": -1}}
            ).encode(),
            "native": json.dumps(
                {"prompt": "hi", "system": "s", "raw": False, "temperature": 0.5, "format": {"type": "object"}}
            ).encode(),
            "surrogate": b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        },
    }


def main() -> None:
    for harness, inputs in seeds().items():
        folder = CORPUS / harness
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in inputs.items():
            (folder / name).write_bytes(data)
        print(f"{folder}: {len(inputs)} seeds")


if __name__ == "__main__":
    main()
