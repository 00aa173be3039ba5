"""The supervisor: starts every configured model's instances, watches them, replaces the dead.

A small loop: every `check_interval` seconds each live instance must still be running; a crashed
one is marked failed and restarted in its place with exponential backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from llmserver.catalog import llama_server_binary, model_path
from llmserver.pool.instance import Instance, InstanceStartError, Status, port_is_free
from llmserver.settings import ModelConfig, Settings

log = logging.getLogger(__name__)

MAX_RESTART_DELAY = 30.0


class Supervisor:
    def __init__(self, settings: Settings, *, check_interval: float = 0.5) -> None:
        self.settings = settings
        self.check_interval = check_interval
        self.instances: dict[str, list[Instance]] = {m.name: [] for m in settings.models}
        self._binary: Path | None = None
        self._files: dict[str, Path] = {}
        self._claimed_ports: set[int] = set()
        self._watch_task: asyncio.Task[None] | None = None
        self._restarts: set[asyncio.Task[None]] = set()
        self._stopping = False

    async def start(self) -> None:
        """Start all instances and wait for them; raise if any cannot start."""
        self._binary = llama_server_binary(self.settings.llama_server_path)
        self._files = {m.name: model_path(m) for m in self.settings.models}
        starts = [self._start_new(model) for model in self.settings.models for _ in range(model.instances)]
        results = await asyncio.gather(*starts, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.stop()
            raise errors[0]
        self._watch_task = asyncio.create_task(self._watch(), name="supervisor-watch")

    async def stop(self) -> None:
        self._stopping = True
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        for task in list(self._restarts):
            task.cancel()
        await asyncio.gather(*(i.stop() for i in self.all_instances()), return_exceptions=True)
        log.info("all instances stopped")

    def all_instances(self) -> list[Instance]:
        return [instance for group in self.instances.values() for instance in group]

    def find(self, instance_id: str) -> Instance | None:
        return next((i for i in self.all_instances() if i.id == instance_id), None)

    def model_ready(self, name: str) -> bool:
        return any(i.accepting for i in self.instances.get(name, []))

    def _next_port(self) -> int:
        port = self.settings.instance_base_port
        while port in self._claimed_ports or not port_is_free(self.settings.instance_host, port):
            port += 1
            if port > 65535:
                raise InstanceStartError("no free port for a new instance")
        self._claimed_ports.add(port)
        return port

    async def _start_new(self, model: ModelConfig) -> Instance:
        port = self._next_port()
        instance = Instance(
            model=model,
            host=self.settings.instance_host,
            port=port,
            log_path=self.settings.log_dir / f"{model.name}-{port}.log",
        )
        self.instances[model.name].append(instance)
        await self._launch(instance)
        return instance

    async def _launch(self, instance: Instance) -> None:
        assert self._binary is not None
        try:
            await instance.start(self._binary, self._files[instance.model.name], self.settings.instance_start_timeout)
        except InstanceStartError:
            log.error("instance %s (%s) failed to start", instance.id, instance.model.name)
            raise

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval)
            for instance in self.all_instances():
                if instance.accepting and instance.exited:
                    assert instance.process is not None
                    log.error(
                        "instance %s (%s) pid %s died with code %s; restarting it",
                        instance.id, instance.model.name, instance.pid, instance.process.returncode,
                    )  # fmt: skip
                    instance.status = Status.FAILED
                    instance.failures += 1
                    task = asyncio.create_task(self._restart(instance))
                    self._restarts.add(task)
                    task.add_done_callback(self._restarts.discard)

    async def _restart(self, instance: Instance) -> None:
        delay = min(MAX_RESTART_DELAY, 0.5 * 2 ** (instance.failures - 1))
        while not self._stopping:
            await instance.stop(grace=1.0)
            instance.status = Status.FAILED
            await asyncio.sleep(delay)
            try:
                await self._launch(instance)
                return
            except InstanceStartError:
                instance.failures += 1
                delay = min(MAX_RESTART_DELAY, delay * 2)
                log.error("restart of instance %s failed; next try in %.1f s", instance.id, delay)
