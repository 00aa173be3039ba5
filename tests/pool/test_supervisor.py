"""The supervisor's decisions, on instances whose processes are real (`sleep`, alive or dead) but are
not llama-server: when an instance is taken out of service, restarted, or given up."""

from __future__ import annotations

import asyncio
import http.server
import logging
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from llmserver.llama.client import LlamaServerClient
from llmserver.pool.instance import Instance, Status
from llmserver.pool.supervisor import Supervisor
from llmserver.settings import ModelConfig, Settings
from tests.support import free_port


@asynccontextmanager
async def supervised(alive: bool, **instances: object) -> AsyncIterator[tuple[Supervisor, Instance]]:
    """A supervisor of one instance of model m, its [instances] settings `instances`."""
    supervisor = Supervisor(Settings(models=[ModelConfig(name="m")], instances=instances))  # type: ignore[arg-type]
    pool = supervisor.pools["m"]
    instance = Instance(model=pool.config, host="127.0.0.1", port=free_port(), log_path=supervisor.settings.log_dir)
    instance.process = subprocess.Popen(["sleep", "30" if alive else "0"])  # noqa: ASYNC220
    if not alive:
        instance.process.wait()
    client = instance.client = LlamaServerClient(instance.base_url)  # nothing listens there
    instance.status = Status.READY
    pool.instances.append(instance)
    try:
        yield supervisor, instance
    finally:
        await supervisor.stop()
        await client.close()


@asynccontextmanager
async def ticking(supervisor: Supervisor, every: float) -> AsyncIterator[None]:
    """The supervisor's loop, every `every` seconds, while the block runs."""

    async def ticks() -> None:
        while True:
            await supervisor.tick()
            await asyncio.sleep(every)

    task = asyncio.create_task(ticks())
    try:
        yield
    finally:
        task.cancel()


