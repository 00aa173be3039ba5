"""Whose prompt each slot of a node's instance holds, shared by every gateway that routes to it
(cache_isolation = "key" across gateways).

On one host the gateway alone sends to its instances and keeps each slot's owner in memory
(`Instance.take_slot`). A node's instance takes requests from every gateway, so the same record lives in
Redis, one key per instance (`llmserver:slots:ID`), and each request takes and gives its slot with one
script run there — atomic, so two gateways never both think a slot idle — under the same rule as on one
host: a request may reuse a slot's cached prompt only when every request pinned to that slot since it
was last idle is its own key's. A conversation so finds its own slot again, warm, whichever gateway its
next turn comes through, and no key learns anything from `cached_tokens` about another key's prompt.

Each request's hold on a slot carries a deadline (the request timeout and a minute): a gateway that dies
holding one leaves the slot counted busy until then, never idle while its request may still run there.
While Redis cannot be reached a request is sent with `cache_prompt` off (nothing reused, nothing leaked);
a give that could not be written lapses at its deadline.

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
import logging
from typing import TYPE_CHECKING

from llmserver.outage import Outage, redis_unreachable

if TYPE_CHECKING:
    import redis.asyncio
    from redis.commands.core import AsyncScript

log = logging.getLogger(__name__)

SLOTS_KEY = "llmserver:slots:"  # + instance id
KEEP_MS = 86_400_000  # an instance's record outlives a day of no requests only if it is used again
# A request sent to a slot that another key's request took less than this ago waits out the rest first: that
# one may have been told to reuse the slot's prompt, and must reach llama-server first (see the module's note).
GRACE_MS = 100

# Per slot: o (the key whose prompt it holds; "" unknown), s (its prompt's start, hashed), t (when it was
# last taken: the record's clock), u (1: its last request ended early and may still be finishing),
# h (hold id → {d: its deadline, a: when it was taken, ms; k: its key}).
_LOAD = """
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000 + math.floor(tonumber(now_parts[2]) / 1000)
local n = tonumber(ARGV[1])
local raw = redis.call('GET', KEYS[1])
local state = raw and cjson.decode(raw) or nil
if not state or #state.slots ~= n then
  state = {clock = 0, slots = {}}
  for i = 1, n do state.slots[i] = {o = '', s = '', t = 0, u = 0, h = {}} end
end
local holds = {}
for i = 1, n do
  local slot, held = state.slots[i], 0
  for id, hold in pairs(slot.h) do
    if hold.d <= now then
      slot.h[id] = nil
      slot.o, slot.u = '', 1
    else
      held = held + 1
    end
  end
  holds[i] = held
end
"""

# ARGV: slots, key id, start, hold id, hold ms, keep ms, grace ms → slot (from 0), reuse (0/1), warm (0/1),
# ms to wait before sending (another key's request took the slot less than the grace ago)
TAKE = (
    _LOAD
    + """
local key, start = ARGV[2], ARGV[3]
local idle, sure = {}, {}
for i = 1, n do
  if holds[i] == 0 then
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
    if not chosen or holds[i] < holds[chosen] then chosen = i end
  end
end
local slot = state.slots[chosen]
local reuse = slot.o == key
local warm = reuse and slot.s == start
if holds[chosen] == 0 or reuse then slot.o = key else slot.o = '' end
local wait = 0
for _, hold in pairs(slot.h) do
  if hold.k ~= key then wait = math.max(wait, hold.a + tonumber(ARGV[7]) - now) end
end
slot.s = start
slot.h[ARGV[4]] = {d = now + tonumber(ARGV[5]), a = now, k = key}
state.clock = state.clock + 1
slot.t = state.clock
redis.call('SET', KEYS[1], cjson.encode(state), 'PX', ARGV[6])
return {chosen - 1, reuse and 1 or 0, warm and 1 or 0, wait}
"""
)

# ARGV: slots, slot (from 0), hold id, finished (0/1), keep ms → 1 if the hold was there
GIVE = (
    _LOAD
    + """
local slot = state.slots[tonumber(ARGV[2]) + 1]
if not slot or not slot.h[ARGV[3]] then return 0 end
slot.h[ARGV[3]] = nil
if ARGV[4] == '1' then slot.u = 0 else slot.o, slot.u = '', 1 end
redis.call('SET', KEYS[1], cjson.encode(state), 'PX', ARGV[5])
return 1
"""
)


class SharedSlots:
    """A gateway's end of the shared slot records."""

    def __init__(self, client: redis.asyncio.Redis, gateway: str, hold_seconds: float) -> None:
        self._redis = client
        self._scripts: dict[str, AsyncScript] = {}
        self._gateway = gateway
        self._holds = itertools.count(1)
        self.hold_ms = int(hold_seconds * 1000)
        self._giving: set[asyncio.Task[None]] = set()
        self._outage = Outage(log)

    def _script(self, source: str) -> AsyncScript:
        """The script, run by its hash (loaded into Redis on first use, and again after a Redis restart)."""
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = self._redis.register_script(source)
        return script

    async def take(self, instance_id: str, slots: int, key_id: str, start: int) -> tuple[int, bool, str] | None:
        """A slot of the instance for `key_id`'s request whose prompt begins as `start`: the slot, whether it
        may reuse the slot's cached prompt, and the hold to give back; None while Redis cannot be reached.
        Returns once the request may be sent (after another key's request that just took the slot)."""
        claimed = await self.claim(instance_id, slots, key_id, start)
        if claimed is None:
            return None
        slot, reuse, hold, wait_ms = claimed
        if wait_ms > 0:
            await asyncio.sleep(wait_ms / 1000)
        return slot, reuse, hold

    async def claim(self, instance_id: str, slots: int, key_id: str, start: int) -> tuple[int, bool, str, int] | None:
        """`take`'s record update: also the ms to wait before sending."""
        hold = f"{self._gateway}:{next(self._holds)}"
        args: list[str | int] = [slots, key_id, str(start), hold, self.hold_ms, KEEP_MS, GRACE_MS]
        try:
            slot, reuse, _, wait = await self._script(TAKE)(keys=[SLOTS_KEY + instance_id], args=args)
        except redis_unreachable() as exc:
            self._outage.failed("slot records unreachable in Redis (prompts sent without reusing a cache): %s", exc)
            return None
        self._outage.recovered("slot records in Redis reachable again")
        return int(slot), bool(reuse), hold, int(wait)

    def give(self, instance_id: str, slots: int, slot: int, hold: str, finished: bool) -> asyncio.Task[None]:
        """Give the slot back (`finished`: its request ended normally, the slot's cache now its prompt); the
        task ends once the record says so (a request's end awaits it, as it awaits its load's publication)."""
        args: list[str | int] = [slots, slot, hold, "1" if finished else "0", KEEP_MS]
        task = asyncio.create_task(self._write_give(instance_id, args))
        self._giving.add(task)
        task.add_done_callback(self._giving.discard)
        return task

    async def _write_give(self, instance_id: str, args: list[str | int]) -> None:
        try:
            await self._script(GIVE)(keys=[SLOTS_KEY + instance_id], args=args)
        except redis_unreachable() as exc:  # the hold lapses at its deadline
            self._outage.failed("slot records unreachable in Redis (holds lapse at their deadline): %s", exc)

    async def close(self) -> None:
        """Write the gives under way (a stopping gateway's last requests)."""
        if self._giving:
            with contextlib.suppress(Exception):
                await asyncio.wait(list(self._giving), timeout=1.0)
