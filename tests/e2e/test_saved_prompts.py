"""Conversations that survive their instance (pool/saved_prompts.py), on the real llama-server: a
conversation's prompt cache saved when its instance is drained or the server shut down, restored into the
next instance (the next turn reads only its new tokens), giving the same greedy answer as a prompt read
from scratch; never restored for another key; gone when the model's settings change."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import MODEL, Server, make_key, metric, started, wait_for

CONFIG = """
[[models]]
name = "{model}"
parallel = 2
ctx_size = 2048
min_instances = 1
max_instances = 1
"""
# A history of about 700 tokens: long enough to be saved (prompt_cache_min_tokens 256), read cold in ~2 s.
HISTORY: list[dict[str, str]] = [{"role": "system", "content": "You answer in one short sentence."}]
for turn in range(5):
    HISTORY += [
        {
            "role": "user",
            "content": f"Note {turn}: " + ", ".join(f"the {n}th river of region {turn}" for n in range(12)),
        },
        {"role": "assistant", "content": f"Noted: twelve rivers of region {turn}."},
    ]
QUESTION = {"role": "user", "content": "Which region came first?"}


def config(ctx_size: int = 2048) -> str:
    return CONFIG.format(model=MODEL).replace("ctx_size = 2048", f"ctx_size = {ctx_size}")


def chat(server: Server, key: str, messages: list[dict[str, str]], model: str = MODEL) -> dict[str, Any]:
    answer = httpx.post(
        server.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "messages": messages, "max_tokens": 12, "temperature": 0},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))


def saved_files(data_dir: Path) -> list[Path]:
    return sorted((data_dir / "prompt-cache").glob("*/*/*.slot"))


def instances(server: Server, admin: str, model: str = MODEL, ready: bool = True) -> list[dict[str, Any]]:
    """The model's instances (`ready`: those that take requests; else all but the stopped)."""
    listed = httpx.get(server.url + "/api/instances", headers={"Authorization": f"Bearer {admin}"}, timeout=10)
    wanted = ("ready", "busy") if ready else ("starting", "ready", "busy", "draining", "failed")
    return [i for i in listed.json()["data"] if i["model"] == model and i["status"] in wanted]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    running = Server(data_dir=tmp_path / "data", config=config()).start()
    try:
        yield running
    finally:
        running.stop()


def test_a_drained_instances_conversation_is_restored_for_its_key_alone(server: Server) -> None:
    alice, bob = make_key(server.data_dir, "alice"), make_key(server.data_dir, "bob")
    admin = make_key(server.data_dir, "admin", admin=True)
    first = chat(server, alice, [*HISTORY, QUESTION])
    assert first["usage"]["prompt_tokens"] > 600
    (old,) = instances(server, admin)
    drained = httpx.delete(
        f"{server.url}/api/instances/{old['instance_id']}", headers={"Authorization": f"Bearer {admin}"}, timeout=60
    )
    assert drained.status_code == 200
    (saved,) = saved_files(server.data_dir)  # alice's conversation: one slot held it
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600 and stat.S_IMODE(saved.parent.stat().st_mode) == 0o700
    # Its replacement was started before it was drained (min_instances 1): ready as the drain returns.
    (new,) = instances(server, admin)
    assert new["instance_id"] != old["instance_id"]

    answered = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
    turn = [*HISTORY, QUESTION, answered, {"role": "user", "content": "And which came last?"}]
    restored = chat(server, alice, turn)
    # The new instance read only what followed the saved state (the last answer and question).
    assert cached(restored) >= first["usage"]["prompt_tokens"] - 4, restored["usage"]
    assert metric(server, admin, "llmserver_prompt_caches_saved_total") == 1
    assert metric(server, admin, "llmserver_prompt_caches_restored_total") == 1
    assert metric(server, admin, "llmserver_prompt_cache_disk_bytes") == saved.stat().st_size
    computed = chat(server, bob, turn)  # the same prompt, another key: read from scratch
    assert cached(computed) == 0, computed["usage"]
    assert computed["choices"][0]["message"]["content"] == restored["choices"][0]["message"]["content"]


