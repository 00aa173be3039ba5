"""A conversation's saved prompt cache carried from the node that holds it to the node whose instance takes
its next turn (cluster/slots.py decides when): a gateway reads it from the one node's listener and writes it
into the other's (cluster/node_http.py, `GET|PUT /prompts/IDENTITY/NAME`), streamed, never whole in memory.

The node listener is plain HTTP (it answers /health and /metrics to probes and Prometheus), and a slot's KV
state is the conversation itself, so neither the state nor the instance key ever crosses it in the clear:

- each request is signed with the instance key (HMAC-SHA256 of the method, the path and the time; accepted
  for `SIGNATURE_WINDOW` seconds): the key itself is never sent;
- the state travels sealed by libsodium's secretstream (XChaCha20-Poly1305, PyNaCl's binding), under a key
  derived from the instance key, its chunks bound to the folder identity and the conversation's entry: the
  gateway in between relays ciphertext, and the receiving node keeps the file only if every chunk and the
  final tag open — a cut, reordered or altered stream, or one for another conversation, writes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import re
import secrets
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nacl.bindings as sodium
from nacl.encoding import RawEncoder
from nacl.exceptions import CryptoError
from nacl.hash import blake2b

from llmserver.pool.saved_prompts import PARTIAL

SIGNATURE_SCHEME = "LLMS-HMAC-SHA256"
SIGNATURE_WINDOW = 60.0  # seconds a signed request is accepted either side of the node's clock
CHUNK = 1 << 20  # plaintext bytes per sealed chunk
_FRAME = struct.Struct(">I")  # each sealed chunk's length, before it
_HEADER = sodium.crypto_secretstream_xchacha20poly1305_HEADERBYTES
_TAG_FINAL = sodium.crypto_secretstream_xchacha20poly1305_TAG_FINAL
_TAG_MESSAGE = sodium.crypto_secretstream_xchacha20poly1305_TAG_MESSAGE
# What the routes take: a folder identity (pool/saved_prompts.identity) and a saved state's file name (its
# conversation's entry hash first: saved_prompts.entry_name).
IDENTITY = re.compile(r"[0-9a-f]{24}")
NAME = re.compile(r"[0-9a-f]{32}[A-Za-z0-9_.-]{0,160}\.slot")


class TransferError(Exception):
    """A saved state that could not be carried: why, in words."""


def sign(key: str, method: str, path: str, now: float | None = None) -> str:
    """The Authorization header's value for `method path`, signed with the instance key at `now`."""
    stamp = int(time.time() if now is None else now)
    return f"{SIGNATURE_SCHEME} {stamp}:{_mac(key, method, path, stamp)}"


def signed(key: str, header: str, method: str, path: str, now: float | None = None) -> bool:
    """Whether `header` signs `method path` with the instance key within `SIGNATURE_WINDOW` of `now`."""
    scheme, _, value = header.partition(" ")
    stamp_text, _, mac = value.strip().partition(":")
    if scheme != SIGNATURE_SCHEME or not stamp_text.isdigit() or not mac:
        return False
    stamp = int(stamp_text)
    if abs((time.time() if now is None else now) - stamp) > SIGNATURE_WINDOW:
        return False
    return hmac.compare_digest(mac.encode(), _mac(key, method, path, stamp).encode())


def _mac(key: str, method: str, path: str, stamp: int) -> str:
    message = f"llmserver prompt transfer\n{method.upper()}\n{path}\n{stamp}".encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def _stream_key(key: str) -> bytes:
    """The secretstream key: the instance key hashed under this use's own personalisation."""
    return bytes(blake2b(key.encode(), digest_size=32, person=b"llms-prompt-v1", encoder=RawEncoder))


def _bound_to(identity: str, name: str) -> bytes:
    """What each chunk is bound to: the folder identity and the conversation (the name's entry hash)."""
    return f"{identity}/{name[:32]}".encode()


async def sealed(path: Path, key: str, identity: str, name: str) -> AsyncIterator[bytes]:
    """The file at `path`, sealed: the stream's header, then each chunk as its length and ciphertext, the last
    one tagged final (an empty file is one empty final chunk)."""
    state = sodium.crypto_secretstream_xchacha20poly1305_state()
    yield sodium.crypto_secretstream_xchacha20poly1305_init_push(state, _stream_key(key))
    bound = _bound_to(identity, name)
    file = await asyncio.to_thread(path.open, "rb")
    try:
        chunk = await asyncio.to_thread(file.read, CHUNK)
        while True:
            following = await asyncio.to_thread(file.read, CHUNK) if chunk else b""
            tag = _TAG_FINAL if not following else _TAG_MESSAGE
            box = sodium.crypto_secretstream_xchacha20poly1305_push(state, chunk, bound, tag)
            yield _FRAME.pack(len(box)) + box
            if tag == _TAG_FINAL:
                return
            chunk = following
    finally:
        await asyncio.to_thread(file.close)


async def open_into(body: AsyncIterator[bytes], key: str, identity: str, folder: Path, name: str, limit: int) -> int:
    """Open the sealed stream `body` into `folder/name` (0600): written under a name of its own and renamed
    into place only once the final chunk opened — otherwise removed, and TransferError raised. Its size."""
    bound, box = _bound_to(identity, name), bytearray()
    state = sodium.crypto_secretstream_xchacha20poly1305_state()
    header: bytes | None = None
    partial = folder / f"{name}.{secrets.token_hex(4)}{PARTIAL}"  # removed by the node's trim if left behind
    written, final = 0, False
    descriptor = await asyncio.to_thread(os.open, partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as out:
            async for data in body:
                box += data
                if header is None:
                    if len(box) < _HEADER:
                        continue
                    header, box[:_HEADER] = bytes(box[:_HEADER]), b""
                    sodium.crypto_secretstream_xchacha20poly1305_init_pull(state, header, _stream_key(key))
                while len(box) >= _FRAME.size:
                    if final:
                        raise TransferError("bytes after the final chunk")
                    (length,) = _FRAME.unpack_from(box)
                    if length > CHUNK + sodium.crypto_secretstream_xchacha20poly1305_ABYTES:
                        raise TransferError("a sealed chunk longer than any the sender writes")
                    if len(box) < _FRAME.size + length:
                        break
                    chunk = bytes(box[_FRAME.size : _FRAME.size + length])
                    del box[: _FRAME.size + length]
                    try:
                        plain, tag = sodium.crypto_secretstream_xchacha20poly1305_pull(state, chunk, bound)
                    except CryptoError:  # forged, altered, reordered, or sealed for another key or file
                        raise TransferError("a chunk did not open (altered, or sealed for another file)") from None
                    written += len(plain)
                    if written > limit:
                        raise TransferError(f"larger than the {limit} bytes this node keeps")
                    await asyncio.to_thread(out.write, plain)
                    final = tag == _TAG_FINAL
        if not final or box:
            raise TransferError("the stream ended before its final chunk")
        await asyncio.to_thread(os.replace, partial, folder / name)
        return written
    finally:
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(partial.unlink)
