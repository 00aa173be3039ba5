"""Conversations that survive their instance: slots' prompt caches saved to disk before an instance stops on
purpose, restored into a slot of the next instance of the same model that a conversation reaches.

On CPU, reading a long history is the slow part of a turn (measured here: 1,452 tokens read cold in 6 to
11 s, in 0.2 s from a slot's cache), and a slot's cache dies with its instance: an idle stop, an eviction
under the memory budget, a drain, a rolling update, a shutdown. llama-server saves a slot's KV state to a
file and loads it into any slot (`--slot-save-path`, `POST /slots/N?action=save|restore`): 1,466 tokens
made a 33.8 MB file, saved in 58 ms and restored in 46 ms, after which the next turn read 13 new tokens.

What is saved: each idle slot whose cached prompt is one key's conversation (the gateway knows whose:
cache_isolation = "key", engine/calls.py pins every request to a slot), holding at least
`prompt_cache_min_tokens` tokens. Where: `prompt-cache/<model>/<identity>/`, the identity a hash of
everything that shapes the KV state (llama-server's build with its llama.cpp libraries and the model's files,
by content; every flag but addresses, threads and keys: the same on every host that runs the same files the
same way); an instance of a changed model starts on a new identity and removes the old ones.
The file's name is a hash of the key's id and the conversation's start, so another key never finds it.
Files are the server user's alone (0600 in a 0700 folder); the least recently used are removed past
`prompt_cache_disk_mb`. A save is written under a name of its own and renamed into place once complete:
one instance restores a conversation while another saves its next turn (two instances of a model share
the folder), and a file read half-written made llama-server abort (`GGML_ASSERT(nread <= state_size)`
in `state_seq_load_file`, its requests failing with 504).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from llmserver.errors import APIError
from llmserver.llama.client import LlamaServerClient
from llmserver.models.files import file_checksum


class _Model(Protocol):
    @property
    def name(self) -> str: ...


class Instance(Protocol):
    """What saving and restoring reads of an instance (pool/instance.py's, which holds this service)."""

    @property
    def id(self) -> str: ...
    @property
    def model(self) -> _Model: ...
    @property
    def client(self) -> LlamaServerClient | None: ...
    @property
    def exited(self) -> bool: ...
    @property
    def prompt_folder(self) -> Path | None: ...
    def held_prompts(self) -> Iterable[tuple[int, str, int]]: ...


log = logging.getLogger(__name__)

SUFFIX = ".slot"
PARTIAL = ".part"  # a save being written; renamed to its SUFFIX name once complete
# llama-server flags that do not change what a slot's KV state is: where it listens, how many threads
# read and write, the RAM prompt cache, TLS files, its alias and the save path itself.
NEUTRAL = {
    "--host", "--port", "--threads-http", "--threads", "--threads-batch", "--cache-ram", "--ssl-cert-file",
    "--ssl-key-file", "--alias", "--slot-save-path",
}  # fmt: skip
# A file's content for the identity (`fingerprint`): whole up to SAMPLED_OVER bytes, sampled above.
EDGE_BYTES = 1 << 20
BLOCK_BYTES = 1 << 16
BLOCKS = 16
SAMPLED_OVER = 2 * EDGE_BYTES + BLOCKS * BLOCK_BYTES
# llama.cpp's libraries, part of the engine's identity with the binary (`engine_files`).
ENGINE_LIBRARIES = ("libllama*.so*", "libggml*.so*", "libmtmd*.so*")
SAVE_TIMEOUT = 60.0  # seconds for one slot's file (33.8 MB took 58 ms here)
# Seconds an instance's stop may wait for all its saves: a stuck instance must not hold a shutdown up.
SAVE_BUDGET = 15.0


def identity(args: list[str]) -> str:
    """What an instance started with `args` computes, as a hash: its binary with llama.cpp's libraries beside
    it (`engine_files`, their SHA-256) and its files (by content: see `fingerprint`) and its flags, less those
    that do not shape the KV state. A file's path is not part of it: the same model copied, moved,
    reinstalled or on another host is the same identity."""
    digest = hashlib.blake2b(digest_size=12)
    if args and Path(args[0]).is_absolute():
        for path in engine_files(Path(args[0])):
            try:
                checksum = file_checksum(path)  # read whole once per file version (in this process)
            except OSError:
                checksum = "?"
            digest.update(f"engine:{checksum}\x00".encode())
        args = args[1:]
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in NEUTRAL:
            skip = True
            continue
        content = fingerprint(Path(arg)) if Path(arg).is_absolute() else None
        digest.update(b"file:" + content if content is not None else arg.encode("utf-8", "surrogatepass"))
        digest.update(b"\x00")
    return digest.hexdigest()


def engine_files(binary: Path) -> list[Path]:
    """llama-server's binary and the llama.cpp libraries it loads, where builds and packages put them: beside
    it, or in ../lib, ../lib64 or ../lib/<multiarch> (a build's binary can be a small stub that calls into
    them, the same bytes from one llama.cpp version to the next)."""
    try:
        binary = binary.resolve()
    except OSError:
        return [binary]
    folders = [binary.parent, binary.parent.parent / "lib", binary.parent.parent / "lib64"]
    with contextlib.suppress(OSError):
        folders += sorted(path for path in (binary.parent.parent / "lib").glob("*-linux-*") if path.is_dir())
    found: set[Path] = set()
    for folder in folders:
        for pattern in ENGINE_LIBRARIES:
            with contextlib.suppress(OSError):
                found.update(path.resolve() for path in folder.glob(pattern))
    return [binary, *sorted(path for path in found if path.is_file())]


def fingerprint(path: Path) -> bytes | None:
    """A regular file's content as a hash (None for anything else): the whole file up to `SAMPLED_OVER`
    bytes; a larger one (a model's GGUF) by its size, its first and last `EDGE_BYTES` (a GGUF's
    header, its last tensors) and `BLOCKS` blocks of `BLOCK_BYTES` spread evenly between — about 3 MiB read
    whatever its size, where hashing a 4 GB file would hold every start up for seconds. Files that differ only
    outside the sample read as the same: a quantization or a fine-tune changes the size or every tensor."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # before opening: a FIFO would block the open
            return None
        with path.open("rb") as file:
            size = os.fstat(file.fileno()).st_size
            digest = hashlib.blake2b(f"{size}\x00".encode(), digest_size=16)
            if size <= SAMPLED_OVER:
                digest.update(file.read())
                return digest.digest()
            span = size - 2 * EDGE_BYTES - BLOCK_BYTES
            offsets = [0, *(EDGE_BYTES + span * n // (BLOCKS - 1) for n in range(BLOCKS)), size - EDGE_BYTES]
            for offset in offsets:
                file.seek(offset)
                digest.update(file.read(EDGE_BYTES if offset in (0, size - EDGE_BYTES) else BLOCK_BYTES))
            return digest.digest()
    except OSError:  # a folder, a path that is not there, a file this user cannot read
        return None


def entry_name(key_id: str, start: int) -> str:
    """The file of `key_id`'s conversation beginning as `start`: neither can be read back from it."""
    return hashlib.blake2b(f"{key_id}\x00{start}".encode(), digest_size=16).hexdigest() + SUFFIX


def _folder_name(model: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)[:80]
    return f"{safe}-{hashlib.blake2b(model.encode(), digest_size=4).hexdigest()}"


class SavedPrompts:
    def __init__(self, root: Path, budget_mb: int, min_tokens: int) -> None:
        self.root = root
        self.budget_bytes = budget_mb * 2**20
        self.min_tokens = min_tokens
        self.saved = self.restored = self.restore_failures = 0
        self.displaced = 0  # conversations saved as another took their slot (the tier under the slots)
        self.fetched = self.fetch_failures = 0  # conversations carried from the node that saved them (a gateway's)
        self.disk_bytes = 0  # as of the last trim (each save on stop, each start), plus what was kept since

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def folder(self, model: str, args: list[str]) -> Path:
        """The folder an instance of `model` started with `args` saves into (made, 0700); the model's
        folders of other identities are removed: their states belong to a model that changed."""
        model_dir = self.root / _folder_name(model)
        here = model_dir / identity(args)
        here.mkdir(mode=0o700, parents=True, exist_ok=True)
        for path in (self.root, model_dir):
            os.chmod(path, 0o700)
        for other in model_dir.iterdir():
            if other != here and other.is_dir():
                log.info("prompt caches of %s saved under an earlier setting removed (%s)", model, other.name)
                shutil.rmtree(other, ignore_errors=True)
        return here

    def forget(self, model: str) -> None:
        """A model no longer served: its saved prompts go."""
        shutil.rmtree(self.root / _folder_name(model), ignore_errors=True)

    async def save(self, instance: Instance, held: Iterable[tuple[int, str, int]] | None = None) -> int:
        """Save the instance's idle slots that hold one key's conversation (`held`: slot, key id, start; by
        default as the instance knows them); the number saved."""
        folder = instance.prompt_folder
        # A folder gone: an instance of changed settings has started since (a rolling update), and this
        # one's states would be of no use to it.
        if folder is None or instance.client is None or instance.exited or not folder.is_dir():
            return 0
        count, deadline = 0, time.monotonic() + SAVE_BUDGET
        for slot, key_id, start in instance.held_prompts() if held is None else held:
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("instance %s: out of time to save its prompt caches; the rest are lost", instance.id)
                break
            count += await self._save_slot(instance, folder, slot, key_id, start, min(left, SAVE_TIMEOUT))
        if count:
            self.saved += count
            log.info("instance %s (%s): %d conversations' prompt caches saved", instance.id, instance.model.name, count)
            self.trim()
        return count

    async def keep(self, instance: Instance, slot: int, key_id: str, start: int) -> bool:
        """Save the conversation an idle slot holds before another takes the slot (the per-key tier under
        the slots); whether it was (one under `min_tokens` is not kept)."""
        folder = instance.prompt_folder
        if folder is None or instance.client is None:
            return False
        path = folder / entry_name(key_id, start)
        before = _size(path)  # an earlier turn's state, overwritten
        kept = await self._save_slot(instance, folder, slot, key_id, start, SAVE_TIMEOUT)
        self.displaced += kept
        # On a request's path: the folder is listed only when the budget may be passed, not on every save.
        self.disk_bytes += _size(path) - before
        if self.disk_bytes > self.budget_bytes:
            await asyncio.to_thread(self.trim)
        return bool(kept)

    async def _save_slot(
        self, instance: Instance, folder: Path, slot: int, key_id: str, start: int, timeout: float
    ) -> int:
        """Save one slot's cache as `key_id`'s conversation `start`: 1 if kept, else 0. Written under a
        name of its own (this instance's, this slot's) and renamed into place: a restore elsewhere reads
        the earlier file or this one whole, never one half-written."""
        assert instance.client is not None
        name = entry_name(key_id, start)
        partial = f"{name}.{instance.id}.{slot}{PARTIAL}"
        try:
            answer = await instance.client.post_json(
                f"/slots/{slot}?action=save", {"filename": partial}, timeout=timeout
            )
        except APIError as exc:
            log.warning("instance %s: slot %d's prompt cache not saved: %s", instance.id, slot, exc.message)
            with contextlib.suppress(OSError):
                (folder / partial).unlink()
            return 0
        with contextlib.suppress(OSError):
            if int(answer.get("n_saved", 0)) < self.min_tokens:
                (folder / partial).unlink()
                return 0
            os.chmod(folder / partial, 0o600)
            os.replace(folder / partial, folder / name)
            return 1
        return 0

    def has(self, instance: Instance, key_id: str, start: int) -> bool:
        folder = instance.prompt_folder
        return folder is not None and (folder / entry_name(key_id, start)).is_file()

    async def restore(self, instance: Instance, slot: int, key_id: str, start: int) -> bool:
        """Load `key_id`'s saved conversation into the slot (pinned to the caller); whether it was."""
        folder, client = instance.prompt_folder, instance.client
        if folder is None or client is None:
            return False
        name = entry_name(key_id, start)
        try:
            answer = await client.post_json(f"/slots/{slot}?action=restore", {"filename": name}, timeout=SAVE_TIMEOUT)
        except APIError as exc:
            self.restore_failures += 1
            log.warning("instance %s: a saved prompt cache could not be restored: %s", instance.id, exc.message)
            return False
        with contextlib.suppress(OSError):
            os.utime(folder / name)  # recently used: the last to be trimmed
        self.restored += 1
        log.debug("instance %s: slot %d restored with %s tokens", instance.id, slot, answer.get("n_restored"))
        return True

    def trim(self) -> None:
        """Remove the least recently used saved prompts until they fit the disk budget (and saves left
        unfinished by an instance that died while writing them)."""
        for partial in self.root.glob(f"*/*/*{PARTIAL}"):
            with contextlib.suppress(OSError):
                if time.time() - partial.stat().st_mtime > SAVE_TIMEOUT:
                    partial.unlink()
        files = []
        for path in self.root.glob(f"*/*/*{SUFFIX}"):
            with contextlib.suppress(OSError):
                info = path.stat()
                files.append((info.st_mtime, info.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.budget_bytes:
                break
            with contextlib.suppress(OSError):
                path.unlink()
                total -= size
        self.disk_bytes = total


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
