"""A node's side of the scheduler (cluster/scheduler.py): it runs what it is assigned, and says what it can run.

A node started with no [[models]] in its config takes assignments. Every second it reads its
assignment (`llmserver:assign:NODE`) and hands the models in it to its supervisor, each kept at its
assigned count (`Supervisor.apply`: a new model starts, a lower count drains the least busy instances,
a new revision of a model's settings rolls its instances over one at a time). It also checks every
model of the catalog the scheduler last published (`llmserver:schedule`) once per revision — whether
its GGUF file is here, and what an instance would take (catalog.estimate_mb) — and publishes the
results in its node record with its labels, so that the scheduler places nothing where it cannot run.
A model whose instance fails to start here is reported the same way, and placed elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from llmserver import gpu
from llmserver.cluster.records import ASSIGN_KEY, STATUS_KEY
from llmserver.models.files import ModelFileError, estimate_gpu_mb, estimate_mb, mmproj_path, model_path
from llmserver.outage import redis_unreachable
from llmserver.pool.instance import Instance, Status
from llmserver.settings import ModelConfig, Settings, share_threads

if TYPE_CHECKING:
    import redis.asyncio

    from llmserver.pool.supervisor import Supervisor

log = logging.getLogger("llmserver.pool.assignments")  # its name before the move: log_levels name it

READ_EVERY = 1.0


class Assignments:
    def __init__(self, client: redis.asyncio.Redis, supervisor: Supervisor, settings: Settings, node_id: str) -> None:
        self._redis = client
        self._supervisor = supervisor
        self._settings = settings
        self._key = ASSIGN_KEY + node_id
        self.checks: dict[str, dict[str, Any]] = {}  # model → {revision, estimate_mb | unavailable}
        self.gpus = gpu.detect()
        self.gpu_budget_mb = gpu.budget_mb(self.gpus, settings.instances.gpu_memory_budget_mb)
        if self.gpus:
            found = ", ".join(f"{g.name} ({g.memory_total_mb} MiB)" for g in self.gpus)
            log.info("GPUs: %s; %d MiB of their memory for instances", found, self.gpu_budget_mb)
        self._applied: bytes | str | None = None  # the assignment last applied, as read
        self._revisions: dict[str, int] = {}
        # Instances an admin drained here (DELETE /api/instances/ID), per model, until the scheduler's assignment
        # takes them into its count ({"count_was": the count then, "n": how many, "move": 1}): they serve until
        # then (their replacements start first where the model needs them), and drain as the count drops.
        self.released: dict[str, dict[str, int]] = {}
        self._leaving: dict[str, set[str]] = {}  # per model, the ids of those instances
        self._counts: dict[str, int] = {}  # per model, the count last assigned

    def record(self) -> dict[str, Any]:
        """What the node's record carries for the scheduler."""
        return {
            "scheduled": True, "labels": self._settings.node.labels, "checks": self.checks,
            "gpus": [g.record() for g in self.gpus], "gpu_budget_mb": self.gpu_budget_mb,
            "released": self.released,
        }  # fmt: skip

    def release(self, name: str, instance_id: str) -> None:
        """An admin drains instance `instance_id` of `name` here: the scheduler lowers this node's count and
        places its replacement elsewhere when it can — once the replacement is up when the model needs the
        instance (`min_instances`), at once when it does not (cluster/scheduler.py, rule 6). It serves until
        then, and drains when `step` sees the count drop (never another instance of the model in its place)."""
        given = self._counts.get(name, 0)
        held = self.released.get(name)
        kept = held["n"] if held is not None and held["count_was"] == given else 0
        self.released[name] = {"count_was": given, "n": min(given, kept + 1), "move": 1}
        self._leaving[name] = (self._leaving.get(name, set()) if kept else set()) | {instance_id}

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except redis_unreachable():
                pass  # the publisher logs the outage; the instances run on as assigned
            except Exception:
                log.exception("assignments")
            await asyncio.sleep(READ_EVERY)

    async def step(self) -> None:
        assignment, status = await self._redis.mget([self._key, STATUS_KEY])
        if status:
            await self._check(json.loads(status).get("catalog") or {})
        self._note_failures()
        if assignment == self._applied:
            return
        assigned = json.loads(assignment)["models"] if assignment else {}
        self._counts = {name: int(given["count"]) for name, given in assigned.items()}
        leaving: list[Instance] = []
        for name in list(self.released):  # the scheduler took a release into its count: it is done
            if self.released[name]["count_was"] != self._counts.get(name, 0):
                del self.released[name]
                for instance_id in self._leaving.pop(name, set()):
                    instance = next((i for i in self._supervisor.all_instances() if i.id == instance_id), None)
                    if instance is not None and instance.status in (Status.READY, Status.BUSY):
                        instance.status = Status.DRAINING  # before the count drops: no other one goes in its place
                        leaving.append(instance)
        models: list[ModelConfig] = []
        for name, given in assigned.items():
            count = int(given["count"])  # what an admin drained here serves on until the scheduler lowers it
            try:
                model = ModelConfig.model_validate(
                    {**given["config"], "min_instances": count, "max_instances": max(1, count)}
                )
            except ValidationError as exc:
                self._unavailable(name, int(given["revision"]), f"its settings are not valid here: {exc}")
                continue
            models.append(model)
        share_threads(models)
        counts = ", ".join(f"{m.name} {m.min_instances}" for m in models) or "nothing"
        log.info("assigned: %s", counts)
        await self._supervisor.apply(models)
        for instance in leaving:  # those of a model that left this node altogether drain with it (apply)
            if instance.model.name in self._supervisor.pools:
                self._supervisor.drain_soon(instance)
        self._applied = assignment
        self._revisions = {name: int(given["revision"]) for name, given in assigned.items()}

    async def _check(self, catalog: dict[str, dict[str, Any]]) -> None:
        """Each catalog model checked here once per revision: its file, and an instance's estimated size."""
        for name in list(self.checks):
            if name not in catalog:
                del self.checks[name]
                saved = self._supervisor.saved_prompts
                if saved is not None and name not in self._supervisor.pools:  # gone from the cluster: its
                    await asyncio.to_thread(saved.forget, name)  # conversations kept here go with it
        for name, entry in catalog.items():
            revision = int(entry["revision"])
            if self.checks.get(name, {}).get("revision") == revision:
                continue
            self.checks[name] = await asyncio.to_thread(self._check_one, name, entry["config"], revision)

    def _check_one(self, name: str, config: dict[str, Any], revision: int) -> dict[str, Any]:
        settings = self._settings
        try:
            model = ModelConfig.model_validate(config)
        except ValidationError as exc:
            return {"revision": revision, "unavailable": f"its settings are not valid here: {exc}"}
        try:
            path = model_path(model, settings.model_cache_dir, settings.hf_endpoint, download=False)
            mmproj_path(model, settings.model_cache_dir, settings.hf_endpoint, download=False)
        except ModelFileError as exc:
            if model.hf_repo is not None or model.path is None:
                return {"revision": revision}  # not downloaded (installed) yet: fetched when an instance starts
            if settings.node.gateway_url:
                return {"revision": revision}  # not here: fetched from the gateway when an instance starts
            return {"revision": revision, "unavailable": str(exc)}
        return {
            "revision": revision, "held": True,  # its file is here: placement prefers this node
            "estimate_mb": estimate_mb(model, path), "gpu_mb": estimate_gpu_mb(model, path),
        }  # fmt: skip

    def _note_failures(self) -> None:
        """A model whose instances cannot start here (its file, a failing start) is reported, so that the
        scheduler places it elsewhere."""
        for name, pool in self._supervisor.pools.items():
            revision = self._revisions.get(name)
            why = pool.unstartable or (pool.blocked if pool.start_backoff and not pool.ready else None)
            if why and revision is not None and not self.checks.get(name, {}).get("unavailable"):
                self._unavailable(name, revision, why)

    def _unavailable(self, name: str, revision: int, why: str) -> None:
        log.warning("model %s (revision %d) cannot run here: %s", name, revision, why)
        self.checks[name] = {"revision": revision, "unavailable": why}
