"""The llama-server flags a model's `llama_server_args` may carry: an allowlist, read as llama.cpp reads
its command line (common/arg.cpp): a `--long` flag with `_` is the same flag with `-`, short forms are
their own spellings, a flag that takes a value takes the next argument whatever it looks like, and
`--flag=value` is not a spelling llama.cpp knows.

Only what tunes how a model computes is here: sampling defaults, context and batching, the KV cache,
RoPE, CPU and device placement, speculative decoding's numbers, reasoning. Never: anything that
reads or writes a file or a URL (logs, slot saves, LoRA, grammars, prompts, media, a model), a key or
a TLS file, an address, the web UI or its tools, endpoints that change the server (`--props`), or what
llmserver sets itself (`--cache-ram`, slots, context, threads, `--jinja`, …) — those would bypass
quotas and the ledger, run tools on the host, or undo per-key cache isolation.
`tests/llama/test_flags.py` checks each entry against `llama-server --help` of the pinned build.
"""

from __future__ import annotations

# flag spellings → whether the flag takes a value (the next argument)
_VALUE = True
_SWITCH = False


def _spellings(table: dict[tuple[str, ...], bool]) -> dict[str, bool]:
    return {spelling: takes for spellings, takes in table.items() for spelling in spellings}


ALLOWED: dict[str, bool] = _spellings({
    # sampling defaults (a request's own fields still win)
    ("--temp", "--temperature"): _VALUE, ("--top-k",): _VALUE, ("--top-p",): _VALUE, ("--min-p",): _VALUE,
    ("--top-nsigma", "--top-n-sigma"): _VALUE, ("--xtc-probability",): _VALUE, ("--xtc-threshold",): _VALUE,
    ("--typical", "--typical-p"): _VALUE, ("--repeat-last-n",): _VALUE, ("--repeat-penalty",): _VALUE,
    ("--presence-penalty",): _VALUE, ("--frequency-penalty",): _VALUE, ("--dry-multiplier",): _VALUE,
    ("--dry-base",): _VALUE, ("--dry-allowed-length",): _VALUE, ("--dry-penalty-last-n",): _VALUE,
    ("--dry-sequence-breaker",): _VALUE, ("--dynatemp-range",): _VALUE, ("--dynatemp-exp",): _VALUE,
    ("--mirostat",): _VALUE, ("--mirostat-lr",): _VALUE, ("--mirostat-ent",): _VALUE, ("--samplers",): _VALUE,
    ("--sampler-seq", "--sampling-seq"): _VALUE, ("-s", "--seed"): _VALUE, ("--ignore-eos",): _SWITCH,
    ("-n", "--predict", "--n-predict"): _VALUE, ("--keep",): _VALUE, ("-l", "--logit-bias"): _VALUE,
    # context, batching and the KV cache
    ("--swa-full",): _SWITCH, ("-kvu", "--kv-unified"): _SWITCH, ("-no-kvu", "--no-kv-unified"): _SWITCH,
    ("--context-shift",): _SWITCH, ("--no-context-shift",): _SWITCH,
    ("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"): _VALUE, ("-cms", "--checkpoint-min-step"): _VALUE,
    ("-dt", "--defrag-thold"): _VALUE, ("--cache-reuse",): _VALUE, ("-sps", "--slot-prompt-similarity"): _VALUE,
    ("-cb", "--cont-batching"): _SWITCH, ("-nocb", "--no-cont-batching"): _SWITCH,
    ("-kvo", "--kv-offload"): _SWITCH, ("-nkvo", "--no-kv-offload"): _SWITCH,
    ("--warmup",): _SWITCH, ("--no-warmup",): _SWITCH, ("--image-min-tokens",): _VALUE, ("--image-max-tokens",): _VALUE,
    # RoPE and context extension
    ("--rope-scale",): _VALUE, ("--yarn-orig-ctx",): _VALUE, ("--yarn-ext-factor",): _VALUE,
    ("--yarn-attn-factor",): _VALUE, ("--yarn-beta-slow",): _VALUE, ("--yarn-beta-fast",): _VALUE,
    # CPU and device placement
    ("--numa",): _VALUE, ("-dev", "--device"): _VALUE, ("-ot", "--override-tensor"): _VALUE,
    ("-cmoe", "--cpu-moe"): _SWITCH, ("-ncmoe", "--n-cpu-moe"): _VALUE, ("-sm", "--split-mode"): _VALUE,
    ("-ts", "--tensor-split"): _VALUE, ("-mg", "--main-gpu"): _VALUE, ("--override-kv",): _VALUE,
    ("--repack",): _SWITCH, ("-nr", "--no-repack"): _SWITCH, ("--no-host",): _SWITCH,
    ("--op-offload",): _SWITCH, ("--no-op-offload",): _SWITCH, ("--check-tensors",): _SWITCH,
    ("--prio",): _VALUE, ("--prio-batch",): _VALUE, ("--poll",): _VALUE, ("--poll-batch",): _VALUE,
    ("-C", "--cpu-mask"): _VALUE, ("-Cr", "--cpu-range"): _VALUE, ("--cpu-strict",): _VALUE,
    ("-Cb", "--cpu-mask-batch"): _VALUE, ("-Crb", "--cpu-range-batch"): _VALUE, ("--cpu-strict-batch",): _VALUE,
    ("--mmproj-offload",): _SWITCH, ("--no-mmproj-offload",): _SWITCH,
    # speculative decoding's numbers (the draft model itself is the draft_model setting)
    ("--spec-draft-n-min", "--draft-min", "--draft-n-min"): _VALUE,
    ("--spec-draft-p-min", "--draft-p-min"): _VALUE,
    ("--spec-draft-ngl", "-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft"): _VALUE,
    ("--spec-draft-threads", "-td", "--threads-draft"): _VALUE,
    ("--spec-draft-type-k", "-ctkd", "--cache-type-k-draft"): _VALUE,
    ("--spec-draft-type-v", "-ctvd", "--cache-type-v-draft"): _VALUE,
    ("--spec-draft-device", "-devd", "--device-draft"): _VALUE,
    ("--spec-type",): _VALUE,
    # reasoning
    ("--reasoning-format",): _VALUE, ("--reasoning-budget",): _VALUE, ("--chat-template-kwargs",): _VALUE,
    ("--prefill-assistant",): _SWITCH, ("--no-prefill-assistant",): _SWITCH,
    # the instance's own HTTP timeout
    ("-to", "--timeout"): _VALUE,
})  # fmt: skip


def normalised(argument: str) -> str:
    """A flag as llama.cpp looks it up: `--a_b` is `--a-b`."""
    return argument.replace("_", "-") if argument.startswith("--") else argument


def check(arguments: list[str]) -> None:
    """Raise ValueError naming the first argument llama-server would read as a flag not in ALLOWED."""
    at = 0
    while at < len(arguments):
        argument = arguments[at]
        flag = normalised(argument)
        if "=" in flag and flag.startswith("-"):
            raise ValueError(f"{argument}: llama-server takes no --flag=value; give the value as the next argument")
        if flag not in ALLOWED:
            if not argument.startswith("-"):
                raise ValueError(f"{argument!r} follows no flag that takes a value")
            raise ValueError(
                f"{argument} is not a llama-server flag that llmserver passes on "
                "(see llama_server_args in the configuration guide for those it does)"
            )
        if ALLOWED[flag]:
            if at + 1 >= len(arguments):
                raise ValueError(f"{argument} needs a value")
            at += 1
        at += 1
