"""Messages as llama-server takes them."""

from __future__ import annotations

from llmserver.engine.translate import chat_messages, native_messages
from llmserver.schemas.openai import ChatMessage, FilePart

IMAGE = "data:image/jpeg;base64," + "A" * 100_000


def test_text_parts_are_joined_and_image_messages_keep_their_parts() -> None:
    messages = [
        ChatMessage(role="developer", content="Be brief."),
        ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]),
        ChatMessage(
            role="user", content=[{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": IMAGE}}]
        ),
    ]
    assert chat_messages(messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": IMAGE}}],
        },
    ]


def test_native_messages() -> None:
    assert chat_messages(native_messages("sys", "hi", [], [])) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
    ]
    with_image = chat_messages(native_messages(None, "hi", [IMAGE], []))
    assert with_image == [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": IMAGE}}],
        }
    ]


def test_native_files_go_before_the_prompt_and_images_after() -> None:
    file = FilePart(type="file", file={"filename": "a.txt", "data": "data:text/plain;base64,aGk="})
    (user,) = native_messages(None, "hi", [IMAGE], [file])
    assert isinstance(user.content, list)
    assert [part.type for part in user.content] == ["file", "text", "image_url"]
