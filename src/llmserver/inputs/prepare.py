"""Attached inputs → the messages an instance is sent: one path for chat and the native API.

Three steps, each later one costlier, and the generation service runs admission between the first
two:
- `bound()`: an upper bound of the prompt's tokens from what the request holds, without decoding
  anything (text bytes, the per-image allowance, a file's size from its base64 length capped by the
  extracted-text limit);
- `check()`: the checks that need no fetching or extraction (image and file counts, images to a
  text-only model; for async submissions also the files' decoding and type sniffing);
- `prepare()`: images fetched or decoded and downscaled, files decoded and extracted in contained
  children, each file part replaced by its text block and each image by the one we made.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from llmserver import tracing
from llmserver.errors import InvalidRequest
from llmserver.inputs import documents as files
from llmserver.inputs.documents import DocumentService, Upload
from llmserver.inputs.images import ImageService
from llmserver.inputs.images import count_check as image_count_check
from llmserver.schemas.openai import ChatMessage, FilePart, ImagePart, ImageURL, TextPart, parts_of

# Room for the chat template's own tokens (a default system prompt included), and per message.
TEMPLATE_TOKENS = 64
MESSAGE_TOKENS = 8
# A file's block around its text: the <file> tag with a 255-character name and the truncation line.
# The list of skipped archive members, and text that a compressed format holds beyond its size, are
# caught by the bound after extraction.
FILE_BLOCK_TOKENS = 400


Kind = Literal["image", "file"]


class Where:
    """Names the request parameter a part came from, in errors: chat's message parts by default."""

    def count(self, kind: Kind) -> str:
        return "messages"

    def part(self, kind: Kind, index: int, position: int) -> str:
        return f"messages.{index}.content.{position}" + (".image_url.url" if kind == "image" else ".file")


@dataclass(frozen=True)
class NativeWhere(Where):
    """The native API's `files` and `images`, laid out as one user message: files, the prompt, images."""

    files: int

    def count(self, kind: Kind) -> str:
        return "images" if kind == "image" else "files"

    def part(self, kind: Kind, index: int, position: int) -> str:
        return f"files.{position}" if kind == "file" else f"images.{position - self.files - 1}"


CHAT = Where()


def text_bound(text: str) -> int:
    """Tokens a text can take at most: byte-level BPE never makes more tokens than UTF-8 bytes."""
    return len(text.encode())


class InputService:
    def __init__(self, images: ImageService, documents: DocumentService, vision_models: Collection[str]) -> None:
        self.images = images
        self.documents = documents
        self.vision_models = set(vision_models)

    # Before admission: reads the request, decodes nothing

    def bound(self, messages: Sequence[ChatMessage]) -> int:
        """An upper bound of the prompt's tokens, before any input is decoded."""
        return TEMPLATE_TOKENS + sum(MESSAGE_TOKENS + self._content_bound(m) for m in messages)

    def _content_bound(self, message: ChatMessage) -> int:
        content = message.content
        if not isinstance(content, list):
            return text_bound(content or "")
        total = 0
        for part in content:
            if isinstance(part, TextPart):
                total += text_bound(part.text)
            elif isinstance(part, ImagePart):
                total += self.images.limits.token_allowance
            else:
                total += self._file_bound(part)
        return total

    def _file_bound(self, part: FilePart) -> int:
        data = part.file.get("data", part.file.get("file_data"))
        raw = len(data.partition(",")[2]) * 3 // 4 if isinstance(data, str) else 0
        # Text never grows past the cap (4 bytes a character at most).
        return min(raw, 4 * self.documents.limits.max_chars) + FILE_BLOCK_TOKENS

    # After admission

    def check(self, messages: Sequence[ChatMessage], model: str, where: Where = CHAT) -> None:
        """400 for too many images or files, or images sent to a text-only model."""
        images = parts_of(messages, ImagePart)
        if images:
            if model not in self.vision_models:
                index, position = next(
                    (index, position)
                    for index, message in enumerate(messages)
                    if isinstance(message.content, list)
                    for position, part in enumerate(message.content)
                    if isinstance(part, ImagePart)
                )
                at = where.part("image", index, position)  # the first: its place, renamed in another API's terms
                raise InvalidRequest(
                    f"{at}: the model {model!r} is not vision-capable: it does not accept image parts.", param=at
                )
            image_count_check(len(images), where.count("image"), self.images.limits)
        files.count_check(len(parts_of(messages, FilePart)), where.count("file"), self.documents.limits)

    async def decode_files(self, messages: Sequence[ChatMessage], where: Where = CHAT) -> list[tuple[int, Upload]]:
        """Every file decoded and sniffed, with the index of its message (an async job's files are
        checked so before it is accepted). Up to 75 MB of base64: off the event loop."""
        found = parts_of(messages, FilePart)
        if not found:
            return []
        params = [where.part("file", index, position) for index, position, _ in found]
        return await asyncio.to_thread(files.decode_parts, found, params, self.documents.limits)

    async def prepare(
        self, messages: list[ChatMessage], model: str, where: Where = CHAT, owner: str = ""
    ) -> list[ChatMessage]:
        """The messages with each file part replaced by its text block and each image by the one we made;
        `owner` (the API key) shares the extraction slots fairly with other keys."""
        if not any(isinstance(m.content, list) for m in messages):
            return messages
        self.check(messages, model, where)
        found = parts_of(messages, ImagePart)
        with tracing.span("inputs", {"images": len(found)}) as span:
            # Every file is decoded and sniffed before any image is fetched or any file extracted.
            uploads = await self.decode_files(messages, where)
            if span is not None:
                span.set_attribute("files", len(uploads))
            if found:
                messages = await self._replace_images(messages, found, where)
            if uploads:
                extracted = await self.documents.extract_all([upload for _, upload in uploads], owner)
                messages = files.merged_messages(messages, [index for index, _ in uploads], extracted)
        return messages

    async def _replace_images(
        self, messages: list[ChatMessage], found: list[tuple[int, int, ImagePart]], where: Where
    ) -> list[ChatMessage]:
        prepared = await asyncio.gather(
            *(
                self.images.prepare(part.image_url.url, where.part("image", index, position))
                for index, position, part in found
            )
        )
        replaced = {(index, position): image for (index, position, _), image in zip(found, prepared, strict=True)}
        result = []
        for index, message in enumerate(messages):
            if isinstance(message.content, list):
                parts = [
                    ImagePart(type="image_url", image_url=ImageURL(url=replaced[index, position].data_uri))
                    if (index, position) in replaced
                    else part
                    for position, part in enumerate(message.content)
                ]
                message = message.model_copy(update={"content": parts})
            result.append(message)
        return result
