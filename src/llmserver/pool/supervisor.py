"""The supervisor: one pool per model, kept at strength, scaled with demand, healed after crashes.

A small loop (`tick`, every `check_interval` seconds):
- an instance whose process died is marked failed and restarted in its slot with exponential
  backoff, until it has crashed `restart_max_failures` times within `restart_window`; then it is
  given up for `restart_window` (requests get 503 at once), and tried again afresh after that, so
  that a model recovers on its own once the cause is gone (a soak that killed an instance every
  minute found models given up for good until the gateway restarted);
- every `health_interval`, each instance must answer a real /health probe in time;
  `health_probe_misses` in a row count as a crash (a hung process is killed and replaced);
- RAM and CPU of each process are sampled;
- a pool below `min_instances` gets a new instance when the memory budget has room; an instance
  above `min_instances` that has been idle for `idle_timeout` (or the `keep_alive` a request asked
  for, if longer) is drained and stopped — down to none for `min_instances = 0`;
- a pool with requests waiting and no instance coming is tried again (a cold start that waits for
  memory to free up).
Requests that queue call `scale_up`, which starts one more instance when `max_instances` and the
memory budget allow: a model with no instance starts on its first request (a cold start). When the
budget is full, the least recently used idle instance of another model is stopped first; instances
with requests in flight are never stopped for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import psutil

from llmserver.errors import InvalidRequest, ModelNotFound, NotFound, UpstreamError
from llmserver.models.files import (
    ModelFileError,
    Progress,
    estimate_mb,
    fetch_from_gateway,
    llama_server_binary,
    mmproj_path,
    model_path,
    opened_within,
)
from llmserver.models.lineup import Lineup
from llmserver.pool.instance import Instance, InstanceStartError, Status, port_is_free
from llmserver.pool.pool import ModelPool
from llmserver.pool.saved_prompts import SavedPrompts
from llmserver.settings import ModelConfig, Settings, is_loopback

log = logging.getLogger(__name__)

SAMPLE_EVERY = 2.0  # seconds between samples of each instance's RAM and CPU
# A model whose files cannot be had is looked for again after this many seconds, doubling up to the most.
FILES_RETRY_FIRST = 5.0
FILES_RETRY_MAX = 300.0


class Nodes(Protocol):
    """Where a gateway of role `gateway` starts instances: on its nodes (cluster/registry.py `Registry`)."""

    async def start_instance(self, model: str, node: str | None, timeout: float) -> Instance: ...


class Supervisor:
    def __init__(self, settings: Settings, lineup: Lineup | None = None, *, check_interval: float = 0.5) -> None:
        self.settings = settings
        # The models served: the configuration's unless the caller's lineup says otherwise (the catalog's).
        self.lineup = Lineup(settings.models) if lineup is None else lineup
        self.check_interval = check_interval
        self.pools: dict[str, ModelPool] = {m.name: self._new_pool(m) for m in self.lineup}
        # Called with each pool a catalog change adds (the registry hooks a gateway's pools to it).
        self.on_new_pool: Callable[[ModelPool], None] = lambda pool: None
        budget = settings.instances.memory_budget_mb or int(psutil.virtual_memory().total / 2**20 * 0.8)
        self.memory_budget_mb = budget
        self._binary: Path | None = None
        self._files: dict[str, Path] = {}
        self._mmproj: dict[str, Path | None] = {}
        self._claimed_ports: set[int] = set()
        self._retiring: set[Instance] = set()  # instances of removed models, draining
        self._tasks: set[asyncio.Task[None]] = set()
        self._watch_task: asyncio.Task[None] | None = None
        self._probe_misses: dict[str, int] = {}
        self._progress_probes: set[str] = set()  # instances whose /slots probe is under way
        # A model's measured tokens/s per request (metrics/speed.py, set by the app): the stall bound.
        self.speed_of: Callable[[str], float | None] = lambda model: None
        self._last_probe = self._last_sample = 0.0
        self._stopping = False
        self._loopback = is_loopback(settings.instances.host)  # instances there stay plain HTTP
        # Every instance demands a key, so that only this gateway can use it: any local process could
        # otherwise call its /completion past quotas and the ledger, or read /slots. Without
        # instance_api_key (shared with other gateways for a node's instances), a random one.
        self.instance_key = settings.instances.key or secrets.token_urlsafe(32)
        self.remote: Nodes | None = None  # a gateway of role `gateway`: the nodes' instances
        # A node's: waits for the gateways' requests on a draining instance (Publisher.settle).
        self.drain_wait: Callable[[Instance, float], Awaitable[None]] | None = None
        # A node: told (bound in seconds) before the watchdog restarts an instance that made no progress.
        self.on_stall: Callable[[Instance, float], Awaitable[None]] | None = None
        # Saves an instance's conversations as it stops on purpose, where this supervisor does not know whose
        # each slot holds (a node: the gateways' shared record does, cluster/slots.py); else saved_prompts.save.
        self.save_prompts: Callable[[Instance], Awaitable[object]] | None = None
        # A node the scheduler runs: a model that leaves it goes on elsewhere, so its instances' conversations
        # are saved as they stop (and kept, for the node that takes the model: cluster/slots.py carries them).
        self.models_move = False
        # Conversations' prompt caches saved when an instance stops on purpose, restored by the next one.
        self.saved_prompts: SavedPrompts | None = None
        if settings.prompt_cache.isolation == "key" and settings.prompt_cache.disk_mb > 0:
            self.saved_prompts = SavedPrompts(
                settings.prompt_cache_dir, settings.prompt_cache.disk_mb, settings.prompt_cache.min_tokens
            )

    def _new_pool(self, model: ModelConfig) -> ModelPool:
        settings = self.settings
        return ModelPool(
            model,
            queue_timeout=settings.limits.queue_timeout,
            on_pressure=self.scale_up,
            on_failure=self.unreachable,
            affinity_margin=settings.router.affinity_margin if settings.router.policy == "affinity" else -1,
            fair_slice=settings.limits.fair_slice,
        )

    # Lifecycle

    @property
    def local(self) -> bool:
        """Whether this process runs instances itself (role `all`; a `gateway` routes to nodes' instances)."""
        return self.settings.role != "gateway"

    async def start(self) -> None:
        """Start every pool's min_instances and wait for them. A model that cannot run is that model's
        problem, never the server's: one whose files cannot be had, or whose instance fails to start, is
        marked with the reason (`pool.unstartable`, `pool.blocked`: /api/models, /ready's detail, the
        metrics), logged, and tried again with backoff by the watch loop while the others serve."""
        if not self.local:
            return
        self._binary = llama_server_binary(self.settings.instances.llama_server_path)
        if self.saved_prompts is not None:  # within a budget lowered since the last run, and measured
            await asyncio.to_thread(self.saved_prompts.trim)
        # Downloads (hf_repo models, first use) run in a thread: they may take minutes.
        for pool in self.pools.values():
            await self._find_files(pool)
        starts = [
            self._add_quietly(pool, self._new_instance(pool))
            for pool in self.pools.values() if pool.name in self._files
            for _ in range(pool.config.min_instances)
        ]  # fmt: skip
        await asyncio.gather(*starts)
        self._watch_task = asyncio.create_task(self._watch(), name="supervisor-watch")

    async def stop(self) -> None:
        self._stopping = True
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(self._save_and_stop(i) for i in self.all_instances()), return_exceptions=True)
        log.info("all instances stopped")

    async def _save_and_stop(self, instance: Instance) -> None:
        """Stop an instance on purpose, its conversations' prompt caches saved first (not a removed model's, unless
        models move: then it is removed from this node only)."""
        try:
            retired = instance in self._retiring and not self.models_move
            if self.saved_prompts is not None and not retired and not instance.exited:
                await (self.save_prompts or self.saved_prompts.save)(instance)
        finally:
            await instance.stop()  # whatever saving met

    # Queries

    def all_instances(self) -> list[Instance]:
        """Every instance, those of removed models still draining included (a node publishes them as
        draining until they stop: gateways keep their requests on them to the end)."""
        return [instance for pool in self.pools.values() for instance in pool.instances] + list(self._retiring)

    def find(self, instance_id: str) -> Instance:
        for instance in self.all_instances():
            if instance.id == instance_id:
                return instance
        raise NotFound(f"No instance with id {instance_id!r}.", param="instance_id")

    def pool(self, name: str) -> ModelPool:
        try:
            return self.pools[name]
        except KeyError:
            raise ModelNotFound(f"The model {name!r} does not exist.", param="model") from None

    def memory_used_mb(self) -> int:
        """What the running and starting instances use, or (while starting) are expected to use."""
        return sum(
            max(i.ram_used_mb, self.estimate_mb(self.pools[i.model.name]) if i.status == Status.STARTING else 0)
            for i in self.all_instances()
            if i.status not in (Status.STOPPED, Status.FAILED)
        )

    def estimate_mb(self, pool: ModelPool) -> int:
        """RAM one more instance of a model will take: the most one of its instances was measured to
        use, else an estimate from its GGUF file and context (catalog.estimate_mb)."""
        measured = max([pool.measured_mb, *(i.ram_used_mb for i in pool.instances)])
        if measured:
            pool.measured_mb = measured
            return measured
        file = self._files.get(pool.name)
        return estimate_mb(pool.config, file) if file is not None else 0

    # Starting, stopping, scaling

    def _next_port(self) -> int:
        port = self.settings.instances.base_port
        while port in self._claimed_ports or not port_is_free(self.settings.instances.host, port):
            port += 1
            if port > 65535:
                raise InstanceStartError("no free port for a new instance")
        self._claimed_ports.add(port)
        return port

    def _new_instance(self, pool: ModelPool) -> Instance:
        """A starting instance, in its pool at once (so that no second start is begun for the same need)."""
        port = self._next_port()
        instance = Instance(
            model=pool.config,
            host=self.settings.instances.host,
            port=port,
            log_path=self.settings.log_dir / f"{pool.name}-{port}.log",
            api_key=self.instance_key,
            ram_cache=self.settings.prompt_cache.isolation == "shared",
            saved_prompts=self.saved_prompts,
        )
        settings = self.settings
        if settings.instances.tls_cert is not None and settings.instances.tls_key is not None and not self._loopback:
            instance.tls_files = (settings.instances.tls_cert, settings.instances.tls_key)
            instance.tls = settings.instances.own_tls()
        pool.instances.append(instance)
        return instance

    async def _add_instance(self, pool: ModelPool, instance: Instance | None = None) -> Instance:
        instance = instance or self._new_instance(pool)
        cold = not pool.ready and pool.queue_depth > 0
        try:
            await self._launch(instance)
        except InstanceStartError as exc:
            self._claimed_ports.discard(instance.port)
            pool.instances.remove(instance)
            pool.blocked = f"its instance failed to start ({exc})"
            raise
        pool.blocked = None
        if pool.shed_when_started and not any(i.status == Status.STARTING for i in pool.instances):
            pool.shed_when_started = False
            self._shed(pool, min_lowered=True)  # min_instances was lowered while it started
        if cold:
            took = time.time() - instance.started_at
            pool.cold_starts += 1
            pool.cold_start_seconds += took
            log.info("cold start of %s: ready in %.1f s for %d waiting requests", pool.name, took, pool.queue_depth)
        pool.dispatch()
        return instance

    async def _launch(self, instance: Instance) -> None:
        assert self._binary is not None
        name, roots = instance.model.name, self.settings.model_file_roots()
        try:
            try:  # checked as opened: the file found before may have been replaced by a link since
                model_file, mmproj = await asyncio.to_thread(
                    opened_within, instance.model, self._files[name], self._mmproj[name], roots
                )
            except ModelFileError as exc:
                raise InstanceStartError(str(exc)) from None
            await instance.start(self._binary, model_file, self.settings.instances.start_timeout, mmproj)
        except InstanceStartError as exc:
            log.error("instance %s (%s) failed to start: %s", instance.id, instance.model.name, exc)
            pool = self.pools.get(instance.model.name)
            if pool is not None:
                pool.last_start_failure = {
                    "at": time.time(), "instance_id": instance.id, "message": str(exc),
                    "log": await asyncio.to_thread(instance.log_tail),
                }  # fmt: skip
            raise
        instance.failure, instance.stalled = None, False

    async def start_instance(self, name: str, node: str | None = None) -> Instance:
        """Start one more instance of a model now (the admin API); raise if it cannot be started."""
        pool = self.pool(name)
        if self.remote is not None:
            return await self.remote.start_instance(name, node, self.settings.instances.start_timeout + 10)
        if node is not None:
            raise InvalidRequest(
                "This server runs its instances itself: `node` is for gateways of role gateway.", param="node"
            )
        if pool.name not in self._files:
            raise UpstreamError(
                f"The model {name!r} cannot be started here: {pool.blocked or 'its files are being found'}."
            )
        if len(pool.live()) >= pool.config.max_instances:
            raise InvalidRequest(
                f"The model {name!r} already runs its max_instances ({pool.config.max_instances}).", param="model"
            )
        try:
            return await self._add_instance(pool)
        except InstanceStartError as exc:
            raise UpstreamError(f"The instance failed to start: {exc}") from None

    def scale_up(self, pool: ModelPool) -> None:
        """Requests are queueing: start one more instance if the limits allow and none is starting,
        stopping the least recently used idle instance of another model if the memory budget needs it."""
        if not self.local or not self._may_autostart(pool) or len(pool.live()) >= pool.config.max_instances:
            return
        estimate = self.estimate_mb(pool)
        if self.memory_used_mb() + estimate > self.memory_budget_mb:
            if self._evict_for(pool, estimate):
                return  # the new instance starts once they have stopped
            pool.blocked = (
                f"the memory budget is full ({self.memory_used_mb()} MiB of {self.memory_budget_mb} MiB in use, "
                f"~{estimate} MiB needed) and no idle instance of another model can be stopped"
            )
            log.warning("not starting a %s instance: %s", pool.name, pool.blocked)
            return
        what = "another instance" if pool.ready else "an instance (cold start)"
        log.info("requests are waiting for %s: starting %s", pool.name, what)
        self._spawn(self._add_quietly(pool, self._new_instance(pool)))

    def _evict_for(self, pool: ModelPool, estimate: int) -> bool:
        """Stop least recently used idle instances of other models until `estimate` MiB fit; False
        (stopping nothing) if that is impossible."""
        idle = sorted(
            (
                i for other in self.pools.values() if other is not pool and not other.queue_depth
                for i in other.instances if i.status == Status.READY and i.in_flight == 0
            ),
            key=lambda i: i.last_activity,
        )  # fmt: skip
        need = self.memory_used_mb() + estimate - self.memory_budget_mb
        chosen: list[Instance] = []
        for instance in idle:
            if need <= 0:
                break
            chosen.append(instance)
            need -= max(instance.ram_used_mb, self.estimate_mb(self.pools[instance.model.name]))
        if need > 0:
            return False
        for instance in chosen:
            log.info(
                "stopping idle instance %s (%s, %d MiB) to make room for %s",
                instance.id, instance.model.name, instance.ram_used_mb, pool.name,
            )  # fmt: skip
            instance.status = Status.DRAINING  # no new requests from here on
            self.pools[instance.model.name].evictions += 1
        # The new instance joins its pool (starting) now, so that the room is not taken meanwhile.
        self._spawn(self._replace(chosen, pool, self._new_instance(pool)))
        return True

    async def _replace(self, evicted: list[Instance], pool: ModelPool, instance: Instance) -> None:
        """Stop the evicted instances, then start the one they made room for."""
        await asyncio.gather(*(self.drain(old, timeout=0) for old in evicted))
        if self._stopping:
            pool.instances.remove(instance)
            return
        await self._add_quietly(pool, instance)

    async def _add_quietly(self, pool: ModelPool, instance: Instance | None = None) -> None:
        """An automatic start (strength or demand): on failure, back off before the next one."""
        try:
            await self._add_instance(pool, instance)
            pool.start_backoff = 0.0
        except InstanceStartError:
            pool.start_backoff = min(self.settings.instances.restart_max_delay * 10, max(1.0, pool.start_backoff * 2))
            pool.next_start_at = time.monotonic() + pool.start_backoff
            log.error("automatic start of a %s instance failed; next try in %.0f s", pool.name, pool.start_backoff)

    def _may_autostart(self, pool: ModelPool) -> bool:
        return (
            not self._stopping
            and pool.name in self._files
            and not pool.rolling.locked()
            and time.monotonic() >= pool.next_start_at
            and not any(i.status == Status.STARTING for i in pool.instances)
        )

    async def drain(self, instance: Instance, timeout: float | None = None, pool: ModelPool | None = None) -> None:
        """No new requests; wait for those in flight up to `timeout`; stop; leave the pool."""
        wait = self.settings.server.drain_timeout if timeout is None else timeout
        if await instance.drained_elsewhere(wait):
            return
        instance.status = Status.DRAINING
        if self.drain_wait is not None:
            await self.drain_wait(instance, wait)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                await instance.idle.wait()
        if instance.in_flight:
            log.warning("instance %s still had %d requests in flight when drained", instance.id, instance.in_flight)
        await self._save_and_stop(instance)
        instance.status = Status.STOPPED
        self._claimed_ports.discard(instance.port)
        pool = pool or self.pools.get(instance.model.name)
        if pool is not None and instance in pool.instances:
            pool.instances.remove(instance)
        log.info("instance %s (%s) drained and stopped", instance.id, instance.model.name)

    async def drain_keeping_min(self, instance: Instance) -> None:
        """An admin's drain: when stopping the instance would leave its model below min_instances, its
        replacement is started first (as a rolling update does, if the memory budget has room) and the
        old one drained once the new one is ready — requests never wait for a cold start, and the old
        one's conversations, saved as it stops, are restored on the new one."""
        pool = self.pools.get(instance.model.name)
        others = [i for i in pool.live() if i is not instance and i.status != Status.DRAINING] if pool else []
        if (
            pool is not None
            and self.local
            and instance in pool.instances
            and instance.status in (Status.READY, Status.BUSY)
            and len(others) < pool.config.min_instances
            and self._may_autostart(pool)
            and self.memory_used_mb() + self.estimate_mb(pool) <= self.memory_budget_mb
        ):
            log.info("instance %s (%s): starting its replacement before draining it (min_instances %d)",
                     instance.id, pool.name, pool.config.min_instances)  # fmt: skip
            try:
                await self._add_instance(pool)
            except InstanceStartError as exc:
                log.warning("instance %s (%s): its replacement failed to start (%s); draining it anyway",
                            instance.id, pool.name, exc)  # fmt: skip
        await self.drain(instance)

    def drain_soon(self, instance: Instance) -> None:
        """Drain `instance` in the background (a stop cancels it with the supervisor's other tasks)."""
        self._spawn(self.drain(instance))

    def _spawn(self, coroutine: object) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coroutine)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # The catalog's changes

    async def apply(self, models: list[ModelConfig]) -> None:
        """The models as the catalog (or, on a node, the scheduler) now has them: a new one gets a pool
        (its min_instances start with the next ticks), a removed one fails its waiting requests with 404
        and drains its instances, a changed one takes the settings that need no restart at once
        (`LIVE_SETTINGS`) and rolls its instances over for the others: one new instance with the new
        settings ready before one old instance is drained, one at a time."""
        wanted = {model.name: model for model in models}
        for name in [name for name in self.pools if name not in wanted]:
            gone = self.pools.pop(name)
            log.info("model %s removed: draining its %d instances", name, len(gone.live()))
            gone.close(ModelNotFound(f"The model {name!r} does not exist.", param="model"))
            for instance in list(gone.instances):
                if instance.status != Status.STOPPED:
                    self._spawn(self._retire(gone, instance))
        for name, model in wanted.items():
            existing = self.pools.get(name)
            if existing is None:
                pool = self.pools[name] = self._new_pool(model)
                self.on_new_pool(pool)
                log.info("model %s added (min_instances %d)", name, model.min_instances)
                if self.local and self._binary is not None:
                    self._spawn(self._find_files(pool))
                continue
            pool = existing
            if restart_settings(pool.config) == restart_settings(model):
                min_lowered = model.min_instances < pool.config.min_instances
                for setting in LIVE_SETTINGS:  # in place: the instances share this object
                    setattr(pool.config, setting, getattr(model, setting))
                self._shed(pool, min_lowered)
                continue
            if model.max_instances == 0:  # stopped as well: nothing to roll over to
                pool.config = model
                self._shed(pool)
                continue
            log.info("model %s changed (%s): rolling its instances over", name,
                     ", ".join(changed_settings(pool.config, model)))  # fmt: skip
            pool.config = model
            if self.local and self._binary is not None:
                self._spawn(self._roll(pool))
        self.lineup.replace(wanted.values())

    async def _find_files(self, pool: ModelPool) -> bool:
        """A model's GGUF files (downloaded if need be); False, with the reason in `pool.blocked`, if they
        cannot be had here."""
        cache, endpoint = self.settings.model_cache_dir, self.settings.hf_endpoint

        def progress(done: int, total: int | None) -> None:
            pool.fetching = {"bytes": done, "total": total}

        try:
            model_file = await asyncio.to_thread(self._model_file, pool.config, progress)
            projector = await asyncio.to_thread(mmproj_path, pool.config, cache, endpoint)
        except ModelFileError as exc:
            self._files.pop(pool.name, None)
            self._mmproj.pop(pool.name, None)
            reason = f"its model file cannot be had here ({exc})"
            if reason != pool.unstartable:  # one line per new reason, not one per retry
                log.error("model %s cannot run: %s; other models are not affected, tried again with backoff",
                          pool.name, exc)  # fmt: skip
            pool.blocked = pool.unstartable = reason
            pool.files_backoff = min(FILES_RETRY_MAX, max(FILES_RETRY_FIRST, pool.files_backoff * 2))
            pool.next_files_at = time.monotonic() + pool.files_backoff
            return False
        finally:
            pool.fetching = None
        # Both at once: an instance may start as soon as its model's file is known (`_may_autostart`), and
        # it needs the projector's too (set one await apart, a start in between failed with a KeyError and
        # left the model with an instance that never started).
        self._files[pool.name], self._mmproj[pool.name] = model_file, projector
        if pool.unstartable is not None:
            log.info("model %s: its files are found now", pool.name)
        pool.blocked = pool.unstartable = None
        pool.files_backoff = 0.0
        return True

    def _model_file(self, model: ModelConfig, progress: Progress) -> Path:
        """The model's GGUF here: its path, its Hugging Face download, or (a node with `node.gateway_url`,
        a path not here) the gateway's copy, fetched."""
        settings = self.settings
        try:
            return model_path(model, settings.model_cache_dir, settings.hf_endpoint, progress=progress)
        except ModelFileError:
            if model.path is None or not settings.node.gateway_url or model.path.expanduser().is_file():
                raise
        return fetch_from_gateway(
            model, settings.node.gateway_url, settings.instances.key, settings.model_cache_dir, progress
        )

    async def _roll(self, pool: ModelPool) -> None:
        """Replace the instances that run older settings than their pool's, one at a time, each after its
        successor is ready: requests never find the model without an instance that serves."""
        async with pool.rolling:
            if not await self._find_files(pool):
                return
            while not self._stopping and self.pools.get(pool.name) is pool:
                old = [i for i in pool.live() if i.model is not pool.config and i.status != Status.DRAINING]
                if not old:
                    return
                try:
                    await self._add_instance(pool)
                except InstanceStartError as exc:
                    log.error("rolling update of %s stopped: a new instance failed to start (%s); the old ones "
                              "keep serving", pool.name, exc)  # fmt: skip
                    return
                retiring = min(old, key=lambda i: (i.in_flight, i.last_activity))
                await self.drain(retiring)
            log.info("rolling update of %s done: every instance runs its new settings", pool.name)

    def _shed(self, pool: ModelPool, min_lowered: bool = False) -> None:
        """After the catalog changed a model's counts: instances beyond a lowered max_instances drain, the
        least busy first (0: all of them, the model stopped); idle ones beyond a lowered min_instances stop
        now rather than after their idle_timeout (busy ones idle out as usual)."""
        live = [i for i in pool.live() if i.status != Status.DRAINING]
        surplus = max(0, len(live) - pool.config.max_instances)
        ordered = sorted(live, key=lambda i: (i.in_flight, i.last_activity))
        for instance in ordered[:surplus]:
            log.info("instance %s (%s): beyond max_instances (%d), draining it", instance.id, pool.name,
                     pool.config.max_instances)  # fmt: skip
            instance.status = Status.DRAINING
            self._spawn(self.drain(instance))
        kept = ordered[surplus:]
        if not min_lowered or pool.queue_depth:
            return
        # One still starting (a roll's replacement, a cold start) is judged once it is up.
        pool.shed_when_started = any(i.status == Status.STARTING for i in kept)
        idle = [i for i in kept if i.status == Status.READY and i.in_flight == 0 and i.keep_until < time.time()]
        for instance in idle[: max(0, len(kept) - pool.config.min_instances)]:
            log.info("instance %s (%s): idle beyond min_instances (%d), stopping it", instance.id, pool.name,
                     pool.config.min_instances)  # fmt: skip
            instance.status = Status.DRAINING
            self._spawn(self.drain(instance, timeout=0))

    async def _retire(self, pool: ModelPool, instance: Instance) -> None:
        """Drain an instance of a pool that is no longer served."""
        instance.status = Status.DRAINING
        self._retiring.add(instance)
        try:
            await self.drain(instance, pool=pool)
        finally:
            self._retiring.discard(instance)
        if self.saved_prompts is not None and pool.name not in self.pools and not self.models_move:
            await asyncio.to_thread(self.saved_prompts.forget, pool.name)

    # The loop

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval)
            try:
                await self.tick()
            except Exception:
                log.exception("supervisor tick failed")

    async def tick(self) -> None:
        now = time.monotonic()
        probe = now - self._last_probe >= self.settings.instances.health_interval
        if probe:
            self._last_probe = now
        # RAM and CPU of each process (a few /proc reads): every SAMPLE_EVERY s, not every tick.
        sample = now - self._last_sample >= SAMPLE_EVERY
        if sample:
            self._last_sample = now
        for pool in self.pools.values():
            for instance in list(pool.instances):
                if instance.accepting and instance.exited:
                    assert instance.process is not None
                    self.crashed(instance, f"pid {instance.pid} died with code {instance.process.returncode}")
                    continue
                # One that answered a request within the last probe interval is alive and making progress
                # (an answer, or a stream's first token, comes from llama-server's main loop): neither probe.
                # The others get both, idle ones too: a request whose client left can leave the main loop
                # busy (a grammar that explodes) with nothing in flight, and the next key's request would
                # wait its queue out.
                quiet = probe and now - instance.answered_at >= self.settings.instances.health_interval
                if instance.accepting and quiet:
                    self._spawn(self._probe(instance))
                    if instance.id not in self._progress_probes:
                        self._progress_probes.add(instance.id)
                        self._spawn(self._progress(instance))
                if instance.accepting and sample:
                    instance.sample()
            if self.local and pool.name not in self._files and pool.unstartable and now >= pool.next_files_at:
                pool.next_files_at = float("inf")  # one search at a time: _find_files sets the next
                self._spawn(self._find_files(pool))
            self._keep_strength(pool)
            self._reap_idle(pool)
            if pool.queue_depth and not any(i.accepting or i.status == Status.STARTING for i in pool.instances):
                self.scale_up(pool)  # waiting for memory to free up, or after a failed start's backoff

    def unreachable(self, instance: Instance) -> None:
        """A request could not reach an instance: if its process is gone, take it out of service now
        rather than at the next tick; a node's instance counts toward its circuit breaker."""
        if (reason := instance.unreachable()) is not None:
            self.crashed(instance, reason)

    def stall_bound(self, model: str, grammar: bool = False) -> float:
        """Seconds an instance with requests in flight may leave /slots unanswered: instance_stall_timeout
        (grammar_stall_timeout while a request on it carries a grammar: what holds a main loop for minutes),
        or a hundred tokens' time at the model's measured speed if longer (a 2,048-token prompt batch,
        read some twenty times faster than tokens are generated, holds the loop about that long)."""
        rate = self.speed_of(model)
        instances = self.settings.instances
        floor = min(instances.stall_timeout, instances.grammar_stall_timeout) if grammar else instances.stall_timeout
        return max(floor, 100 / rate) if rate else floor

    async def _progress(self, instance: Instance) -> None:
        """The watchdog: an instance that answers /health but whose main loop answers nothing else
        while requests are on it makes no progress, and never will by itself (one request's grammar
        held one for over eleven minutes): its requests fail, and it is restarted."""
        try:
            instances = self.settings.instances
            suspects = instance.grammar_suspects(instances.stall_timeout + instances.health_interval)
            bound = self.stall_bound(instance.model.name, bool(suspects))
            # Not reached at all (killed, say) is not a stall: its exit or its missed health probes take it
            # out, and its requests are sent again; a stall's would end with 504.
            if await instance.answers_slots(bound) is not False or not instance.accepting:
                return
            # Whose request it was: those carrying a grammar (what holds a main loop), else all in flight, else
            # the last one's (its client may have left). The others' requests are sent again. Read again now:
            # a node learns of a gateway's grammar with its load, within a second of the request.
            suspects = instance.grammar_suspects(instances.stall_timeout + instances.health_interval)
            blamed = suspects or sorted(instance.users) or ([instance.last_key] if instance.last_key else [])
            instance.blamed = frozenset(suspects)
            if (pool := self.pools.get(instance.model.name)) is not None:
                pool.stalls += 1
                pool.stalls_by_key.update(blamed)
            instance.stalled = True
            flight = f"{instance.in_flight} requests in flight" if instance.in_flight else "no request in flight"
            log.warning(
                "instance %s of %s made no progress for %.0f s with %s; key(s) %s sent what it was working on",
                instance.id, instance.model.name, bound, flight, ", ".join(blamed) or "unknown",
            )  # fmt: skip
            if self.on_stall is not None:  # before the process goes: its gateways then know why
                try:
                    async with asyncio.timeout(1.0):
                        await self.on_stall(instance, bound)
                except Exception as exc:  # Redis unreachable: the restart does not wait for it
                    log.debug("the stall of instance %s was not published: %s", instance.id, exc)
            self.crashed(instance, f"made no progress for {bound:.0f} s with {flight}")
        finally:
            self._progress_probes.discard(instance.id)

    def crashed(self, instance: Instance, why: str) -> None:
        """Take a dead or hung instance out of service and restart it, or give it up."""
        if instance.restarting or instance.status in (Status.STOPPED, Status.DRAINING, Status.FAILED):
            return
        instance.status = Status.FAILED
        instance.failure = why
        if (pool := self.pools.get(instance.model.name)) is not None:
            pool.crashes += 1
        if self._give_up(instance, why):
            self._spawn(instance.stop(grace=1.0))
            return
        log.error("instance %s (%s) %s; restarting it", instance.id, instance.model.name, why)
        instance.restarting = True
        self._spawn(
            self._restart(
                instance, delay=min(self.settings.instances.restart_max_delay, 0.5 * 2 ** (len(instance.crashes) - 1))
            )
        )

    def _give_up(self, instance: Instance, why: str) -> bool:
        """Count a failure; True (and say so in the log) once there are too many within the window:
        then the instance is given up for `restart_window`, and tried again after it."""
        now = time.monotonic()
        instance.crashes.append(now)
        while instance.crashes and instance.crashes[0] < now - self.settings.instances.restart_window:
            instance.crashes.popleft()
        failures = len(instance.crashes)
        if failures < self.settings.instances.restart_max_failures:
            return False
        log.error(
            "instance %s (%s) %s; giving up on it after %d failures within %.0f s (see %s)",
            instance.id, instance.model.name, why, failures, self.settings.instances.restart_window, instance.log_path,
        )  # fmt: skip
        self._spawn(self._retry_later(instance))
        return True

    async def _restart(self, instance: Instance, delay: float) -> None:
        try:
            while not self._stopping:
                await instance.stop(grace=1.0)
                instance.status = Status.FAILED
                await asyncio.sleep(delay)
                try:
                    await self._launch(instance)
                    if (pool := self.pools.get(instance.model.name)) is not None:
                        pool.dispatch()
                    return
                except InstanceStartError:
                    instance.status = Status.FAILED
                    if self._give_up(instance, "failed to restart"):
                        return
                    delay = min(self.settings.instances.restart_max_delay, delay * 2)
                    log.error("restart of instance %s failed; next try in %.1f s", instance.id, delay)
        finally:
            instance.restarting = False

    async def _retry_later(self, instance: Instance) -> None:
        """A given-up instance, tried again once `restart_window` has passed, its crash count afresh."""
        await asyncio.sleep(self.settings.instances.restart_window)
        if self._stopping or instance.status != Status.FAILED or instance.restarting:
            return
        pool = self.pools.get(instance.model.name)
        if pool is None or instance not in pool.instances:
            return
        log.warning("instance %s (%s): trying again after %.0f s given up", instance.id, instance.model.name,
                    self.settings.instances.restart_window)  # fmt: skip
        instance.crashes.clear()
        instance.restarting = True
        await self._restart(instance, delay=0.0)

    async def _probe(self, instance: Instance) -> None:
        if await instance.probe():
            self._probe_misses.pop(instance.id, None)
            return
        if not instance.accepting:
            return
        misses = self._probe_misses.get(instance.id, 0) + 1
        self._probe_misses[instance.id] = misses
        log.warning("instance %s missed a health probe (%d in a row)", instance.id, misses)
        if misses >= self.settings.instances.health_probe_misses:
            self._probe_misses.pop(instance.id, None)
            self.crashed(instance, f"did not answer {misses} health probes in a row")

    def _keep_strength(self, pool: ModelPool) -> None:
        """Back up to min_instances, while the memory budget has room (an instance evicted for another
        model comes back when that one has gone idle)."""
        if pool.config.min_instances <= len(pool.live()) or not self._may_autostart(pool):
            return
        if self.memory_used_mb() + self.estimate_mb(pool) > self.memory_budget_mb:
            return
        log.info("%s has fewer than min_instances (%d): starting one", pool.name, pool.config.min_instances)
        self._spawn(self._add_quietly(pool, self._new_instance(pool)))

    def _reap_idle(self, pool: ModelPool) -> None:
        idle_since = time.time() - pool.config.idle_timeout
        ready = [i for i in pool.instances if i.status == Status.READY]
        if len(pool.live()) <= pool.config.min_instances or pool.queue_depth:
            return
        now = time.time()
        idle = [i for i in ready if i.in_flight == 0 and i.last_activity < idle_since and i.keep_until < now]
        if idle:
            instance = min(idle, key=lambda i: i.last_activity)
            log.info("instance %s (%s) idle for %.0f s: stopping it", instance.id, pool.name, pool.config.idle_timeout)
            instance.status = Status.DRAINING
            self._spawn(self.drain(instance, timeout=0))


# Settings a running instance takes without a restart (the gateway and supervisor read them).
LIVE_SETTINGS = ("min_instances", "max_instances", "idle_timeout", "max_queue", "prices")


def restart_settings(model: ModelConfig) -> dict[str, object]:
    """What an instance was started with: a change to any of these rolls the model's instances over."""
    fields = model.model_dump(mode="json", exclude=set(LIVE_SETTINGS))
    if model._threads_computed or model.threads is None:
        fields.pop("threads")  # shared out (anew whenever the catalog changes), not configured
    return fields


def changed_settings(old: ModelConfig, new: ModelConfig) -> list[str]:
    before, after = old.model_dump(mode="json"), new.model_dump(mode="json")
    return sorted(key for key in before if before[key] != after[key])