def test_a_restart_keeps_conversations_and_a_changed_model_drops_them(server: Server) -> None:
    alice = make_key(server.data_dir, "alice")
    question = [*HISTORY, QUESTION]
    first = chat(server, alice, question)
    # Asked again, from the slot's cache in memory: the answer a cached prompt gives (its last token read
    # alone, not in the prompt's batch, may tip a greedy choice: llama.cpp's, with or without a restore).
    warm = chat(server, alice, question)
    assert cached(warm) >= first["usage"]["prompt_tokens"] - 4, warm["usage"]
    server.stop()  # a clean shutdown saves the slots
    assert len(saved_files(server.data_dir)) == 1
    server.start()
    again = chat(server, alice, question)
    assert cached(again) >= first["usage"]["prompt_tokens"] - 4, again["usage"]
    assert again["choices"][0]["message"]["content"] == warm["choices"][0]["message"]["content"]

    server.stop()
    (before,) = saved_files(server.data_dir)
    server.config = config(ctx_size=1536)  # another context: another identity, the old states removed
    server.start()
    assert not before.exists() and saved_files(server.data_dir) == []
    after = chat(server, alice, question)
    assert cached(after) == 0, after["usage"]


def test_a_rolling_update_keeps_conversations_unless_it_changes_what_the_model_computes(server: Server) -> None:
    alice, admin = make_key(server.data_dir, "alice"), make_key(server.data_dir, "admin", admin=True)
    headers = {"Authorization": f"Bearer {admin}"}
    body = {"name": "b", "min_instances": 1, "max_instances": 1, "parallel": 2, "ctx_size": 2048, "threads": 1}
    assert httpx.post(server.url + "/api/models", json=body, headers=headers, timeout=120).status_code == 201

    def rolled_to(before: str) -> str:
        """The id of b's instance once the roll has replaced `before` with a ready one."""
        assert wait_for(lambda: [i for i in instances(server, admin, "b") if i["instance_id"] != before], 120)
        assert wait_for(lambda: len(instances(server, admin, "b", ready=False)) == 1, 120)  # the old one gone, saved
        return str(instances(server, admin, "b")[0]["instance_id"])

    assert wait_for(lambda: instances(server, admin, "b"), 120)
    first = chat(server, alice, [*HISTORY, QUESTION], model="b")
    old = instances(server, admin, "b")[0]["instance_id"]
    # Threads shape no KV state: the new instance restores what the old one saved as it drained.
    assert httpx.patch(server.url + "/api/models/b", json={"threads": 2}, headers=headers, timeout=120).is_success
    old = rolled_to(str(old))
    again = chat(server, alice, [*HISTORY, QUESTION], model="b")
    assert cached(again) >= first["usage"]["prompt_tokens"] - 4, again["usage"]
    # Another context: another identity; the states of the old one are gone, nothing is restored.
    assert httpx.patch(server.url + "/api/models/b", json={"ctx_size": 1536}, headers=headers, timeout=120).is_success
    rolled_to(old)
    assert cached(chat(server, alice, [*HISTORY, QUESTION], model="b")) == 0


def test_a_conversation_whose_slot_another_key_took_is_restored_not_read_again(tmp_path: Path) -> None:
    """The per-key tier under the slots (cache_isolation = "key"): on one slot, two keys' conversations
    take turns; each turn finds the slot holding the other's, which is saved before it is overwritten,
    and its own is restored — so each later turn reads only its new tokens. A third key sending one of
    their prompts word for word still reads it all."""
    with started(tmp_path / "data", config().replace("parallel = 2", "parallel = 1")) as server:
        alice, bob, carol = (make_key(server.data_dir, name) for name in ("alice", "bob", "carol"))
        admin = make_key(server.data_dir, "admin", admin=True)
        talks = {alice: [*HISTORY, QUESTION], bob: [*HISTORY[:1], *HISTORY[3:], QUESTION]}
        firsts = {key: chat(server, key, messages) for key, messages in talks.items()}
        assert saved_files(server.data_dir) and cached(firsts[bob]) == 0  # alice's saved as bob took the slot
        for key, messages in talks.items():
            messages += [
                {"role": "assistant", "content": firsts[key]["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And which came last?"},
            ]
            later = chat(server, key, messages)
            assert cached(later) >= firsts[key]["usage"]["prompt_tokens"] - 4, later["usage"]
        assert len(saved_files(server.data_dir)) == 2
        # Counted as saved, alice's state written twice (the second over the first): what is on disk.
        on_disk = sum(path.stat().st_size for path in saved_files(server.data_dir))
        assert metric(server, admin, "llmserver_prompt_cache_disk_bytes") == on_disk
        assert metric(server, admin, "llmserver_prompt_caches_restored_total") == 2
        assert metric(server, admin, "llmserver_prompt_caches_displaced_total") == 3  # each turn but the first
        probe = chat(server, carol, talks[alice])  # alice's conversation, word for word, from another key
        assert cached(probe) == 0, probe["usage"]
