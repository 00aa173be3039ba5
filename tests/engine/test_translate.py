"""Messages as llama-server takes them, and the quota's upper bound of a prompt."""

from __future__ import annotations

from llmserver.engine.generation import prompt_bound
from llmserver.engine.translate import chat_messages, native_messages
from llmserver.inputs.images import IMAGE_TOKEN_ALLOWANCE
from llmserver.schemas.openai import ChatMessage

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
    assert chat_messages(native_messages("sys", "hi", [])) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
    ]
    with_image = chat_messages(native_messages(None, "hi", [IMAGE]))
    assert with_image == [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": IMAGE}}],
        }
    ]


def test_an_image_counts_its_allowance_not_its_base64_bytes() -> None:
    text_only = prompt_bound({"messages": chat_messages(native_messages(None, "hi", []))})
    with_image = prompt_bound({"messages": chat_messages(native_messages(None, "hi", [IMAGE]))})
    assert with_image - text_only == IMAGE_TOKEN_ALLOWANCE
