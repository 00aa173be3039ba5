"""One llama-server process: how it is started, probed and stopped, and its live state."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import logging
import os
import re
import secrets
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

import psutil

from llmserver.errors import APIError
from llmserver.llama.client import LlamaServerClient
from llmserver.llama.template import Template
from llmserver.llama.wire import Untrusted
from llmserver.models.files import gguf_pooling
from llmserver.pool.saved_prompts import SavedPrompts
from llmserver.pool.slot_gate import SlotGate
from llmserver.settings import ModelConfig

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# A conversation rendered with thinking on and off: a template that thinks renders it otherwise.
THINKING_PROBE = {"messages": [{"role": "user", "content": "1+1?"}]}
PROBE_TIMEOUT = 2.0  # seconds for a health probe's connect, and again for its answer


class Status(StrEnum):
    STARTING = "starting"
    READY = "ready"
    BUSY = "busy"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


LOG_TAIL_BYTES = 256 * 1024  # the most of an instance's log file read for its last lines
# What may be a secret in a line of llama-server's log: the value of an Authorization header (after its
# scheme), of `Bearer`, of an api key or a token given as a flag, a header or a JSON field (`--api-key=…`,
# `"api_key": "…"`, `--hf-token …`), and anything shaped like this server's keys or a Hugging Face token.
SECRET_SHAPES = re.compile(
    r"(?i)((?:authorization[\"']?\s*[:=]\s*[\"']?(?:bearer\s+|basic\s+)?|bearer\s+"
    r"|(?:api[_-]?key|[a-z]*[_-]token)[\"']?[\s=:]+[\"']?))[^\s\"',]+"
    r"|llms-[A-Za-z0-9_-]{16,}|hf_[A-Za-z0-9]{16,}"
)


def redact_log_line(line: str, key: str | None = None) -> str:
    """A log line with the instance key and whatever looks like a key or token replaced by `***`."""
    if key:
        line = line.replace(key, "***")
    return SECRET_SHAPES.sub(lambda m: (m.group(1) or "") + "***", line)


class InstanceStartError(RuntimeError):
    pass


def on_parent_death(sig: signal.Signals) -> Callable[[], None]:
    """A `preexec_fn` after which the kernel sends the child `sig` when the thread that spawned it
    ends (the parent killed outright included): no orphans."""

    def arm() -> None:  # pragma: no cover - runs in the child between fork and exec
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))

    return arm


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def embedding_pooling(model_file: Path) -> str:
    """The pooling an embedding model's instances use when `pooling` is not set: the GGUF's own, else mean."""
    declared = gguf_pooling(model_file)
    if declared in (None, "none"):
        log.info("%s declares no pooling for embeddings: using mean (set pooling to choose)", model_file.name)
        return "mean"
    return str(declared)


def llama_server_args(
    binary: Path,
    model_file: Path,
    model: ModelConfig,
    host: str,
    port: int,
    mmproj: Path | None = None,
    tls_files: tuple[Path, Path] | None = None,
    ram_cache: bool = True,
) -> list[str]:
    vision = ["--mmproj", str(mmproj)] if mmproj is not None else []
    # An input is embedded in one batch: let a batch hold a whole context.
    embedding = ["--embeddings", "--batch-size", str(model.ctx_size), "--ubatch-size", str(model.ctx_size)]
    embedding = embedding if model.embedding else []
    if model.embedding:
        # A GGUF that declares no pooling, or none (any chat model), would start and then refuse every
        # request ("Pooling type 'none' is not OAI compatible"): it gets mean unless `pooling` is set.
        embedding += ["--pooling", model.pooling or embedding_pooling(model_file)]
    template = ["--chat-template-file", str(model.chat_template_file.expanduser())] if model.chat_template_file else []
    return [
        str(binary),
        "--model", str(model_file),
        "--alias", model.name,
        "--host", host,
        "--port", str(port),
        "--parallel", str(model.parallel),
        # llama-server drops connections beyond its HTTP threads: one for each request it may be
        # handed (slots and its own queue) and room for health probes.
        "--threads-http", str(model.most_in_flight + 4),
        # Each slot gets the model's full per-request context.
        "--ctx-size", str(model.ctx_size * model.parallel),
        "--threads", str(model.threads or 1),
        "--threads-batch", str(model.threads or 1),
        # llama-server's default prompt cache may grow to 8 GiB per process: bound it per model. Off
        # under cache_isolation = "key": a slot may load any key's prompt from it.
        "--cache-ram", str(model.cache_ram_mb if ram_cache else 0),
        "--no-webui",
        "--jinja",
        *(("--ssl-cert-file", str(tls_files[0]), "--ssl-key-file", str(tls_files[1])) if tls_files else ()),
        *vision,
        *embedding,
        *template,
        *knobs(model),
        *model.llama_server_args,
    ]  # fmt: skip


# Model settings that are llama-server flags as they are.
KNOBS = {
    "n_gpu_layers": "--n-gpu-layers", "flash_attn": "--flash-attn", "cache_type_k": "--cache-type-k",
    "cache_type_v": "--cache-type-v", "batch_size": "--batch-size", "ubatch_size": "--ubatch-size",
    "rope_scaling": "--rope-scaling", "rope_freq_base": "--rope-freq-base", "rope_freq_scale": "--rope-freq-scale",
    "load_mode": "--load-mode", "draft_model": "--spec-draft-model", "draft_max": "--spec-draft-n-max",
}  # fmt: skip


def knobs(model: ModelConfig) -> list[str]:
    """The llama-server flags of the model's settings that are set."""
    out: list[str] = []
    for setting, flag in KNOBS.items():
        value = getattr(model, setting)
        if value is not None:
            out += [flag, str(value.expanduser() if isinstance(value, Path) else value)]
    return out


