"""Saved prompt caches carried between nodes (cluster/transfer.py): requests signed with the instance key,
the state sealed end to end — what one node seals only the other opens, whole, for the same conversation."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmserver.cluster import transfer

KEY = "transfer-instance-key-0123456789abcdef"
IDENTITY = "0123456789abcdef01234567"
NAME = "00112233445566778899aabbccddeeff-gw-1.slot"


def _sealed(path: Path, key: str = KEY, identity: str = IDENTITY, name: str = NAME) -> list[bytes]:
    async def collect() -> list[bytes]:
        return [part async for part in transfer.sealed(path, key, identity, name)]

    return asyncio.run(collect())


def _open(parts: list[bytes], folder: Path, key: str = KEY, name: str = NAME, limit: int = 1 << 30) -> int:
    async def body() -> AsyncIterator[bytes]:
        for part in parts:  # as a network hands them over: split anywhere
            for at in range(0, len(part), 7000):
                yield part[at : at + 7000]

    return asyncio.run(transfer.open_into(body(), key, IDENTITY, folder, name, limit))


@pytest.fixture
def state(tmp_path: Path) -> Path:
    path = tmp_path / "source" / NAME
    path.parent.mkdir()
    path.write_bytes(os.urandom(2 * transfer.CHUNK + 12345))  # three chunks, the last a short one
    return path


def test_a_sealed_state_opens_whole_and_private_on_the_other_side(state: Path, tmp_path: Path) -> None:
    parts = _sealed(state)
    assert len(parts) == 4  # the stream's header, then three chunks
    assert state.read_bytes()[:4096] not in b"".join(parts)  # nothing in the clear
    target = tmp_path / "target"
    target.mkdir()
    assert _open(parts, target) == state.stat().st_size
    assert (target / NAME).read_bytes() == state.read_bytes()
    assert (target / NAME).stat().st_mode & 0o777 == 0o600
    assert [p.name for p in target.iterdir()] == [NAME]


def test_an_empty_state_is_one_final_chunk(tmp_path: Path) -> None:
    empty = tmp_path / NAME
    empty.write_bytes(b"")
    target = tmp_path / "target"
    target.mkdir()
    assert _open(_sealed(empty), target) == 0 and (target / NAME).read_bytes() == b""


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda parts: [parts[0], parts[1][:-1] + bytes([parts[1][-1] ^ 1]), *parts[2:]], "did not open"),
        (lambda parts: [parts[0], parts[2], parts[1], parts[3]], "did not open"),  # reordered
        (lambda parts: parts[:-1], "before its final chunk"),  # cut
        (lambda parts: [*parts[:-1], parts[-1][:-5]], "before its final chunk"),  # cut inside a chunk
        (lambda parts: [*parts, parts[-1]], "after the final chunk"),
        (lambda parts: [parts[0], b"\xff\xff\xff\xff", *parts[1:]], "longer than any"),
    ],
    ids=["altered", "reordered", "cut", "cut-inside", "appended", "oversized-frame"],
)
def test_a_stream_altered_on_the_way_writes_nothing(state: Path, tmp_path: Path, change: object, why: str) -> None:
    assert callable(change)
    target = tmp_path / "target"
    target.mkdir()
    with pytest.raises(transfer.TransferError, match=why):
        _open(change(_sealed(state)), target)
    assert list(target.iterdir()) == []  # neither the file nor its partial copy


def test_a_state_opens_only_with_the_key_for_the_conversation_it_was_sealed_for(state: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    with pytest.raises(transfer.TransferError, match="did not open"):
        _open(_sealed(state), target, key="another-instance-key-0123456789abcd")
    other = "ffeeddccbbaa99887766554433221100-gw-1.slot"  # another conversation's entry
    with pytest.raises(transfer.TransferError, match="did not open"):
        _open(_sealed(state), target, name=other)
    with pytest.raises(transfer.TransferError, match="did not open"):
        _open(_sealed(state, identity="ffffffffffffffffffffffff"), target)
    # The same conversation under another file name (each node names its copy) opens.
    assert _open(_sealed(state), target, name=NAME.replace("gw-1", "gw-2-7")) == state.stat().st_size
    assert list(target.iterdir()) == [target / NAME.replace("gw-1", "gw-2-7")]


def test_a_state_larger_than_the_nodes_budget_is_refused(state: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    with pytest.raises(transfer.TransferError, match="larger than the 1048576 bytes"):
        _open(_sealed(state), target, limit=transfer.CHUNK)
    assert list(target.iterdir()) == []


def test_a_request_is_signed_for_its_method_path_and_time_only() -> None:
    path = f"/prompts/{IDENTITY}/{NAME}"
    header = transfer.sign(KEY, "GET", path, now=1_000_000)
    assert KEY not in header and header.startswith("LLMS-HMAC-SHA256 1000000:")
    assert transfer.signed(KEY, header, "GET", path, now=1_000_030)
    assert not transfer.signed(KEY, header, "PUT", path, now=1_000_000)
    assert not transfer.signed(KEY, header, "GET", path.replace("gw-1", "gw-2"), now=1_000_000)
    assert not transfer.signed("another-instance-key-0123456789abcd", header, "GET", path, now=1_000_000)
    assert not transfer.signed(KEY, header, "GET", path, now=1_000_061)  # too old
    assert not transfer.signed(KEY, header, "GET", path, now=999_939)  # from the future
    for broken in ("", "Bearer " + KEY, "LLMS-HMAC-SHA256 ", "LLMS-HMAC-SHA256 x:y", header.rsplit(":", 1)[0] + ":"):
        assert not transfer.signed(KEY, broken, "GET", path, now=1_000_000), broken
