"""Whose prompt each slot of a node's instance holds, and whose turn it is there, shared by every gateway
that routes to it (cache_isolation = "key" across gateways), with the per-key tier under those slots.

On one host the gateway alone sends to its instances and keeps each slot's owner in memory
(`Instance.take_slot`) and each slot's turns (pool/slot_gate.py). A node's instance takes requests from
every gateway, so the same record lives in Redis, one key per instance (`llmserver:slots:ID`), and each
request takes its slot, waits for its turn and gives it back with one script run there each — atomic, so
two gateways never both think a slot idle — under the rules of one host:

- a request may reuse a slot's cached prompt only when every request pinned to that slot since it was last
  idle is its own key's: a conversation finds its own slot again, warm, whichever gateway its next turn
  comes through, and no key learns from `cached_tokens` about another key's prompt;
- with saved prompts on (the node publishes its instance's prompt folder), a request whose prompt is long
  enough to be worth keeping, or that displaces a conversation worth keeping, has the slot to itself: it
  saves the conversation the slot holds (llama-server's slot save, into the node's folder, under a name of
  its own) and restores its own if one was saved (`llmserver:saved:NODE:IDENTITY`, the conversation's
  file by key-hashed name), so more conversations than slots keep their cache; shorter ones share the slot.
  Turns are first come, first served, as on one host. A conversation saved on another node (its instance
  drained or stopped there, the model now on this one) is carried here first (`llmserver:saved-at:IDENTITY`
  names the node that saved each conversation last; cluster/transfer.py carries it, sealed, from that node's
  listener to this one's) and restored, when both nodes' listeners can be reached and the instance key is set.

Each request's hold on a slot carries a deadline `HOLD_SECONDS` ahead, renewed by its gateway while the
request lasts: a gateway that dies leaves its slots counted busy for at most that long, then nobody's.
While Redis cannot be reached a request is sent with `cache_prompt` off (nothing reused, nothing leaked).

The record decides in the order requests take slots, llama-server runs them in the order they arrive: a
request of key B that takes a busy slot right after key A's request took it (told to reuse: the slot held
A's prompt) must not reach llama-server first, or A's prompt would be read against B's in the slot's
cache and A's `cached_tokens` would tell it how B's prompt begins. So B waits until A's take is
`GRACE_MS` old before sending — nothing lost in practice (the slot is busy with A's request), and the
order holds as long as a gateway sends a request within `GRACE_MS` of taking its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from llmserver.cluster import transfer
from llmserver.cluster.records import NODE_KEY
from llmserver.errors import APIError
from llmserver.outage import Outage, redis_unreachable
from llmserver.pool.saved_prompts import SAVE_TIMEOUT, SUFFIX, entry_name

if TYPE_CHECKING:
    import redis.asyncio
    from redis.commands.core import AsyncScript

    from llmserver.llama.client import LlamaServerClient
    from llmserver.pool.instance import Instance
    from llmserver.pool.saved_prompts import SavedPrompts

log = logging.getLogger(__name__)

SLOTS_KEY = "llmserver:slots:"  # + instance id
SAVED_KEY = "llmserver:saved:"  # + node id + ":" + prompt folder identity: entry name → file
SAVED_AT_KEY = "llmserver:saved-at:"  # + prompt folder identity: entry name → the node that saved it last
KEEP_MS = 86_400_000  # an instance's record outlives a day of no requests only if it is used again
# A request sent to a slot that another key's request took less than this ago waits out the rest first: that
# one may have been told to reuse the slot's prompt, and must reach llama-server first (see the module's note).
GRACE_MS = 100
HOLD_SECONDS = 10.0  # a hold lapses this long after its gateway last renewed it ...
RENEW_EVERY = 2.5  # ... which it does this often while the request lasts
TURN_POLL = (0.005, 0.05)  # seconds between looks at a slot whose turn has not come: first, at most

# Per slot: o (the key whose prompt it holds; "" unknown), s (its prompt's start, hashed), t (when it was
# last taken: the record's clock), u (1: its last request ended early and may still be finishing), c (the
# conversation its cache holds: k key, s start, n prompt bytes; absent: not known), q (its requests in the
# order they took it: i hold id, al 1 if it goes alone, e 1 once its turn came, d its deadline and a when
# it was taken in ms, k its key).
_LOAD = """
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000 + math.floor(tonumber(now_parts[2]) / 1000)
local n = tonumber(ARGV[1])
local raw = redis.call('GET', KEYS[1])
local state = raw and cjson.decode(raw) or nil
if not state or #state.slots ~= n then
  state = {clock = 0, slots = {}}
  for i = 1, n do state.slots[i] = {o = '', s = '', t = 0, u = 0, q = {}} end
