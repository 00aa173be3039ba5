"""The input service's bound (read without decoding), its checks, and where errors point."""

from __future__ import annotations

import base64

import pytest

from llmserver.errors import InvalidRequest
from llmserver.inputs.documents import DocumentService
from llmserver.inputs.images import ImageService
from llmserver.inputs.limits import FileLimits, ImageLimits
from llmserver.inputs.prepare import FILE_BLOCK_TOKENS, MESSAGE_TOKENS, TEMPLATE_TOKENS, InputService, NativeWhere
from llmserver.schemas.openai import ChatMessage

IMAGE = "data:image/jpeg;base64," + "A" * 100_000


def service(**file_limits: int) -> InputService:
    images = ImageService(timeout=5, limits=ImageLimits())
    documents = DocumentService(timeout=5, memory_mb=256, limits=FileLimits(**file_limits))
    return InputService(images, documents, vision_models=["seeing"])


def user(*parts: dict[str, object]) -> list[ChatMessage]:
    return [ChatMessage.model_validate({"role": "user", "content": list(parts)})]


def file_part(raw_bytes: int) -> dict[str, object]:
    data = base64.b64encode(b"x" * raw_bytes).decode()
    return {"type": "file", "file": {"filename": "a.txt", "data": "data:text/plain;base64," + data}}


def test_text_counts_its_utf8_bytes_and_an_image_its_allowance_not_its_base64() -> None:
    inputs = service()
    text = inputs.bound([ChatMessage(role="user", content="héllo")])
    assert text == TEMPLATE_TOKENS + MESSAGE_TOKENS + len("héllo".encode())
    with_image = inputs.bound(
        user({"type": "text", "text": "héllo"}, {"type": "image_url", "image_url": {"url": IMAGE}})
    )
    assert with_image - text == ImageLimits().token_allowance


def test_a_file_counts_its_size_up_to_the_character_cap() -> None:
    inputs = service(max_chars=1000)
    empty = inputs.bound(user())
    assert inputs.bound(user(file_part(300))) - empty == 300 + FILE_BLOCK_TOKENS
    # 14 MB of base64 is bounded by the cap (4 bytes a character at most), not by its size.
    assert inputs.bound(user(file_part(14_000))) - empty == 4 * 1000 + FILE_BLOCK_TOKENS


def test_checks_count_and_vision_and_name_the_native_parameters() -> None:
    inputs = service(max_files=2)
    image = {"type": "image_url", "image_url": {"url": IMAGE}}
    with pytest.raises(InvalidRequest) as caught:
        inputs.check(user(image), "text-only")
    # The first image's place, as each API names it (Anthropic's: the block of the turn it came from).
    assert caught.value.param == "messages.0.content.0.image_url.url" and "not vision-capable" in caught.value.message
    inputs.check(user(image, image, image, image), "seeing")
    with pytest.raises(InvalidRequest) as caught:
        inputs.check(user(image, image, image, image, image), "seeing", NativeWhere(files=0))
    assert caught.value.param == "images"
    with pytest.raises(InvalidRequest) as caught:
        inputs.check(user(file_part(1), file_part(1), file_part(1)), "seeing", NativeWhere(files=3))
    assert caught.value.param == "files" and "at most 2" in caught.value.message
    where = NativeWhere(files=2)
    assert (where.part("file", 0, 1), where.part("image", 0, 3)) == ("files.1", "images.0")
