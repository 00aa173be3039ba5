"""The saved prompts' rules on real files: what makes a model's identity, whose entry a file is, the disk
budget (least recently used removed first), and the folders' permissions."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from llmserver.pool.saved_prompts import SavedPrompts, entry_name, identity


def args(model: Path, **flags: str) -> list[str]:
    base = {"--model": str(model), "--host": "127.0.0.1", "--port": "8001", "--threads": "2", "--ctx-size": "4096"}
    out = ["/usr/bin/llama-server"]
    for flag, value in (base | flags).items():
        out += [flag, value]
    return out


def test_the_identity_follows_what_shapes_the_kv_state_and_nothing_else(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")
    first = identity(args(model))
    assert identity(args(model, **{"--port": "8002", "--threads": "8", "--host": "10.0.0.2"})) == first
    assert identity(args(model, **{"--ctx-size": "8192"})) != first
    assert identity(args(model, **{"--cache-type-k": "q8_0"})) != first
    os.utime(model, ns=(1, 1))  # the file replaced in place (same path): another model
    assert identity(args(model)) != first


def test_an_entry_is_named_for_its_key_and_conversation_alone() -> None:
    assert entry_name("key-a", 7) == entry_name("key-a", 7)
    assert entry_name("key-b", 7) != entry_name("key-a", 7) != entry_name("key-a", 8)
    assert "key-a" not in entry_name("key-a", 7)


def test_a_new_identity_removes_the_models_older_states_and_keeps_others(tmp_path: Path) -> None:
    saved = SavedPrompts(tmp_path / "prompt-cache", budget_mb=10, min_tokens=1)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")
    old = saved.folder("chat", args(model))
    (old / entry_name("k", 1)).write_bytes(b"state")
    other = saved.folder("other", args(model))
    (other / entry_name("k", 1)).write_bytes(b"state")
    assert saved.folder("chat", args(model, **{"--port": "9000"})) == old  # same identity: kept
    assert (old / entry_name("k", 1)).exists()
    new = saved.folder("chat", args(model, **{"--ctx-size": "1024"}))
    assert new != old and not old.exists() and (other / entry_name("k", 1)).exists()
    for folder in (saved.root, new.parent, new):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_the_disk_budget_removes_the_least_recently_used_first(tmp_path: Path) -> None:
    saved = SavedPrompts(tmp_path / "prompt-cache", budget_mb=3, min_tokens=1)
    folder = saved.root / "chat-0" / "abc"
    folder.mkdir(parents=True)
    for n in range(5):  # 1 MiB each, used at times 1..5
        path = folder / entry_name("k", n)
        path.write_bytes(b"x" * 2**20)
        os.utime(path, (n + 1, n + 1))
    os.utime(folder / entry_name("k", 0), (10, 10))  # the oldest, restored since: the newest now
    saved.trim()
    left = {path.name for path in folder.iterdir()}
    assert left == {entry_name("k", n) for n in (0, 3, 4)}
    assert saved.disk_bytes == 3 * 2**20 <= saved.budget_bytes
    assert sum(path.stat().st_size for path in folder.iterdir()) == saved.disk_bytes
