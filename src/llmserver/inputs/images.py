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
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from llmserver.errors import InvalidRequest
from llmserver.inputs import data_uri
from llmserver.inputs.limits import ImageLimits
from llmserver.inputs.safe_fetch import MAX_URL_LENGTH, Resolve, fetch_bytes, system_resolve

log = logging.getLogger(__name__)

FORMATS = {"PNG", "JPEG", "WEBP", "GIF"}


@dataclass(frozen=True)
class PreparedImage:
    data_uri: str
    width: int
    height: int
    original_width: int
    original_height: int


def count_check(count: int, param: str, limits: ImageLimits) -> None:
    if count > limits.max_images:
        raise InvalidRequest(f"The request has {count} images; at most {limits.max_images} are accepted.", param=param)


def decode_data_uri(url: str, param: str, limits: ImageLimits) -> bytes:
    uri = data_uri.parse(url)
    if uri is None:
        raise InvalidRequest(f"{param}: an image data URI must be base64 (data:image/png;base64,...).", param=param)
    if not uri.media_type.startswith("image/"):
        raise InvalidRequest(
            f"{param}: the data URI's type is {uri.media_type or 'missing'}, not an image.", param=param
        )
    return data_uri.decode(
        uri,
        max_bytes=limits.max_bytes,
        too_large=f"{param}: the image is larger than {limits.max_bytes / 2**20:g} MB, the limit per image.",
        invalid=f"{param}: the image data is not valid base64.",
        param=param,
    )


def prepare(raw: bytes, param: str, limits: ImageLimits) -> PreparedImage:
    """Check the header, decode (the first frame), downscale to max_side, re-encode as JPEG."""
    max_pixels, max_side = limits.max_pixels, limits.max_side
    try:
        image = Image.open(io.BytesIO(raw), formats=sorted(FORMATS))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidRequest(f"{param}: the image has more than {max_pixels:,} pixels.", param=param) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise InvalidRequest(f"{param}: not a PNG, JPEG, WEBP or GIF image.", param=param) from None
    with image:
        width, height = image.size
        if width * height > max_pixels:
            raise InvalidRequest(
                f"{param}: the image is {width} x {height}, more than {max_pixels:,} pixels.", param=param
            )
        try:
            image.draft("RGB", (max_side, max_side))  # JPEG only: decode at 1/2, 1/4 or 1/8 scale
            image.seek(0)
            image.load()
            rgb = _rgb(image)
        except (OSError, ValueError, SyntaxError, EOFError):
            raise InvalidRequest(f"{param}: the image data is corrupt.", param=param) from None
    rgb.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
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

    def __init__(
        self,
        *,
        timeout: float,
        limits: ImageLimits,
        allow_hosts: Collection[str] = (),
        max_url_length: int = MAX_URL_LENGTH,
        resolve: Resolve = system_resolve,
        on_prepared: Callable[[str, float], None] = lambda source, seconds: None,
    ) -> None:
        self._on_prepared = on_prepared  # told each image's source (data, url) and seconds (the metrics)
        self.timeout = timeout
        self.limits = limits
        self.allow_hosts = allow_hosts
        self.max_url_length = max_url_length  # the settings' limits.max_url_length, which webhooks share
        self.resolve = resolve

    async def prepare(self, url: str, param: str) -> PreparedImage:
        started = time.perf_counter()
        if url.startswith("data:"):
            raw = decode_data_uri(url, param, self.limits)
        elif url.startswith(("http://", "https://")):
            raw = await fetch_bytes(
                url,
                param=param,
                max_bytes=self.limits.max_bytes,
                max_redirects=self.limits.max_redirects,
                max_url_length=self.max_url_length,
                timeout=self.timeout,
                allow_hosts=self.allow_hosts,
                resolve=self.resolve,
            )
        else:
            raise InvalidRequest(f"{param}: an image URL must be a data: URI or an http(s) URL.", param=param)
        prepared = await asyncio.to_thread(prepare, raw, param, self.limits)
        self._on_prepared("data" if url.startswith("data:") else "url", time.perf_counter() - started)
        log.info(
            "image %dx%d sent as %dx%d",
            prepared.original_width,
            prepared.original_height,
            prepared.width,
            prepared.height,
        )
        return prepared