def slot_context(model: ModelConfig) -> int:
    """The tokens one request can hold, prompt and completion together: llama.cpp pads the context
    it is given (ctx_size * parallel) to a multiple of 256 and shares it among the slots. Context
    shift is off in this build: generation stops there (measured: -c 128 gave 256 tokens in all)."""
    return -(-model.ctx_size * model.parallel // 256) * 256 // model.parallel


# The longest a request is taken to go from its pin to its socket write on one host (a turn of the event loop
# and, at worst, a local connection opened): `Instance.order_wait`.
ORDER_GRACE = 0.05


@dataclass(eq=False)
class Instance:
    model: ModelConfig
    host: str
    port: int
    log_path: Path
    id: str = field(default_factory=lambda: secrets.token_hex(6))
    status: Status = Status.STARTING
    process: subprocess.Popen[bytes] | None = None
    client: LlamaServerClient | None = None
    started_at: float = 0.0
    last_activity: float = field(default_factory=time.time)
    in_flight: int = 0
    # Requests other gateways have in flight on it (a node's instance: as they publish their load,
    # cluster/registry.py); this gateway's own are `in_flight`.
    elsewhere: int = 0
    failures: int = 0  # requests in a row that could not reach it (a remote instance's circuit breaker)
    last_key: str = ""  # the key of the request begun last (the watchdog names it when the instance stalls)
    answered_at: float = 0.0  # when it last answered a request (time.monotonic()): alive then, no probe needed
    users: dict[str, int] = field(default_factory=dict)  # key id → its requests in flight here
    grammars: dict[str, int] = field(default_factory=dict)  # key id → its requests here that carry a grammar
    blamed: frozenset[str] = frozenset()  # the keys whose requests the watchdog held its last stall against
    # The key whose grammar-carrying request ended last here, and when (time.monotonic()): its client may have
    # left while llama-server's main loop still works on its grammar.
    last_grammar: tuple[str, float] | None = None
    crashes: collections.deque[float] = field(default_factory=collections.deque)
    restarting: bool = False
    ram_used_mb: int = 0
    cpu_percent: float | None = None
    # What the model's chat template does (llama-server's /props and /apply-template): renders tools
    # itself (if not, the gateway describes them in the prompt: engine/tools.py), thinks.
    template: Template = field(default_factory=Template)
    keep_until: float = 0.0  # a request's keep_alive: not stopped for idleness before this (time.time())
    api_key: str | None = None  # llama-server's --api-key (instance_api_key, or a random one)
    ram_cache: bool = True  # llama-server's RAM prompt cache (off under cache_isolation = "key")
    # Why it was last taken out of service (a crash, missed probes, a stall), until it is running again;
    # `stalled`: its main loop stopped making progress, so its requests fail as such and are not retried.
    failure: str | None = None
    stalled: bool = False
    tls: ssl.SSLContext | None = None  # reached over HTTPS, its certificate verified with this
    tls_files: tuple[Path, Path] | None = None  # the certificate and key it serves HTTPS with (a node's)
    # Its slots' prompt caches are saved to and restored from disk (pool/saved_prompts.py): the store,
    # and the folder of this instance's model identity (set at start).
    saved_prompts: SavedPrompts | None = None
    prompt_folder: Path | None = None
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    stopped: asyncio.Event = field(default_factory=asyncio.Event)  # set once `stop` has ended its process
    _ps: psutil.Process | None = None

    def __post_init__(self) -> None:
        self.idle.set()

    @property
    def native_tools(self) -> bool:
        return self.template.tools

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def address(self) -> str:
        """host:port, what affinity ranks instances by (the same for every gateway)."""
        return f"{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{'http' if self.tls is None else 'https'}://{self.host}:{self.port}"

    @property
    def load(self) -> int:
        """Requests in flight on it through every gateway, as far as this one knows."""
        return self.in_flight + self.elsewhere

    @property
    def accepting(self) -> bool:
        return self.status in (Status.READY, Status.BUSY) and self.client is not None

    @property
    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    @property
    def placed_on(self) -> str:
        """The node it runs on: "" for this process's own (a node's instance: that node's name)."""
        return ""

    def last_activity_iso(self) -> str:
        return datetime.fromtimestamp(self.last_activity, UTC).isoformat(timespec="seconds")

    def unreachable(self) -> str | None:
        """A request could not reach it: why it is out of service now (its process is gone), or None
        (a node's instance counts toward this gateway's circuit breaker instead)."""
        if self.exited and self.process is not None:
            return f"pid {self.pid} died with code {self.process.returncode}"
        return None

    async def drained_elsewhere(self, timeout: float) -> bool:
        """Drain it where it runs, if not here: True once its node has (a node's instance); False for one
        this supervisor drains itself."""
        return False

    def refresh_status(self) -> None:
        if self.status in (Status.READY, Status.BUSY):
            self.status = Status.BUSY if self.load >= self.model.parallel else Status.READY

    # Prompt-cache isolation between keys (cache_isolation = "key"): which key's prompt each slot's
    # cache holds (None: not known), how many requests this gateway has pinned to it, when it was last
    # taken. Only a key's own request on an idle slot whose cache holds its own prompt may reuse it.
    shared: ClassVar[bool] = False  # other gateways send to it too (a node's instance): owners in Redis
    log_here: ClassVar[bool] = True  # its llama-server log is a file on this host (a node's is on the node)
    _slot_owner: list[str | None] = field(default_factory=list, repr=False)
    _slot_holds: list[int] = field(default_factory=list, repr=False)
    _slot_taken: list[int] = field(default_factory=list, repr=False)
    _slot_start: list[int] = field(default_factory=list, repr=False)  # a hash of its prompt's start
    _slot_unsure: list[bool] = field(default_factory=list, repr=False)  # its last request ended early
    _slot_clock: int = field(default=0, repr=False)
    # With saved prompts on (the per-key tier): the conversation each slot's cache holds now (the key,
    # start and prompt size of the last request that ended normally on it; None: not known), and whose
    # turn it is on each slot (pool/slot_gate.py), so that whatever a request displaces is saved first.
    _slot_held: list[tuple[str, int, int] | None] = field(default_factory=list, repr=False)
    _slot_gates: list[SlotGate] = field(default_factory=list, repr=False)
    # Long prompts waiting for whichever slot is idle first (`idle_slot`), first come first served, and
    # how many of them were woken for an idle slot and have not taken it yet.
    _idle_waiters: collections.deque[asyncio.Future[None]] = field(default_factory=collections.deque, repr=False)
    _idle_promised: int = field(default=0, repr=False)
    # Per slot, the last take told to reuse its cache: its key and when (`order_wait`).
    _slot_reused: list[tuple[str, float] | None] = field(default_factory=list, repr=False)

    def take_slot(self, key_id: str, start: int) -> tuple[int, bool, bool]:
        """A slot for `key_id`'s request whose prompt begins as `start` (a hash), whether it may reuse
        the slot's cached prompt, and whether that cache is this very conversation's: an idle slot holding
        this key's prompt of the same start (reuse), else the idle slot taken longest ago (reuse if its
        prompt is this key's), else the least held one (reuse if every request pinned to it since it was
        idle is this key's: whichever runs last, the prompt is the key's own)."""
        if not self._slot_owner:
            size = self.model.parallel
            self._slot_owner, self._slot_holds, self._slot_taken = [None] * size, [0] * size, [0] * size
            self._slot_start, self._slot_unsure, self._slot_held = [0] * size, [False] * size, [None] * size
            self._slot_gates = [SlotGate() for _ in range(size)]
            self._slot_reused = [None] * size
        # A slot whose last request ended early (a timeout, a client gone) may still be finishing it:
        # taken only when no other is idle. (One pass over the slots: every request pins one.)
        idle: list[int] = []
        unsure: list[int] = []
        for slot, holds in enumerate(self._slot_holds):
            if holds == 0:
                (unsure if self._slot_unsure[slot] else idle).append(slot)
        idle = idle or unsure
        same = next((s for s in idle if self._slot_owner[s] == key_id and self._slot_start[s] == start), None)
        if same is not None:
            slot = same
        elif idle:
            slot = min(idle, key=self._slot_taken.__getitem__)
        else:
            slot = min(range(len(self._slot_holds)), key=self._slot_holds.__getitem__)
        # A slot held only by this key's requests since it was last idle holds this key's prompt when this
        # one runs: reused (an agent's retry queued behind its first try read 12,000 tokens again).
        reuse = self._slot_owner[slot] == key_id
        warm = reuse and self._slot_start[slot] == start
        self._slot_owner[slot] = key_id if not self._slot_holds[slot] or reuse else None
        self._slot_start[slot] = start
        self._slot_holds[slot] += 1
        self._slot_clock += 1
        self._slot_taken[slot] = self._slot_clock
        if reuse:
            self._slot_reused[slot] = (key_id, time.monotonic())
        return slot, reuse, warm

    def order_wait(self, slot: int, key_id: str) -> float:
        """Seconds `key_id`'s request, just pinned to `slot`, waits before it is sent: the rest of ORDER_GRACE
        after another key's request took the slot told to reuse its cache. The pins decide in the order of
        takes, llama-server runs a slot's requests in the order they arrive: sent first (the other still
        opening its connection), this one's prompt would be in the slot's cache when the other reuses it,
        and the other key's `cached_tokens` would tell how this prompt begins (cluster/slots.py: GRACE_MS)."""
        reused = self._slot_reused[slot] if slot < len(self._slot_reused) else None
        if reused is None or reused[0] == key_id:
            return 0.0
        return max(0.0, ORDER_GRACE - (time.monotonic() - reused[1]))

    def _idle_slots(self) -> int:
        return sum(1 for holds in self._slot_holds if holds == 0) if self._slot_holds else self.model.parallel

    def idle_slot(self, alone: bool) -> Awaitable[None] | None:
        """Saved prompts on: what to await until one of its slots is idle, first come first served, if this
        request will have its slot to itself (`alone`: a long prompt) — pinned at once, it would wait for the
        slot `take_slot` chose, while llama-server's own queue hands the next request whichever slot frees
        first; `take_slot` right after returns the idle one. A short request, which shares slots, waits only
        behind long ones already waiting (else it would keep every slot from ever being idle). None: no wait
        (no coroutine is made on the common path)."""
        if not self._idle_waiters and (not alone or self._idle_slots() > self._idle_promised):
            return None
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(turn)
        return self._idle_turn(turn)

    async def _idle_turn(self, turn: asyncio.Future[None]) -> None:
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._idle_promised -= 1  # woken as it gave up: handed on
                self._wake_idle()
            elif turn in self._idle_waiters:
                self._idle_waiters.remove(turn)
            raise
        self._idle_promised -= 1

    def _wake_idle(self) -> None:
        while self._idle_waiters and self._idle_slots() > self._idle_promised:
            turn = self._idle_waiters.popleft()
            if not turn.done():
                self._idle_promised += 1
                turn.set_result(None)

    async def claim_slot(self, key_id: str, start: int, size: int) -> tuple[int, bool, str] | None:
        """For an instance other gateways send to too (`shared`): `take_slot`, the turn on the slot and the
        per-key tier against the record every gateway shares (cluster/slots.py) — once the request may be
        sent: the slot, whether it may reuse its cached prompt, and the hold to give back with `free_slot`;
        None when that record cannot be read (nothing is reused then)."""
        return None

    def free_slot(
        self, slot: int, hold: str, finished: bool, conversation: tuple[str, int, int]
    ) -> asyncio.Task[None] | None:
        """Give back a slot `claim_slot` took (`conversation`: the request's key id, prompt start and bytes);
        the task (if any) ends once every gateway can see it free."""
        return None

    def held_prompts(self) -> list[tuple[int, str, int]]:
        """The idle slots whose cache is one key's conversation: slot, key id, the conversation's start."""
        idle = [slot for slot, holds in enumerate(self._slot_holds) if not holds and not self._slot_unsure[slot]]
        return [
            (slot, owner, self._slot_start[slot])
            for slot in idle
            if (owner := self._slot_owner[slot]) is not None and self._slot_start[slot]
        ]

    def give_slot(
        self, slot: int, finished: bool = True, conversation: tuple[str, int, int] | None = None, ran: bool = True
    ) -> None:
        """A request pinned to `slot` ended; `finished`: normally, its `conversation` (key id, start, prompt
        bytes) now what the slot's cache holds (else the slot's cache is nobody's, and it is taken last while
        it may still be working). `ran`: False for one that gave up waiting for the slot (saved prompts on),
        which changed nothing there."""
        if slot < len(self._slot_holds) and self._slot_holds[slot] > 0:
            self._slot_holds[slot] -= 1
            if ran:
                self._slot_unsure[slot] = not finished
                self._slot_held[slot] = conversation if finished else None
                if not finished:
                    self._slot_owner[slot] = None
            if self._idle_waiters and not self._slot_holds[slot]:
                self._wake_idle()

    def slot_gate(self, slot: int) -> SlotGate:
        """Whose turn it is on `slot` (saved prompts on: pool/slot_gate.py)."""
        return self._slot_gates[slot]

    def slot_holds(self, slot: int) -> tuple[str, int, int] | None:
        """The conversation (key id, start, prompt bytes) the slot's cache holds, if known: exact for a request
        that has the slot to itself."""
        return self._slot_held[slot]

    def grammar_suspects(self, within: float) -> list[str]:
        """The keys whose requests carry a grammar here, or, with none in flight, the key whose grammar
        request ended within the last `within` seconds."""
        if self.grammars:
            return sorted(self.grammars)
        last = self.last_grammar
        return [last[0]] if last is not None and time.monotonic() - last[1] <= within else []

    def begin(self, key_id: str) -> None:
        self.last_key = key_id
        self.idle.clear()
        self.in_flight += 1
        self.users[key_id] = self.users.get(key_id, 0) + 1
        self.last_activity = time.time()
        self.refresh_status()

    def end(self, key_id: str) -> None:
        self.in_flight -= 1
        left = self.users.pop(key_id, 0) - 1
        if left > 0:
            self.users[key_id] = left
        if self.in_flight == 0:
            self.idle.set()
        self.last_activity = time.time()
        self.refresh_status()

    def sample(self) -> None:
        """RSS and CPU of the llama-server process; CPU is the share since the previous sample."""
        if self._ps is None or self.exited:
            return
        try:
            self.ram_used_mb = round(self._ps.memory_info().rss / 2**20)
            self.cpu_percent = round(self._ps.cpu_percent(None), 1)
        except psutil.Error:
            pass

    def _cpu_since_start(self) -> float:
        # Before the first interval sample: the average since start, never psutil's first 0.0.
        if self._ps is None or self.exited:
            return 0.0
        try:
            times = self._ps.cpu_times()
            elapsed: float = max(time.time() - float(self._ps.create_time()), 1e-3)
        except psutil.Error:
            return 0.0
        return round(100.0 * float(times.user + times.system) / elapsed, 1)

    def describe(self) -> dict[str, Any]:
        """The seed's instance record, with exactly its fields and types."""
        running = self.process is not None and not self.exited and self.status != Status.STOPPED
        return {
            "instance_id": self.id,
            "model": self.model.name,
            "status": self.status.value,
            "host": self.host,
            "port": self.port,
            "pid": self.pid or 0,
            "active_users": len(self.users),
            "ram_used_mb": self.ram_used_mb if running else 0,
            "cpu_percent": (self.cpu_percent if self.cpu_percent is not None else self._cpu_since_start())
            if running
            else 0.0,
            "uptime_seconds": int(time.time() - self.started_at) if running and self.started_at else 0,
            "last_activity": self.last_activity_iso(),
        }

    def log_tail(self, lines: int = 20) -> list[str]:
        """The last lines llama-server wrote to its log (what it said before it failed), at most the last
        LOG_TAIL_BYTES of it, with anything shaped like a key or token masked."""
        try:
            with self.log_path.open("rb") as file:
                size = file.seek(0, 2)
                file.seek(max(0, size - LOG_TAIL_BYTES))
                text = file.read().decode(errors="replace").splitlines()
        except OSError:
            return []
        if size > LOG_TAIL_BYTES:
            text = text[1:]  # the first line read may be the end of a longer one
        return [redact_log_line(line, self.api_key) for line in text[-lines:]]

    async def start(self, binary: Path, model_file: Path, timeout: float, mmproj: Path | None = None) -> None:
        """Spawn llama-server and wait until it answers /health; InstanceStartError otherwise."""
        self.status = Status.STARTING
        self.stopped.clear()
        self.cpu_percent = None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        args = llama_server_args(
            binary, model_file, self.model, self.host, self.port, mmproj, self.tls_files, self.ram_cache
        )
        if self.saved_prompts is not None and not self.model.embedding:
            self.prompt_folder = await asyncio.to_thread(self.saved_prompts.folder, self.model.name, args)
            args += ["--slot-save-path", str(self.prompt_folder)]
        # The key goes in llama-server's environment (its --api-key reads LLAMA_API_KEY), not on the
        # command line, which any user of the host can read in /proc.
        env = {**os.environ, "LLAMA_API_KEY": self.api_key} if self.api_key else None
        with self.log_path.open("ab") as log_file:
            log_file.write(f"\n=== {datetime.now(UTC).isoformat()} starting: {' '.join(args)}\n".encode())
            log_file.flush()
            # Spawned from the event-loop thread on purpose: PR_SET_PDEATHSIG fires when the *thread*
            # that forked the child exits, so a worker thread would take the child down with it.
            self.process = subprocess.Popen(  # noqa: ASYNC220
                args,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C at the terminal reaches the gateway, which stops us in order
                # SIGKILL, not SIGTERM: llama-server's SIGTERM handler can hang in its graceful shutdown
                # (seen here with the signal stuck blocked in the handler), and nobody is left to wait.
                preexec_fn=on_parent_death(signal.SIGKILL),
                env=env,
            )
        log.info(
            "instance %s (%s) starting: pid %s on %s, log %s",
            self.id, self.model.name, self.process.pid, self.base_url, self.log_path,
        )  # fmt: skip
        self.started_at = time.time()
        try:
            await self._wait_healthy(timeout)
        except BaseException:
            self.status = Status.FAILED
            await self.stop()
            self.status = Status.FAILED
            raise
        # At most `most_in_flight` requests are leased to an instance, plus health probes (its HTTP
        # threads: llama_server_args).
        self.client = LlamaServerClient(
            self.base_url, connections=self.model.most_in_flight + 2, api_key=self.api_key, tls=self.tls
        )
        self.template = await self.learn_template()
        with contextlib.suppress(psutil.Error):
            self._ps = psutil.Process(self.process.pid)
            self._ps.cpu_percent(None)  # primes the interval measure; this first value means nothing
        self.sample()
        self.status = Status.READY
        self.last_activity = time.time()
        log.info(
            "instance %s (%s) ready in %.1f s; tool calls: %s; thinking: %s",
            self.id, self.model.name, time.time() - self.started_at,
            "its chat template's" if self.native_tools else "described in the prompt (the template has no tools)",
            "yes" if self.template.thinks else "no (the template does not think)",
        )  # fmt: skip

    async def learn_template(self) -> Template:
        """What the chat template does: its capabilities in /props, and whether it thinks (rendered with
        enable_thinking on and off, a thinking template differs)."""
        assert self.client is not None
        try:
            caps = (await self.client.get_json("/props")).get("chat_template_caps") or {}
            rendered = [
                (await self.client.post_json("/apply-template", {**THINKING_PROBE, "chat_template_kwargs": {
                    "enable_thinking": thinking}})).get("prompt")
                for thinking in (True, False)
            ]  # fmt: skip
        except APIError as exc:
            log.warning("instance %s: no /props (%s); tools will be described in the prompt", self.id, exc.message)
            return Template()
        return Template(
            tools=bool(caps.get("supports_tool_calls")) and bool(caps.get("supports_tools")),
            thinks=rendered[0] != rendered[1],
            effort=bool(caps.get("supports_reasoning_effort")),
        )

    async def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = LlamaServerClient(self.base_url, connections=1, api_key=self.api_key, tls=self.tls)
        try:
            while True:
                if self.exited:
                    assert self.process is not None
                    raise InstanceStartError(
                        f"llama-server for {self.model.name!r} exited with code {self.process.returncode} "
                        f"while starting; see {self.log_path}"
                    )
                try:
                    if await client.health(2.0):
                        return
                except Untrusted as exc:  # waiting will not change it
                    raise InstanceStartError(
                        f"llama-server for {self.model.name!r} serves a certificate this node does not trust "
                        f"({exc}): check [instances] tls_cert and tls_ca"
                    ) from None
                if time.monotonic() > deadline:
                    raise InstanceStartError(
                        f"llama-server for {self.model.name!r} did not become healthy within {timeout:.0f} s; "
                        f"see {self.log_path}"
                    )
                await asyncio.sleep(0.1)
        finally:
            await client.close()

    async def probe(self, timeout: float = PROBE_TIMEOUT) -> bool:
        """A real health probe: True when the process answers /health with 200 in time. It runs in a
        thread, on its own socket and clock: an event loop stalled by other work (a request's huge
        headers) delays the verdict but never makes a healthy instance miss its probe."""
        if self.client is None or self.exited:
            return False
        return await asyncio.to_thread(self.client.health_in_thread, timeout)

    async def stall_reason(self, pid: int | None, key_id: str | None = None) -> str | None:
        """Why the watchdog restarted the process `pid` of this instance, if the request of `key_id` is one
        it held the stall against (that request ends with it, not sent again; another key's is sent again);
        None when it did not, or the request was not to blame."""
        if not self.stalled or (key_id is not None and self.blamed and key_id not in self.blamed):
            return None
        return self.failure or "made no progress"

    async def answers_slots(self, timeout: float) -> bool | None:
        """Whether llama-server's main loop answers /slots within `timeout` seconds. /health is answered
        by its HTTP threads alone; /slots waits for the loop that runs every slot, so an instance whose
        loop is stuck (one generation step that never ends) answers the first and not the second. None:
        it cannot be reached at all (gone, or its process died), which is not a stall."""
        if self.client is None or self.exited:
            return None
        return await self.client.answers_slots(timeout)

    async def stop(self, grace: float = 10.0) -> None:
        """terminate → wait → kill, and close the HTTP client."""
        if self.client is not None:
            await self.client.close()
            self.client = None
        process = self.process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                await asyncio.wait_for(asyncio.to_thread(process.wait), grace)
            except TimeoutError:
                log.warning("instance %s did not stop in %.0f s: killing it", self.id, grace)
                process.kill()
                await asyncio.to_thread(process.wait)
        if self.status != Status.FAILED:
            self.status = Status.STOPPED
        self.stopped.set()
