"""Image checks and the downscale, on real encoded images."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from llmserver.errors import APIError
from llmserver.inputs import images as image_inputs
from llmserver.inputs.images import PreparedImage
from llmserver.inputs.limits import ImageLimits
from tests.support import images

LIMITS = ImageLimits()
MAX_IMAGE_BYTES = LIMITS.max_bytes


def prepare(raw: bytes, param: str) -> PreparedImage:
    return image_inputs.prepare(raw, param, LIMITS)


def decode_data_uri(url: str, param: str) -> bytes:
    return image_inputs.decode_data_uri(url, param, LIMITS)


def decoded(data_uri: str) -> Image.Image:
    assert data_uri.startswith("data:image/jpeg;base64,")
    return Image.open(io.BytesIO(base64.b64decode(data_uri.split(",", 1)[1])))


def refused(call: object, status: int = 400) -> str:
    assert callable(call)
    with pytest.raises(APIError) as caught:
        call()
    assert caught.value.status == status
    return caught.value.message


@pytest.mark.parametrize(
    ("size", "expected"),
    [((2000, 1000), (768, 384)), ((1000, 3000), (256, 768)), ((500, 300), (500, 300)), ((768, 768), (768, 768))],
)
def test_the_longer_side_is_at_most_768_and_the_aspect_is_kept(
    size: tuple[int, int], expected: tuple[int, int]
) -> None:
    prepared = prepare(images.png(*size), "p")
    assert (prepared.width, prepared.height) == expected
    assert (prepared.original_width, prepared.original_height) == size
    assert decoded(prepared.data_uri).size == expected


def test_every_allowed_format() -> None:
    picture = images.gradient(1600, 1200)
    for format in ("PNG", "JPEG", "WEBP"):
        prepared = prepare(images.encode(picture, format), "p")
        assert (prepared.width, prepared.height) == (768, 576)
    frames = [images.gradient(100, 80), Image.new("RGB", (100, 80), (255, 0, 0))]
    gif = images.encode(frames[0].convert("P"), "GIF", save_all=True, append_images=[frames[1].convert("P")])
    first = decoded(prepare(gif, "p").data_uri).convert("RGB")
    assert first.getpixel((50, 40)) != (255, 0, 0)  # the first frame, not the red second one


def test_transparency_is_laid_on_white() -> None:
    clear = Image.new("RGBA", (40, 40), (0, 0, 0, 0))
    pixel = decoded(prepare(images.encode(clear), "p").data_uri).convert("RGB").getpixel((20, 20))
    assert isinstance(pixel, tuple) and min(pixel) > 245


def test_refusals() -> None:
    assert "not a PNG, JPEG, WEBP or GIF" in refused(lambda: prepare(b"hello, I am text", "p"))
    assert "not a PNG, JPEG, WEBP or GIF" in refused(lambda: prepare(images.encode(images.gradient(8, 8), "BMP"), "p"))
    assert "corrupt" in refused(lambda: prepare(images.png(300, 300)[:200], "p"))
    assert "more than 50,000,000 pixels" in refused(lambda: prepare(images.png_bomb(), "p"))
    assert "9000 x 9000" in refused(lambda: prepare(images.png_bomb(9000), "p"))


def test_data_uris() -> None:
    assert decode_data_uri(images.data_uri(b"abc"), "p") == b"abc"
    assert "not an image" in refused(lambda: decode_data_uri("data:text/plain;base64,aGk=", "p"))
    assert "base64" in refused(lambda: decode_data_uri("data:image/png,raw", "p"))
    assert "not valid base64" in refused(lambda: decode_data_uri("data:image/png;base64,!!", "p"))
    over = images.data_uri(bytes(MAX_IMAGE_BYTES + 1))
    assert "larger than 8 MB" in refused(lambda: decode_data_uri(over, "p"), 413)
    assert decode_data_uri(images.data_uri(bytes(MAX_IMAGE_BYTES)), "p") == bytes(MAX_IMAGE_BYTES)
