"""Images in chat: fetched or decoded, checked, downscaled to 768 px and re-encoded for the instance.

Pillow with a format allowlist (PNG, JPEG, WEBP, GIF — its first frame) and a pixel ceiling
checked from the header before anything is decoded (decompression bombs). JPEGs are decoded at a
reduced scale (`draft`) when they are much larger than needed. What reaches llama-server is always
a JPEG data URI we made, at most 768 px on its longer side.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
from collections.abc import Collection
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from llmserver.errors import InvalidRequest
from llmserver.inputs import data_uri
from llmserver.inputs.safe_fetch import Resolve, fetch_bytes, system_resolve

log = logging.getLogger(__name__)

MAX_IMAGES = 4
MAX_IMAGE_BYTES = 8 * 1024 * 1024
MAX_SIDE = 768
MAX_PIXELS = 50_000_000  # 50 megapixels: a large phone photo; a 20000 x 20000 bomb is 400
FORMATS = {"PNG", "JPEG", "WEBP", "GIF"}
# What one image may add to the prompt, for the quota's upper bound before the instance counts it:
# a 768-px image in 14-px patches is 55 x 55 = 3,025 tokens, with room for a model's separators.
IMAGE_TOKEN_ALLOWANCE = 4096


@dataclass(frozen=True)
class PreparedImage:
    data_uri: str
    width: int
    height: int
    original_width: int
    original_height: int


def count_check(count: int, param: str) -> None:
    if count > MAX_IMAGES:
        raise InvalidRequest(f"The request has {count} images; at most {MAX_IMAGES} are accepted.", param=param)


def decode_data_uri(url: str, param: str) -> bytes:
    uri = data_uri.parse(url)
    if uri is None:
        raise InvalidRequest(f"{param}: an image data URI must be base64 (data:image/png;base64,...).", param=param)
    if not uri.media_type.startswith("image/"):
        raise InvalidRequest(
            f"{param}: the data URI's type is {uri.media_type or 'missing'}, not an image.", param=param
        )
    return data_uri.decode(
        uri,
        max_bytes=MAX_IMAGE_BYTES,
        too_large=_too_large(param),
        invalid=f"{param}: the image data is not valid base64.",
        param=param,
    )


def _too_large(param: str) -> str:
    return f"{param}: the image is larger than {MAX_IMAGE_BYTES // 2**20} MB, the limit per image."


def prepare(raw: bytes, param: str) -> PreparedImage:
    """Check the header, decode (the first frame), downscale to MAX_SIDE, re-encode as JPEG."""
    try:
        image = Image.open(io.BytesIO(raw), formats=sorted(FORMATS))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidRequest(f"{param}: the image has more than {MAX_PIXELS:,} pixels.", param=param) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise InvalidRequest(f"{param}: not a PNG, JPEG, WEBP or GIF image.", param=param) from None
    with image:
        width, height = image.size
        if width * height > MAX_PIXELS:
            raise InvalidRequest(
                f"{param}: the image is {width} x {height}, more than {MAX_PIXELS:,} pixels.", param=param
            )
        try:
            image.draft("RGB", (MAX_SIDE, MAX_SIDE))  # JPEG only: decode at 1/2, 1/4 or 1/8 scale
            image.seek(0)
            image.load()
            rgb = _rgb(image)
        except (OSError, ValueError, SyntaxError, EOFError):
            raise InvalidRequest(f"{param}: the image data is corrupt.", param=param) from None
    rgb.thumbnail((MAX_SIDE, MAX_SIDE), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=90)
    data_uri = "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()
    return PreparedImage(data_uri, rgb.width, rgb.height, width, height)


def _rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency laid on white (what a viewer would show)."""
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")


class ImageService:
    """Turns an `image_url.url` (data URI or public URL) into the image an instance is sent."""

    def __init__(self, *, timeout: float, allow_hosts: Collection[str] = (), resolve: Resolve = system_resolve) -> None:
        self.timeout = timeout
        self.allow_hosts = allow_hosts
        self.resolve = resolve

    async def prepare(self, url: str, param: str) -> PreparedImage:
        if url.startswith("data:"):
            raw = decode_data_uri(url, param)
        elif url.startswith(("http://", "https://")):
            raw = await fetch_bytes(
                url,
                param=param,
                max_bytes=MAX_IMAGE_BYTES,
                timeout=self.timeout,
                allow_hosts=self.allow_hosts,
                resolve=self.resolve,
            )
        else:
            raise InvalidRequest(f"{param}: an image URL must be a data: URI or an http(s) URL.", param=param)
        prepared = await asyncio.to_thread(prepare, raw, param)
        log.info(
            "image %dx%d sent as %dx%d",
            prepared.original_width,
            prepared.original_height,
            prepared.width,
            prepared.height,
        )
        return prepared
