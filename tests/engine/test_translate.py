"""Messages as llama-server takes them."""

from __future__ import annotations

import os
import re
import warnings

from llmserver.engine import translate
from llmserver.engine.translate import chat_messages, native_messages
from llmserver.schemas.openai import ChatMessage, ChatRequest, FilePart

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


def test_response_ids_are_openai_shaped_random_and_differ_in_a_forked_child() -> None:
    ids = [translate.new_id("chatcmpl") for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(re.fullmatch(r"chatcmpl-[0-9a-f]{24}", i) for i in ids)
    assert len({i[9:15] for i in ids}) > 900  # random, not a counter under a fixed prefix
    read, write = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+ warns of fork() beside threads; the child only writes
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child's generator is seeded again: it never repeats its parent's ids
        os.write(write, translate.new_id("chatcmpl").encode())
        os._exit(0)
    parent = translate.new_id("chatcmpl")
    os.waitpid(pid, 0)
    child = os.read(read, 100).decode()
    os.close(read)
    os.close(write)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{24}", child) and child != parent and child not in ids


def test_the_sampling_fields_sent_on_are_those_given_and_not_null_by_name() -> None:
    def sampling(**fields: object) -> list[tuple[str, object]]:
        request = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})
        return list(translate.sampling_payload(request, 8, None).items())

    assert sampling() == [("max_tokens", 8)]
    assert sampling(top_p=None, mode="sync") == [("max_tokens", 8)]
    given = sampling(seed=7, temperature=0.5, top_k=None, min_p=0.1)
    assert given == [("max_tokens", 8), ("min_p", 0.1), ("seed", 7), ("temperature", 0.5)]
