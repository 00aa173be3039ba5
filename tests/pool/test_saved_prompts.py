"""The saved prompts' rules on real files: what makes a model's identity, whose entry a file is, the disk
budget (least recently used removed first), and the folders' permissions."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from llmserver.llama.client import LlamaServerClient
from llmserver.models.files import embedded_model_path, llama_server_binary
from llmserver.pool.saved_prompts import (
    BLOCK_BYTES,
    EDGE_BYTES,
    SAMPLED_OVER,
    SavedPrompts,
    engine_files,
    entry_name,
    fingerprint,
    identity,
)
from tests.support import free_port


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
    model.write_bytes(b"weighty")  # the file replaced in place (same path): another model
    assert identity(args(model)) != first


def test_the_identity_reads_a_files_content_not_its_path_or_times(tmp_path: Path) -> None:
    """The same model copied, moved, reinstalled or on another host is the same identity, so a conversation
    saved under one finds its state under the other; a changed file is another."""
    model = tmp_path / "m.gguf"
    model.write_bytes(os.urandom(SAMPLED_OVER + 5 * BLOCK_BYTES))  # sampled, not read whole
    first = identity(args(model))
    os.utime(model, ns=(1, 1))
    assert identity(args(model)) == first
    copy = tmp_path / "elsewhere" / "copy.gguf"
    copy.parent.mkdir()
    copy.write_bytes(model.read_bytes())
    assert identity(args(copy)) == first
    for offset in (0, EDGE_BYTES + 3, model.stat().st_size - 1):  # the header, the first block, the last byte
        changed = bytearray(model.read_bytes())
        changed[offset] ^= 0xFF
        copy.write_bytes(changed)
        assert identity(args(copy)) != first, offset
    copy.write_bytes(model.read_bytes() + b"\x00")
    assert identity(args(copy)) != first  # another size
    folder = tmp_path / "lora"  # a folder, or a path that is not there: its text, as before
    folder.mkdir()
    assert identity(args(model, **{"--lora": str(folder)})) != identity(args(model, **{"--lora": str(tmp_path)}))
    assert fingerprint(folder) is None and fingerprint(tmp_path / "missing") is None
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert fingerprint(fifo) is None  # not opened: that would wait for a writer


def test_the_identity_reads_llama_cpps_libraries_beside_the_binary(tmp_path: Path) -> None:
    """A build's llama-server can be a small stub calling into libllama-server-impl.so and libllama.so, the same
    bytes from one version to the next: an upgrade that changes only a library is another identity."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")

    def build(folder: Path, library: bytes) -> list[str]:
        (folder / "bin").mkdir(parents=True)
        (folder / "bin" / "llama-server").write_bytes(b"stub")
        (folder / "bin" / "libllama.so.0.6.0").write_bytes(library)
        (folder / "bin" / "libllama.so.0").symlink_to("libllama.so.0.6.0")
        (folder / "lib").mkdir()
        (folder / "lib" / "libggml-cpu.so").write_bytes(b"kernels")
        (folder / "lib" / "libunrelated.so").write_bytes(library)  # not llama.cpp's: not read
        return [str(folder / "bin" / "llama-server"), "--model", str(model)]

    first = identity(build(tmp_path / "a", b"v1"))
    assert identity(build(tmp_path / "b", b"v1")) == first  # the same build elsewhere
    assert identity(build(tmp_path / "c", b"v2")) != first
    assert [path.name for path in engine_files(tmp_path / "a" / "bin" / "llama-server")] == [
        "llama-server", "libllama.so.0.6.0", "libggml-cpu.so"
    ]  # fmt: skip
    (tmp_path / "a" / "lib" / "libggml-cpu.so").write_bytes(b"other kernels")
    assert identity([str(tmp_path / "a" / "bin" / "llama-server"), "--model", str(model)]) != first


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


@dataclass
class Running:
    """One real llama-server of the embedded model, as SavedPrompts sees an instance."""

    id: str
    prompt_folder: Path
    process: subprocess.Popen[bytes]
    client: LlamaServerClient

    @property
    def exited(self) -> bool:
        return self.process.poll() is not None


def test_a_conversation_one_instance_saves_while_another_restores_it_is_never_read_half_written(
    tmp_path: Path,
) -> None:
    """Two instances of a model share their folder: one saves a conversation's next turn as the other
    restores it (the affinity test's lockstep turns under least_loaded routing). Written in place, the
    restore read a half-written file and llama-server aborted (`GGML_ASSERT(nread <= state_size)`), its
    request failing with 504; written aside and renamed, each restore reads one whole file."""
    folder = tmp_path / "prompt-cache"
    folder.mkdir()
    instances = []
    for name in ("saver", "restorer"):
        port = free_port()
        process = subprocess.Popen(
            [str(llama_server_binary(None)), "--model", str(embedded_model_path()), "--host", "127.0.0.1",
             "--port", str(port), "--ctx-size", "2048", "--parallel", "1", "--threads", "1",
             "--slot-save-path", str(folder)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        instances.append(Running(name, folder, process, LlamaServerClient(f"http://127.0.0.1:{port}")))
    saver, restorer = instances
    saved = SavedPrompts(tmp_path / "unused", budget_mb=1000, min_tokens=1)

    async def race() -> int:
        for instance in instances:
            for _ in range(300):
                if await instance.client.healthy():
                    break
                await asyncio.sleep(0.1)
        long = "Remember these rivers: " + ", ".join(f"river {n} of the north" for n in range(150))
        await saver.client.post_json(
            "/completion", {"prompt": long, "n_predict": 1, "id_slot": 0, "cache_prompt": True}
        )
        assert await saved.keep(saver, 0, "key", 7)  # type: ignore[arg-type]
        restored = 0
        for _ in range(25):
            _, ok = await asyncio.gather(saved.keep(saver, 0, "key", 7), saved.restore(restorer, 0, "key", 7))  # type: ignore[arg-type]
            restored += ok
            assert not restorer.exited, "llama-server aborted on a restore"
        for instance in instances:
            await instance.client.close()
        return restored

    try:
        assert asyncio.run(race()) == 25 and saved.restore_failures == 0
        assert sorted(p.name for p in folder.iterdir()) == [entry_name("key", 7)]  # no partial file left
    finally:
        for instance in instances:
            instance.process.kill()
            instance.process.wait()
