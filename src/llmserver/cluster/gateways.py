"""This gateway's place among the gateways that share a store: its lease, its heartbeat, and the sweep
of gateways that died.

A gateway holds a lease on its `gateway_id` in the store and renews it every fifth of
`gateway_lease_seconds`. The same beat writes what its requests in flight have produced so far (per
key and quota window), refreshes the speed averages with every gateway's traffic, and re-asserts its
places in flight in the shared limiter. A lease that lapsed belongs to a gateway that died (kill -9,
a lost host): the first live gateway to see it sweeps that gateway's state — its quota reservations
charged at what they had produced, its running async jobs failed (their keys lived only in its
memory), its undelivered claims made pollable again — and only that gateway's.

At start, a gateway takes its lease before it serves: a lease still held by a live process under the
same id is waited for (up to two lease periods, then a clear error: two gateways share an id), and
its own previous life is swept at once (a kill -9 and a restart on the same host need not wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable

from llmserver.errors import APIError, error_body
from llmserver.outage import Outage
from llmserver.store import GatewayHolder, GatewayStore, QuotaStore, Sweep

log = logging.getLogger("llmserver.gateway")  # its name before the move: log_levels name it

INTERRUPTED = error_body(
    500, "server_error", "The gateway running this job stopped before it finished; submit it again."
)


class GatewayIdInUse(Exception):
    pass


Beat = Callable[[], Awaitable[None]]


class GatewayLease:
    def __init__(
        self,
        store: GatewayStore,
        quota: QuotaStore,
        gateway_id: str,
        *,
        lease: float,
        job_ttl: float,
        produced: Callable[[], dict[tuple[str, str], int]],
        on_beat: list[Beat] | None = None,
        on_sweep: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self._store = store
        self._quota = quota
        self.gateway_id = gateway_id
        self.lease = lease
        self._job_ttl = job_ttl
        self._produced = produced
        self._on_beat = on_beat or []
        self._on_sweep = on_sweep
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self._written: dict[tuple[str, str], int] = {}
        self._healthy_since: float | None = None
        self._outage = Outage(log)
        self._task: asyncio.Task[None] | None = None
        self.renewed_at = float("-inf")  # monotonic: the lease last taken or renewed
        self.swept = 0  # other gateways' leases this one swept
        self.jobs_failed_by_sweep = 0

    @property
    def interval(self) -> float:
        return self.lease / 5

    async def start(self) -> None:
        """Take the lease (waiting for a live holder of the same id to let go), sweep this id's previous life."""
        await self._take()
        swept = await self._sweep(self.gateway_id, only_if_lapsed=False)
        if swept is not None and (swept.reservations or swept.jobs_failed):
            log.warning(
                "gateway %s had stopped with requests in flight: %d quota reservations settled at what they had "
                "produced (%d tokens), %d async jobs failed",
                self.gateway_id, swept.reservations, swept.charged, swept.jobs_failed,
            )  # fmt: skip
        self._healthy_since = self.renewed_at = time.monotonic()
        self._task = asyncio.create_task(self._beat(), name="gateway-lease")

    async def check_free(self) -> None:
        """GatewayIdInUse unless this process could take the lease (it is not taken here: the same
        process takes it when it starts; see `_take`)."""
        await self._take()
        await self._store.gateway_release(self.gateway_id, self.pid)

    async def _take(self) -> None:
        deadline = time.monotonic() + 2 * self.lease + 1
        warned = False
        while True:
            holder = await self._store.gateway_holder(self.gateway_id)
            if holder is None or holder.seconds_left <= 0 or self._mine_or_dead(holder):
                if await self._store.gateway_take(self.gateway_id, self.host, self.pid, self.lease, holder):
                    return
                continue
            if time.monotonic() > deadline:
                raise GatewayIdInUse(
                    f"gateway_id {self.gateway_id!r} is held by pid {holder.pid} on {holder.host}, which keeps "
                    "renewing it: give every gateway that shares the database its own gateway_id"
                )
            if not warned:
                warned = True
                log.warning(
                    "gateway_id %r is held by pid %d on %s for %.1f s more: waiting for it to stop or lapse",
                    self.gateway_id, holder.pid, holder.host, holder.seconds_left,
                )  # fmt: skip
            await asyncio.sleep(min(max(holder.seconds_left, 0.1), 1.0))

    def _mine_or_dead(self, holder: GatewayHolder) -> bool:
        """A holder on this host that is this process, or a process that no longer runs."""
        if holder.host != self.host:
            return False
        if holder.pid == self.pid:
            return True
        try:
            os.kill(holder.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    async def stop(self) -> None:
        """After the drain: nothing of this gateway is in flight any more; sweep what is left, let go."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            await self._quota.quota_progress(self.gateway_id, self._produced())
            await self._sweep(self.gateway_id, only_if_lapsed=False)
            await self._store.gateway_release(self.gateway_id, self.pid)
        except APIError as exc:
            log.error("could not release gateway %s's lease: %s", self.gateway_id, exc.message)

    async def _sweep(self, gateway_id: str, *, only_if_lapsed: bool) -> Sweep | None:
        return await self._store.sweep_gateway(
            gateway_id,
            error=json.dumps(INTERRUPTED),
            expires_at=time.time() + self._job_ttl,
            only_if_lapsed=only_if_lapsed,
        )

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.beat()
            except APIError as exc:  # the store is unreachable: it says so itself; try again next beat
                self._healthy_since = None
                self._outage.failed("gateway %s cannot renew its lease: %s", self.gateway_id, exc.message)
            except Exception:
                self._healthy_since = None
                log.exception("gateway %s: heartbeat failed", self.gateway_id)

    async def beat(self) -> None:
        """One heartbeat: renew, write progress, sweep the dead, then the other periodic work."""
        lapsed = await self._store.gateway_renew(self.gateway_id, self.pid, self.lease)
        if lapsed is None:
            log.error(
                "gateway %s lost its lease (it could not renew it for %.0f s and was swept): taking it again; "
                "requests that were in flight may be charged twice",
                self.gateway_id, self.lease,
            )  # fmt: skip
            await self._take()
            lapsed = []
        self._outage.recovered("gateway %s renews its lease again", self.gateway_id)
        now = self.renewed_at = time.monotonic()
        if self._healthy_since is None:
            self._healthy_since = now
        produced = self._produced()
        if produced != self._written:
            await self._quota.quota_progress(self.gateway_id, produced)
            self._written = produced
        # After an outage every lease looks lapsed: sweep only once this gateway has renewed for a whole
        # lease period, so that the others have had their chance to renew too.
        if now - self._healthy_since >= self.lease:
            for other in lapsed:
                if other != self.gateway_id:
                    await self._sweep_dead(other)
        for work in self._on_beat:
            # An unreachable Redis logs its own outage, once; the lease is fine.
            with contextlib.suppress(APIError):
                await work()

    async def _sweep_dead(self, gateway_id: str) -> None:
        swept = await self._sweep(gateway_id, only_if_lapsed=True)
        if swept is None:
            return  # another gateway swept it first, or it renewed in time
        self.swept += 1
        self.jobs_failed_by_sweep += swept.jobs_failed
        log.warning(
            "gateway %s stopped renewing its lease: swept %d quota reservations (charged %d tokens it had "
            "produced) and failed %d async jobs it was running",
            gateway_id, swept.reservations, swept.charged, swept.jobs_failed,
        )  # fmt: skip
        if self._on_sweep is not None:
            with contextlib.suppress(APIError):  # Redis away: its places lapse with their hash's expiry
                await self._on_sweep(gateway_id)