async def until(condition: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return True
        await asyncio.sleep(0.02)
    return False


def test_an_unreachable_instance_is_taken_out_only_when_its_process_died() -> None:
    async def scenario() -> None:
        async with supervised(alive=True) as (supervisor, instance):
            supervisor.pools["m"].report_failure(instance)  # a dropped connection, the process is fine
            assert instance.status == Status.READY and not instance.restarting
        async with supervised(alive=False) as (supervisor, instance):
            supervisor.pools["m"].report_failure(instance)
            assert instance.status == Status.FAILED and instance.restarting  # a restart is on its way

    asyncio.run(scenario())


def test_crashes_within_the_window_are_given_up_at_the_limit() -> None:
    async def scenario() -> None:
        async with supervised(alive=False, restart_max_failures=2, restart_window=60) as (supervisor, instance):
            supervisor.crashed(instance, "died")
            assert instance.restarting and len(instance.crashes) == 1
            instance.restarting, instance.status = False, Status.READY  # as if the restart had worked
            supervisor.crashed(instance, "died again")
            assert instance.status == Status.FAILED and not instance.restarting and len(instance.crashes) == 2
            supervisor.crashed(instance, "and again")  # a given-up instance is left alone
            assert len(instance.crashes) == 2

    asyncio.run(scenario())


def test_a_given_up_instance_is_tried_again_after_the_window(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with supervised(alive=False, restart_max_failures=1, restart_window=0.3) as (supervisor, instance):
            # A binary that exits at once: every launch fails for real.
            supervisor._binary, supervisor._files["m"], supervisor._mmproj["m"] = Path("/bin/false"), Path("x"), None
            instance.log_path = tmp_path / "instance.log"
            supervisor.crashed(instance, "died")
            assert instance.status == Status.FAILED and not instance.restarting  # given up, for the window
            # After restart_window it is launched again with a fresh crash count (and given up again
            # when that launch fails too, and tried again after the next window).
            assert await until(lambda: caplog.text.count("trying again after") >= 2, timeout=20)
            assert "failed to start" in caplog.text and len(instance.crashes) <= 1

    with caplog.at_level(logging.WARNING, logger="llmserver.pool.supervisor"):
        asyncio.run(scenario())


def test_missed_health_probes_in_a_row_count_as_a_crash() -> None:
    async def scenario() -> None:
        options = {"health_interval": 0.01, "health_probe_misses": 2, "restart_max_failures": 1}
        async with supervised(alive=True, **options) as (supervisor, instance):
            async with ticking(supervisor, every=0.02):
                assert await until(lambda: instance.status == Status.FAILED)
            assert len(instance.crashes) == 1  # one crash, counted after two missed probes
            assert await until(lambda: instance.exited)  # the hung process was stopped

    asyncio.run(scenario())


def test_an_instance_that_answers_requests_is_not_probed() -> None:
    """Traffic proves an instance alive: one that answered within `health_interval` is not probed
    (here the probe would fail: nothing listens at its address); once the answers stop, it is."""

    async def scenario() -> None:
        options = {"health_interval": 0.2, "health_probe_misses": 1, "restart_max_failures": 1}
        async with supervised(alive=True, **options) as (supervisor, instance):
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:  # answering a request every 50 ms
                instance.answered_at = time.monotonic()
                await supervisor.tick()
                await asyncio.sleep(0.05)
            assert instance.status == Status.READY and not instance.crashes
            async with ticking(supervisor, every=0.05):
                assert await until(lambda: instance.status == Status.FAILED, timeout=5)  # no answers: probed

    asyncio.run(scenario())


def test_an_instance_answering_with_requests_in_flight_is_not_polled_by_the_watchdog() -> None:
    """An answer (or a stream's first token) comes from llama-server's main loop, so an instance that
    answered within `health_interval` is making progress: the watchdog does not poll its /slots, even
    with requests in flight (under steady load it polled every interval; and llama-server checks its
    clients' disconnects less while it answers /slots). Once the answers stop, the watchdog polls: here
    the port takes the request and never answers, so that is a stall."""

    async def scenario() -> None:
        options = {"health_interval": 0.2, "health_probe_misses": 100, "stall_timeout": 0.3}
        async with supervised(alive=True, **options) as (supervisor, instance):
            silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
            silent.bind(("127.0.0.1", instance.port))
            silent.listen(8)
            try:
                instance.in_flight = 2
                deadline = time.monotonic() + 1.5
                while time.monotonic() < deadline:  # answering a request every 50 ms
                    instance.answered_at = time.monotonic()
                    await supervisor.tick()
                    await asyncio.sleep(0.05)
                assert not instance.stalled and instance.status == Status.READY
                async with ticking(supervisor, every=0.05):
                    assert await until(lambda: instance.stalled, timeout=5)  # no answers: polled, a stall
                assert supervisor.pools["m"].stalls == 1
            finally:
                silent.close()

    asyncio.run(scenario())


def test_a_probe_is_timed_outside_the_event_loop_so_a_stalled_loop_does_not_fail_it() -> None:
    """The instance answers its /health in 0.3 s, within the probe's 0.5 s, while the gateway's event
    loop is stalled for 1.5 s (as 48 MB headers once stalled it): the probe still counts as answered.
    Timed on the loop, it was a miss, and misses in a row killed a healthy instance."""

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            time.sleep(0.3)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def scenario() -> bool:
        instance = Instance(model=ModelConfig(name="m"), host="127.0.0.1", port=server.server_port, log_path=Path("x"))
        instance.process = subprocess.Popen(["sleep", "30"])  # noqa: ASYNC220
        client = instance.client = LlamaServerClient(instance.base_url)
        try:
            probing = asyncio.create_task(instance.probe(timeout=0.5))
            await asyncio.sleep(0.05)  # the probe is under way
            time.sleep(1.5)  # noqa: ASYNC251 (the stall is the point)
            return await probing
        finally:
            instance.process.kill()
            instance.process.wait()
            await client.close()

    try:
        assert asyncio.run(scenario()) is True
    finally:
        server.shutdown()
        server.server_close()


def test_a_changed_max_instances_drains_only_the_surplus() -> None:
    """The catalog's live settings (Supervisor.apply): a higher max_instances drains nothing; a lower one
    drains the least busy instances beyond it, and only those."""

    async def run() -> None:
        async with supervised(alive=True) as (supervisor, first):
            pool = supervisor.pools["m"]
            second = Instance(model=pool.config, host="127.0.0.1", port=free_port(), log_path=first.log_path)
            third = Instance(model=pool.config, host="127.0.0.1", port=free_port(), log_path=first.log_path)
            for extra in (second, third):
                extra.status = Status.READY
                pool.instances.append(extra)
            first.in_flight = 2
            second.in_flight = 1
            await supervisor.apply([ModelConfig(name="m", max_instances=5, min_instances=1)])
            assert [i.status for i in pool.instances] == [Status.READY] * 3
            assert pool.config.max_instances == 5 and pool.config is first.model  # in place: no rollover
            await supervisor.apply([ModelConfig(name="m", max_instances=2)])
            assert [i.status for i in pool.instances] == [Status.READY, Status.READY, Status.DRAINING]

    asyncio.run(run())


def test_a_catalog_change_replaces_the_lineup_and_leaves_the_settings_as_loaded(tmp_path: Path) -> None:
    """The models served are the lineup's (models/lineup.py): a change from the catalog adds, removes and
    changes them there; the settings keep what was configured, and refuse to be changed at all."""
    from pydantic import ValidationError

    from llmserver.models.lineup import Lineup

    async def scenario() -> None:
        settings = Settings(models=[ModelConfig(name="a"), ModelConfig(name="b")], data_dir=tmp_path)
        lineup = Lineup(settings.models)
        supervisor = Supervisor(settings, lineup)
        assert sorted(supervisor.pools) == ["a", "b"]
        await supervisor.apply([ModelConfig(name="b", max_queue=7), ModelConfig(name="c")])
        assert [m.name for m in lineup] == ["b", "c"]
        assert lineup.get("b") is not None and lineup.get("b").max_queue == 7  # type: ignore[union-attr]
        assert sorted(supervisor.pools) == ["b", "c"]
        assert [m.name for m in settings.models] == ["a", "b"]
        with pytest.raises(ValidationError, match="frozen"):
            settings.models = []  # type: ignore[misc]
        await supervisor.stop()

    asyncio.run(scenario())


def test_an_instance_that_cannot_be_reached_is_not_a_stall_but_one_that_does_not_answer_is() -> None:
    """The watchdog's /slots probe (Supervisor._progress): refused (a process killed under its requests:
    nothing listens on its port) says nothing of progress, so its requests are not ended with the stall's
    504 — they are sent again once its exit or its missed health probes take it out. A CI run found the
    probe of a just-killed instance refused at once, reported as "no progress for 60 s", and two of its
    requests lost. A port that takes the request and never answers within the bound is a stall."""

    async def scenario(listening: bool) -> tuple[bool, int, Status]:
        async with supervised(alive=True, stall_timeout=0.5) as (supervisor, instance):
            silent = None
            if listening:  # accepts connections (the kernel's backlog) and never answers
                silent = socket.socket()
                silent.bind(("127.0.0.1", instance.port))
                silent.listen(8)
            try:
                instance.in_flight = 1
                await supervisor._progress(instance)
                return instance.stalled, supervisor.pools["m"].stalls, instance.status
            finally:
                if silent is not None:
                    silent.close()

    assert asyncio.run(scenario(listening=False)) == (False, 0, Status.READY)
    stalled, stalls, status = asyncio.run(scenario(listening=True))
    assert stalled and stalls == 1 and status == Status.FAILED