end
for i = 1, n do
  local slot, kept = state.slots[i], {}
  for _, hold in ipairs(slot.q) do
    if hold.d <= now then
      if hold.e == 1 then slot.o, slot.u, slot.c = '', 1, nil end
    else
      kept[#kept + 1] = hold
    end
  end
  slot.q = kept
end
local function save(keep)
  redis.call('SET', KEYS[1], cjson.encode(state), 'PX', keep)
end
local function find(slot, hold)
  for j, entry in ipairs(slot.q) do
    if entry.i == hold then return j end
  end
  return nil
end
-- Its turn (pool/slot_gate.py): every request before it has had its turn and none of those goes alone;
-- one that goes alone, only with nothing before it.
local function turn(slot, j)
  for m = 1, j - 1 do
    if slot.q[m].e ~= 1 or slot.q[m].al == 1 then return false end
  end
  return slot.q[j].al ~= 1 or j == 1
end
local function worth(slot, key, start, least)
  local c = slot.c
  return c ~= nil and c.n >= least and not (c.k == key and c.s == start)
end
local function held(slot)
  if slot.c == nil then return {'', '', 0} end
  return {slot.c.k, slot.c.s, slot.c.n}
end
"""

# ARGV: slots, key id, start, hold id, hold ms, keep ms, grace ms, prompt bytes, min bytes to keep, gated (0/1)
# → slot (from 0), reuse, ms to wait before sending, its turn came, alone, held key, start, bytes
TAKE = (
    _LOAD
    + """
local key, start, least, gated = ARGV[2], ARGV[3], tonumber(ARGV[9]), ARGV[10] == '1'
local idle, sure = {}, {}
for i = 1, n do
  if #state.slots[i].q == 0 then
    idle[#idle + 1] = i
    if state.slots[i].u == 0 then sure[#sure + 1] = i end
  end
end
if #sure > 0 then idle = sure end
local chosen = nil
for _, i in ipairs(idle) do
  if state.slots[i].o == key and state.slots[i].s == start then chosen = i break end
end
if not chosen then
  for _, i in ipairs(idle) do
    if not chosen or state.slots[i].t < state.slots[chosen].t then chosen = i end
  end
end
if not chosen then
  for i = 1, n do
    if not chosen or #state.slots[i].q < #state.slots[chosen].q then chosen = i end
  end
end
local slot = state.slots[chosen]
local reuse = slot.o == key
if #slot.q == 0 or reuse then slot.o = key else slot.o = '' end
local wait = 0
for _, hold in ipairs(slot.q) do
  if hold.k ~= key then wait = math.max(wait, hold.a + tonumber(ARGV[7]) - now) end
end
slot.s = start
local alone = gated and (tonumber(ARGV[8]) >= least or worth(slot, key, start, least))
slot.q[#slot.q + 1] = {i = ARGV[4], al = alone and 1 or 0, e = gated and 0 or 1, d = now + tonumber(ARGV[5]),
                       a = now, k = key}
local j = #slot.q
if gated and turn(slot, j) then slot.q[j].e = 1 end
state.clock = state.clock + 1
slot.t = state.clock
save(ARGV[6])
local c = held(slot)
return {chosen - 1, reuse and 1 or 0, wait, slot.q[j].e, slot.q[j].al, c[1], c[2], c[3]}
"""
)

# ARGV: slots, slot (from 0), hold id, keep ms, key id, start, min bytes to keep
# → its turn came (1/0; -1: the hold is gone), alone, held key, start, bytes
ENTER = (
    _LOAD
    + """
local slot = state.slots[tonumber(ARGV[2]) + 1]
local j = slot and find(slot, ARGV[3])
if not j then return {-1, 0, '', '', 0} end
local entry = slot.q[j]
if entry.al ~= 1 and worth(slot, ARGV[5], ARGV[6], tonumber(ARGV[7])) then entry.al = 1 end
if turn(slot, j) then entry.e = 1 end
save(ARGV[4])
local c = held(slot)
return {entry.e, entry.al, c[1], c[2], c[3]}
"""
)

# ARGV: slots, slot (from 0), hold id, finished (0/1), keep ms, its key, start, prompt bytes → 1 if it held it
GIVE = (
    _LOAD
    + """
local slot = state.slots[tonumber(ARGV[2]) + 1]
local j = slot and find(slot, ARGV[3])
if not j then return 0 end
local entry = table.remove(slot.q, j)
if entry.e == 1 then
  if ARGV[4] == '1' then
    slot.u, slot.c = 0, {k = ARGV[6], s = ARGV[7], n = tonumber(ARGV[8])}
  else
    slot.o, slot.u, slot.c = '', 1, nil
  end
end
save(ARGV[5])
return 1
"""
)

# ARGV: slots, hold ms, keep ms, hold ids... → how many were renewed
RENEW = (
    _LOAD
    + """
local mine = {}
for m = 4, #ARGV do mine[ARGV[m]] = true end
local renewed = 0
for i = 1, n do
  for _, hold in ipairs(state.slots[i].q) do
    if mine[hold.i] then hold.d, renewed = now + tonumber(ARGV[2]), renewed + 1 end
  end
end
if renewed > 0 then save(ARGV[3]) end
return renewed
"""
)


@dataclass
class Claim:
    """A request's hold on a slot of a node's instance, as its take left it."""

    slot: int
    reuse: bool  # it may reuse the slot's cached prompt
    hold: str
    wait_ms: int  # before sending: another key's request took the slot just now
    turn: bool  # its turn on the slot has come
    alone: bool  # it has (or waits to have) the slot to itself
    held: tuple[str, str, int] | None  # the conversation the slot's cache holds: key id, start, prompt bytes


def _held(key: bytes | str, start: bytes | str, size: int) -> tuple[str, str, int] | None:
    key, start = _text(key), _text(start)
    return (key, start, int(size)) if key else None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class SharedSlots:
    """A gateway's end of the shared slot records and of the per-key tier on nodes' instances."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        gateway: str,
        hold_seconds: float = HOLD_SECONDS,
        saved: SavedPrompts | None = None,
        min_tokens: int = 256,
        api_key: str | None = None,
    ) -> None:
        self._redis = client
        self._api_key = api_key  # signs and seals the saved states carried between nodes (none: never carried)
        self._scripts: dict[str, AsyncScript] = {}
        self._gateway = gateway
        self._holds = itertools.count(1)
        self.hold_ms = int(hold_seconds * 1000)
        self.saved = saved  # the tier's counters (None, or disabled: this gateway saves and restores nothing)
        # Prompts of this many bytes or more go alone on a slot (and conversations as long are worth keeping).
        self.min_tokens = saved.min_tokens if saved is not None else min_tokens
        self._live: dict[str, tuple[int, set[str]]] = {}  # instance id → its slots, this gateway's holds there
        self._giving: set[asyncio.Task[None]] = set()
        self._saves = itertools.count(1)
        self._outage = Outage(log)

    def _script(self, source: str) -> AsyncScript:
        """The script, run by its hash (loaded into Redis on first use, and again after a Redis restart)."""
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = self._redis.register_script(source)
        return script

    @property
    def tier(self) -> bool:
        return self.saved is not None and self.saved.enabled

    async def pin(
        self,
        instance_id: str,
        slots: int,
        key_id: str,
        start: int,
        size: int,
        client: LlamaServerClient | None = None,
        folder: str | None = None,
    ) -> tuple[int, bool, str] | None:
        """A slot of the instance for `key_id`'s request whose prompt (`size` bytes) begins as `start`, once
        the request may be sent there: the slot, whether it may reuse the slot's cached prompt, and the hold
        to give back; None while Redis cannot be reached. `folder` (NODE:IDENTITY, the node's prompt folder
        for the instance, and `client` the instance's): saved prompts on there — the request waits for its
        turn (whatever this gateway's own setting: another gateway may restore a conversation there), saves
        what it displaces and restores its own conversation as on one host (pool/router.py)."""
        gated = folder is not None and client is not None
        claim = await self.claim(instance_id, slots, key_id, start, size, gated)
        if claim is None:
            return None
        try:
            if claim.wait_ms > 0:
                await asyncio.sleep(claim.wait_ms / 1000)
            if not gated:
                return claim.slot, claim.reuse, claim.hold
            assert client is not None and folder is not None
            if not await self.wait_turn(instance_id, slots, claim, key_id, start):
                self.give(instance_id, slots, claim.slot, claim.hold, finished=False)
                return None  # Redis gone, or its hold lapsed: sent as it is, nothing reused
            return claim.slot, await self._tier(claim, client, folder, key_id, start), claim.hold
        except BaseException:
            self.give(instance_id, slots, claim.slot, claim.hold, finished=False)
            raise

    async def claim(
        self, instance_id: str, slots: int, key_id: str, start: int, size: int = 0, gated: bool = False
    ) -> Claim | None:
        """`pin`'s record update: the slot taken, and what the caller must still wait for."""
        hold = f"{self._gateway}:{next(self._holds)}"
        args: list[str | int] = [
            slots, key_id, str(start), hold, self.hold_ms, KEEP_MS, GRACE_MS, size, self.min_tokens, int(gated)
        ]  # fmt: skip
        try:
            answer = await self._script(TAKE)(keys=[SLOTS_KEY + instance_id], args=args)
        except redis_unreachable() as exc:
            self._outage.failed("slot records unreachable in Redis (prompts sent without reusing a cache): %s", exc)
            return None
        self._outage.recovered("slot records in Redis reachable again")
        slot, reuse, wait, turn, alone, key, begun, bytes_ = answer
        self._live.setdefault(instance_id, (slots, set()))[1].add(hold)
        return Claim(int(slot), bool(reuse), hold, int(wait), bool(turn), bool(alone), _held(key, begun, bytes_))

    async def wait_turn(self, instance_id: str, slots: int, claim: Claim, key_id: str, start: int) -> bool:
        """Wait for the claim's turn on its slot (looking again after a short pause, longer each time); False
        if Redis cannot be reached or its hold lapsed meanwhile. The claim then says whether it goes alone and
        what the slot holds."""
        if claim.turn:
            return True
        pause = TURN_POLL[0]
        while True:
            await asyncio.sleep(pause)
            pause = min(pause * 2, TURN_POLL[1])
            args: list[str | int] = [slots, claim.slot, claim.hold, KEEP_MS, key_id, str(start), self.min_tokens]
            try:
                turn, alone, key, begun, bytes_ = await self._script(ENTER)(keys=[SLOTS_KEY + instance_id], args=args)
            except redis_unreachable() as exc:
                self._outage.failed("slot records unreachable in Redis (prompts sent without reusing a cache): %s", exc)
                return False
            if int(turn) < 0:
                return False
            claim.alone, claim.held = bool(alone), _held(key, begun, bytes_)
            if int(turn) == 1:
                claim.turn = True
                return True

    async def _tier(self, claim: Claim, client: LlamaServerClient, folder: str, key_id: str, start: int) -> bool:
        """With its turn come: whether the request may reuse the slot's prompt, once the conversation the slot
        holds is saved (if worth it and not this one) and this one restored (if it was saved): with this
        gateway's tier on."""
        mine, held = (key_id, str(start)), claim.held
        if not claim.alone:
            return claim.reuse
        if held is not None and held[:2] == mine:
            return True
        if self.tier and held is not None and held[2] >= self.min_tokens:
            await self._keep(client, folder, claim.slot, held[0], held[1])
        reuse = held is not None and held[0] == key_id
        if not self.tier:
            return reuse
        return await self._restore(client, folder, claim.slot, key_id, str(start)) or reuse

    async def _keep(self, client: LlamaServerClient, folder: str, slot: int, key_id: str, start: str) -> None:
        """Save the conversation the slot holds under a name of its own on the node; index it once written
        whole (a restore reads a complete file or none)."""
        assert self.saved is not None
        entry = entry_name(key_id, int(start))
        name = f"{entry.removesuffix(SUFFIX)}-{self._gateway}-{next(self._saves)}{SUFFIX}"
        try:
            answer = await client.post_json(f"/slots/{slot}?action=save", {"filename": name}, timeout=SAVE_TIMEOUT)
        except APIError as exc:
            log.warning("slot %d's prompt cache not saved on its node: %s", slot, exc.message)
            return
        if int(answer.get("n_saved", 0)) < self.min_tokens:
            return  # too short to be worth restoring; the node's trim removes the file in its turn
        with contextlib.suppress(*redis_unreachable()):
            await _index(self._redis, folder, {entry: name})
            self.saved.displaced += 1

    async def _restore(self, client: LlamaServerClient, folder: str, slot: int, key_id: str, start: str) -> bool:
        """Load the conversation saved on the node into the slot; whether it was."""
        assert self.saved is not None
        entry = entry_name(key_id, int(start))
        try:
            name = await self._redis.hget(SAVED_KEY + folder, entry)
        except redis_unreachable():
            return False
        if not name:
            name = await self._fetch(folder, entry)
        if not name:
            return False
        try:
            await client.post_json(f"/slots/{slot}?action=restore", {"filename": _text(name)}, timeout=SAVE_TIMEOUT)
        except APIError as exc:  # trimmed on the node meanwhile, most likely
            self.saved.restore_failures += 1
            log.info("a saved prompt cache could not be restored on its node: %s", exc.message)
            with contextlib.suppress(*redis_unreachable()):
                await self._redis.hdel(SAVED_KEY + folder, entry)
            return False
        self.saved.restored += 1
        return True

    async def _fetch(self, folder: str, entry: str) -> str | None:
        """The conversation `entry` carried into `folder` (NODE:IDENTITY) from the node that saved it last, if
        another node did and both nodes' listeners are published: its name there, indexed; else None."""
        assert self.saved is not None
        node, _, identity = folder.rpartition(":")
        if self._api_key is None:
            return None
        try:
            source = await self._redis.hget(SAVED_AT_KEY + identity, entry)
            if not source or _text(source) == node:
                return None
            source = _text(source)
            held = await self._redis.hget(SAVED_KEY + f"{source}:{identity}", entry)
            records = await self._redis.mget([NODE_KEY + source, NODE_KEY + node])
        except redis_unreachable():
            return None
        urls = [json.loads(raw).get("listener") if raw else None for raw in records]
        if not held or not urls[0] or not urls[1]:
            return None  # the source node gone (or its copy trimmed), or a listener gateways cannot reach
        held = _text(held)
        name = f"{entry.removesuffix(SUFFIX)}-{self._gateway}-{next(self._saves)}{SUFFIX}"
        began = time.monotonic()
        try:
            size = await carry(urls[0], urls[1], self._api_key, identity, held, name)
        except (aiohttp.ClientError, TimeoutError, transfer.TransferError) as exc:
            self.saved.fetch_failures += 1
            log.warning("a saved prompt cache was not carried from node %s to node %s: %s", source, node, exc or
                        type(exc).__name__)  # fmt: skip
            return None
        self.saved.fetched += 1
        log.info("a saved prompt cache carried from node %s to node %s: %.1f MiB in %.2f s", source, node,
                 size / 2**20, time.monotonic() - began)  # fmt: skip
        with contextlib.suppress(*redis_unreachable()):
            await _index(self._redis, folder, {entry: name})
            await self._redis.hdel(SAVED_KEY + f"{source}:{identity}", entry)  # its node's sweep removes that copy
        return name

    def give(
        self,
        instance_id: str,
        slots: int,
        slot: int,
        hold: str,
        finished: bool,
        conversation: tuple[str, int, int] | None = None,
    ) -> asyncio.Task[None]:
        """Give the slot back (`finished`: its request ended normally, the slot's cache now its
        `conversation`: key id, start, prompt bytes); the task ends once the record says so (a request's end
        awaits it, as it awaits its load's publication)."""
        key, start, size = conversation or ("", 0, 0)
        args: list[str | int] = [slots, slot, hold, int(finished), KEEP_MS, key, str(start), size]
        live = self._live.get(instance_id)
        if live is not None:
            live[1].discard(hold)
            if not live[1]:
                del self._live[instance_id]
        task = asyncio.create_task(self._write_give(instance_id, args))
        self._giving.add(task)
        task.add_done_callback(self._giving.discard)
        return task

    async def _write_give(self, instance_id: str, args: list[str | int]) -> None:
        try:
            await self._script(GIVE)(keys=[SLOTS_KEY + instance_id], args=args)
        except redis_unreachable() as exc:  # the hold lapses at its deadline
            self._outage.failed("slot records unreachable in Redis (holds lapse at their deadline): %s", exc)

    async def renew(self) -> None:
        """This gateway's holds kept from lapsing while their requests last (every `RENEW_EVERY`)."""
        while True:
            await asyncio.sleep(RENEW_EVERY)
            await self.renew_once()

    async def renew_once(self) -> None:
        for instance_id, (slots, holds) in list(self._live.items()):
            args: list[str | int] = [slots, self.hold_ms, KEEP_MS, *holds]
            try:
                await self._script(RENEW)(keys=[SLOTS_KEY + instance_id], args=args)
            except redis_unreachable():
                return  # logged by the requests' takes and gives

    async def close(self) -> None:
        """Write the gives under way (a stopping gateway's last requests)."""
        if self._giving:
            with contextlib.suppress(Exception):
                await asyncio.wait(list(self._giving), timeout=1.0)


async def _index(client: redis.asyncio.Redis, folder: str, saved: Mapping[str, str]) -> None:
    """Index conversations saved in `folder` (NODE:IDENTITY): entry → file there, and that node as where each
    was saved last (a turn that lands on another node's instance of the same identity carries it from there)."""
    node, _, identity = folder.rpartition(":")
    pipe = client.pipeline(transaction=False)
    pipe.hset(SAVED_KEY + folder, mapping=dict(saved.items()))
    pipe.pexpire(SAVED_KEY + folder, KEEP_MS)
    pipe.hset(SAVED_AT_KEY + identity, mapping=dict.fromkeys(saved, node))
    pipe.pexpire(SAVED_AT_KEY + identity, KEEP_MS)
    await pipe.execute()


async def carry(source: str, target: str, key: str, identity: str, held: str, name: str) -> int:
    """Carry the saved state `held` in the prompt folder `identity` of the node listening at `source` into the
    same folder of the node at `target` as `name` (cluster/transfer.py: signed requests, sealed stream, never
    whole in memory), within `SAVE_TIMEOUT`: its size. Raises aiohttp.ClientError, TimeoutError or TransferError."""
    get_path, put_path = f"/prompts/{identity}/{held}", f"/prompts/{identity}/{name}"
    timeout = aiohttp.ClientTimeout(total=SAVE_TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        headers = {"Authorization": transfer.sign(key, "GET", get_path)}
        async with session.get(source.rstrip("/") + get_path, headers=headers) as reading:
            if reading.status != 200:
                raise transfer.TransferError(f"node at {source} answered {reading.status} for it")
            headers = {"Authorization": transfer.sign(key, "PUT", put_path), "Content-Type": "application/octet-stream"}
            body = reading.content.iter_chunked(transfer.CHUNK)
            async with session.put(target.rstrip("/") + put_path, data=body, headers=headers) as writing:
                answer = await writing.json(content_type=None) if writing.status == 201 else None
                if answer is None:
                    raise transfer.TransferError(f"node at {target} answered {writing.status}: {await writing.text()}")
                return int(answer["bytes"])


async def sweep_superseded(client: redis.asyncio.Redis, node_id: str, root: Path) -> int:
    """On a node: remove the saved prompts under `root` (its prompt-cache folder) that no gateway's index names
    any more — an earlier turn of a conversation saved again since under a new name — once older than a save
    may take (a file just written is indexed right after). The number removed."""
    removed = 0
    for folder in await asyncio.to_thread(_folders, root):
        try:
            indexed = {_text(name) for name in await client.hvals(SAVED_KEY + f"{node_id}:{folder.name}")}
        except redis_unreachable():
            return removed
        removed += await asyncio.to_thread(_remove_unindexed, folder, indexed)
    return removed


def _folders(root: Path) -> list[Path]:
    return [folder for folder in root.glob("*/*") if folder.is_dir()]


def _remove_unindexed(folder: Path, indexed: set[str]) -> int:
    removed, old = 0, time.time() - SAVE_TIMEOUT
    for path in folder.glob(f"*{SUFFIX}"):
        with contextlib.suppress(OSError):
            if path.name not in indexed and path.stat().st_mtime < old:
                path.unlink()
                removed += 1
    return removed


async def save_on_node(client: redis.asyncio.Redis, node_id: str, saved: SavedPrompts, instance: Instance) -> int:
    """On a node, as one of its instances stops on purpose (a drain, idle, a rolling update, the node's
    shutdown): save the conversations its idle slots hold — whose they are is in the gateways' shared record —
    into its folder and index them, so that the conversation's next turn, through any gateway, is restored
    into whichever instance of the model on this node takes it. The number saved."""
    if instance.prompt_folder is None:
        return 0
    try:
        raw = await client.get(SLOTS_KEY + instance.id)
    except redis_unreachable():
        return 0
    held: list[tuple[int, str, int]] = []
    for slot, state in enumerate(json.loads(raw)["slots"] if raw else []):
        conversation = state.get("c")
        # Idle (no request holds it, its last one ended normally) and worth keeping.
        if not state["q"] and not state["u"] and conversation and conversation["n"] >= saved.min_tokens:
            held.append((slot, conversation["k"], int(conversation["s"])))
    count = await saved.save(instance, held)
    kept = {entry_name(key_id, start) for _, key_id, start in held}
    folder = instance.prompt_folder
    names = [name for name in kept if await asyncio.to_thread((folder / name).is_file)]
    if names:
        with contextlib.suppress(*redis_unreachable()):
            await _index(client, f"{node_id}:{folder.name}", {name: name for name in names})
    return count
