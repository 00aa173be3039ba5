"""Prompt-cache affinity: which instance a request should go to, as a pure function.

llama-server reuses a slot's cached prompt prefix (measured here: a 1,750-token history took 6 s on
its first turn and 0.16 s on later turns on the same server), so a conversation should stay on the
instance that already holds it. Each request carries an affinity key (the session, else a hash of
the prefix every later turn repeats); instances are ranked for it by rendezvous (highest random
weight) hashing over their addresses, so every gateway ranks them the same way without shared
state, and an instance that goes away moves only its own keys.

A load guard keeps affinity from costing throughput: the key's first instance in rank order that
has a free slot and is within `margin` requests of the least loaded one with a free slot is chosen,
so a slot is never left idle while another instance takes the request's turn in a queue.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

# A prompt's first characters stand for it: enough to tell conversations apart, cheap to hash.
KEY_PREFIX_CHARS = 4000


@dataclass(frozen=True)
class Candidate:
    """What the policy needs to know of one instance."""

    address: str  # host:port: the same for every gateway
    in_flight: int
    slots: int

    @property
    def free(self) -> bool:
        return self.in_flight < self.slots


def affinity_key(*parts: str) -> str:
    """A key from the parts that identify a conversation (the model first)."""
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(part[:KEY_PREFIX_CHARS].encode("utf-8", "surrogatepass"))
        digest.update(b"\x00")
    return digest.hexdigest()


def weight(key: str, address: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{address}".encode(), digest_size=8).digest(), "big")


def ranked(key: str, candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates in the key's rendezvous order: the first is its home."""
    return sorted(candidates, key=lambda c: weight(key, c.address), reverse=True)


def choose(key: str | None, candidates: Sequence[Candidate], margin: int) -> Candidate | None:
    """The instance for a request: None when no candidate has a free slot (the request queues).

    Without a key, or with `margin` < 0 (affinity off), the least loaded one with a free slot."""
    free = [c for c in candidates if c.free]
    if not free:
        return None
    least = min(c.in_flight for c in free)
    if key is None or margin < 0:
        return next(c for c in free if c.in_flight == least)
    return next(c for c in ranked(key, free) if c.in_flight - least <= margin)
