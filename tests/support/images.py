"""Images built in the test run: real PNG/JPEG/GIF/WEBP bytes, and a PNG whose header claims a huge size."""

from __future__ import annotations

import base64
import io
import struct
import zlib

from PIL import Image


def encode(image: Image.Image, format: str = "PNG", **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=format, **options)
    return out.getvalue()


def gradient(width: int, height: int, mode: str = "RGB") -> Image.Image:
    image = Image.linear_gradient("L").resize((width, height)).convert(mode)
    return image


def png(width: int, height: int) -> bytes:
    return encode(gradient(width, height))


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url}}


def png_bomb(side: int = 20_000) -> bytes:
    """A real 1-bit PNG of side x side pixels (all black): about 50 KB that would decode to 1.2 GB as RGB."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" + bytes((side + 7) // 8)
    compressor = zlib.compressobj(9)
    pixels = b"".join(compressor.compress(row) for _ in range(side)) + compressor.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
