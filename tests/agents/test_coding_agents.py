"""The coding agents people use, as they ship (issue 55): Claude Code and Codex, installed from npm's
registry at test time (pinned, into a cache folder outside the repository), run non-interactively
against a real llmserver with the settings their pages in docs/agents/ give, read from those pages.

Every request they make goes through `Gate` (tests/agents/gate.py), which relays to llmserver and
refuses anything else: what they sent and were answered is read from it.

Their default requests are large (Claude Code's about 12,000 tokens, Codex's about 9,000), and this
machine reads a prompt at about 100 tokens a second: the full defaults are checked against a small
context (taken whole, then refused as too long at once, in the client's own words), and the answers
and a tool round trip on a served model with a larger context (the embedded model's training context
raised by `--override-kv`, greedy sampling so that a run is repeatable)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agents.gate import Exchange, Gate
from tests.support import MODEL, THREADS, Server, create_key

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "agents"
PACKAGES = ("@anthropic-ai/claude-code@2.1.332", "@openai/codex@0.171.0")
AIDER = "aider-chat==0.86.1"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmserver-tests" / "agents"
# The embedded model, its context raised past the agents' prompts (its training context is 8,192).
BIG_CONFIG = f"""
limits.max_tokens = 256
[[models]]
name = "{MODEL}"
parallel = 1
ctx_size = 16384
threads = {THREADS}
llama_server_args = ["--override-kv", "llama.context_length=int:16384", "--temp", "0"]
"""


@pytest.fixture(scope="module")
def bins() -> Path:
    """The agents' commands, installed once per machine (npm's own cache makes a reinstall quick)."""
    folder = CACHE / "-".join(package.rsplit("@", 1)[1] for package in PACKAGES)
    commands = folder / "node_modules" / ".bin"
    if not all((commands / name).exists() for name in ("claude", "codex")):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "package.json").write_text('{"private": true}\n')
        installed = subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--save-exact", "--prefix", str(folder), *PACKAGES],
            capture_output=True, text=True, timeout=1200, check=False,
        )  # fmt: skip
        assert installed.returncode == 0, installed.stderr[-4000:]
    return commands


@pytest.fixture(scope="module")
def aider() -> Path:
    """aider, in a virtual environment of its own (it pins its own versions of what llmserver uses)."""
    folder = CACHE / AIDER.replace("==", "-")
    command = folder / "bin" / "aider"
    if not command.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(folder)], check=True, timeout=300)
        installed = subprocess.run([str(folder / "bin" / "pip"), "install", "--quiet", AIDER],
                                   capture_output=True, text=True, timeout=1800, check=False)  # fmt: skip
        assert installed.returncode == 0, installed.stderr[-4000:]
    return command


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    server = Server(data_dir=tmp_path_factory.mktemp("agents"), config=BIG_CONFIG).start()
    yield server, create_key(server.data_dir, "agents")
    server.stop()


def documented_env(page: str) -> dict[str, str]:
    """The `export NAME=value` lines of a page's first `sh` block."""
    block = re.search(r"```sh\n(.*?)```", (DOCS / page).read_text(), re.S)
    assert block is not None
    return dict(re.findall(r"^export (\w+)=(\S+)$", block.group(1), re.M))


def documented_codex_config(page: str) -> dict[str, Any]:
    block = re.search(r"```toml\n(.*?)```", (DOCS / page).read_text(), re.S)
    assert block is not None
    return tomllib.loads(block.group(1))


def run(
    gate: Gate,
    home: Path,
    args: list[str],
    env: dict[str, str],
    timeout: float,
    until: Callable[[], bool] | None = None,
) -> subprocess.CompletedProcess[str]:
    """An agent run in a scratch folder, with a home of its own, its only way out the gate; stopped
    once `until` holds, if it is given (an agent whose model never stops calling tools)."""
    work = home / "work"
    work.mkdir(parents=True, exist_ok=True)
    proxied = {"HTTPS_PROXY": gate.url, "HTTP_PROXY": gate.url, "NO_PROXY": "127.0.0.1,localhost"}
    full = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", **proxied, **env}
    with (home / "stdout").open("w+") as out, (home / "stderr").open("w+") as err:
        process = subprocess.Popen(args, cwd=work, env=full, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while process.poll() is None and time.monotonic() < deadline and not (until is not None and until()):
            time.sleep(0.2)
        if process.poll() is None:
            process.terminate()
        process.wait(30)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(args, process.returncode, out.read(), err.read())


def page_env(page: str, gate: Gate, key: str) -> dict[str, str]:
    """The page's settings, with this test's server (through the gate) and key."""
    return {
        name: key if value == "llms-YOUR-KEY" else value.replace("http://127.0.0.1:8000", gate.url)
        for name, value in documented_env(page).items()
    }


def codex_home(home: Path, gate: Gate, key: str) -> dict[str, str]:
    config = documented_codex_config("codex.md")
    provider = config["model_providers"][config["model_provider"]]
    provider["base_url"] = gate.url + "/v1"
    lines = [f"model = {json.dumps(config['model'])}", f"model_provider = {json.dumps(config['model_provider'])}", ""]
    lines.append(f"[model_providers.{config['model_provider']}]")
    lines += [f"{name} = {json.dumps(value)}" for name, value in provider.items()]
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text("\n".join(lines) + "\n")
    return {provider["env_key"]: key, "CODEX_HOME": str(home / ".codex")}


def events(exchange: Exchange) -> list[dict[str, Any]]:
    lines = exchange.body().decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.fixture
def gate_to(request: pytest.FixtureRequest) -> Iterator[Any]:
    gates: list[Gate] = []

    def start(server: Server) -> Gate:
        gates.append(Gate(server.port).start())
        return gates[-1]

    yield start
    for gate in gates:
        gate.stop()


def test_claude_codes_default_request_is_taken_and_a_too_long_prompt_is_its_own_message(
    bins: Path, server: Server, api_key: str, gate_to: Any, tmp_path: Path
) -> None:
    """Its first request, as it ships: 12 tools (one with `maxLength: 524288`), system turns among the
    messages, `context_management`, adaptive thinking, `max_tokens: 32000`. On the session server's
    1,024-token context it is refused at once, and Claude Code says why in its own words."""
    gate = gate_to(server)
    env = page_env("claude-code.md", gate, api_key)
    done = run(gate, tmp_path, [str(bins / "claude"), "-p", "What is 2+2?", "--model", MODEL,
                                "--output-format", "json"], env, 120)  # fmt: skip
    result = json.loads(done.stdout)
    assert result["is_error"] and result["terminal_reason"] == "prompt_too_long", result
    assert "Prompt is too long" in result["result"]
    sent = gate.to("/v1/messages")
    assert sent and all(exchange.status == 400 for exchange in sent)
    assert json.loads(sent[0].body())["error"]["message"].startswith("prompt is too long: ")
    asked = sent[0].json()
    assert len(asked["tools"]) >= 10 and asked["max_tokens"] > 4096 and "context_management" in asked
    assert any(message["role"] == "system" for message in asked["messages"])
    # Every field of it is taken: counted by the model's own template and tokenizer.
    counted = httpx.post(server.url + "/v1/messages/count_tokens", json=asked, headers={"x-api-key": api_key},
                         timeout=60)  # fmt: skip
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] > 8000
    assert all(not refused.startswith(("GET /", "POST /")) for refused in gate.refused)  # only off-machine


def test_codexs_default_request_is_taken_and_a_too_long_prompt_is_its_own_message(
    bins: Path, server: Server, api_key: str, gate_to: Any, tmp_path: Path
) -> None:
    """Its first request, as it ships: `client_metadata`, a `namespace` tool, `web_search`, refused at
    once as too long (not as a field it does not know), and Codex says its context window is full."""
    gate = gate_to(server)
    env = codex_home(tmp_path, gate, api_key)
    done = run(gate, tmp_path, [str(bins / "codex"), "exec", "--skip-git-repo-check", "What is 2+2?"], env, 120)
    assert "ran out of room in the model's context window" in done.stderr + done.stdout, done.stderr
    (sent,) = gate.to("/v1/responses")[:1]
    error = json.loads(sent.body())["error"]
    assert (sent.status, error["code"], error["param"]) == (400, "context_length_exceeded", "input")
    kinds = {tool["type"] for tool in sent.json()["tools"]}
    assert {"function", "namespace", "web_search"} <= kinds and "client_metadata" in sent.json()


def test_claude_code_answers_and_runs_a_tool_round_trip(
    bins: Path, big: tuple[Server, str], gate_to: Any, tmp_path: Path
) -> None:
    """A plain question answered (streamed: Claude Code always streams), then a tool round trip: the
    model calls Read, Claude Code runs it and sends its result back, the model answers again."""
    server, key = big
    gate = gate_to(server)
    env = page_env("claude-code.md", gate, key)
    claude = [str(bins / "claude"), "--model", MODEL, "--output-format", "json"]
    plain = run(gate, tmp_path / "plain", [*claude, "-p", "What is the capital of France?", "--tools", ""], env, 600)
    answer = json.loads(plain.stdout)
    assert not answer["is_error"] and answer["result"].strip(), answer
    (asked,) = gate.to("/v1/messages")
    streamed = [event["type"] for event in events(asked)]
    assert asked.status == 200 and streamed[0] == "message_start" and streamed[-1] == "message_stop"
    assert streamed.count("content_block_delta") >= 1

    folder = tmp_path / "tools"
    (folder / "work").mkdir(parents=True)
    (folder / "work" / "notes.txt").write_text("The meeting is at 10 o'clock.\n")
    before = len(gate.to("/v1/messages"))
    asked_to_read = "Read the file notes.txt and tell me what it says."
    run(gate, folder, [*claude, "-p", asked_to_read, "--tools", "Read", "--max-turns", "2"], env, 600)
    first, second = gate.to("/v1/messages")[before : before + 2]
    assert first.status == 200 and second.status == 200
    used = [event["content_block"] for event in events(first) if event["type"] == "content_block_start"]
    calls = [block for block in used if block["type"] == "tool_use"]
    assert calls and calls[0]["name"] == "Read"
    assert len({json.dumps(call, sort_keys=True) for call in calls}) == len(calls)  # no call repeated
    results = [block for message in second.json()["messages"] if isinstance(message["content"], list)
               for block in message["content"] if block.get("type") == "tool_result"]  # fmt: skip
    assert [result["tool_use_id"] for result in results] == [call["id"] for call in calls]
    assert "The meeting is at 10" in json.dumps(results[0]["content"])  # the file, read by Claude Code
    assert [event["type"] for event in events(second)][-1] == "message_stop"


def test_codex_answers_and_its_tool_calls_round_trip(
    bins: Path, big: tuple[Server, str], gate_to: Any, tmp_path: Path
) -> None:
    """Codex's default request, taken and answered on the Responses API (it always streams). The
    embedded model, offered Codex's tools, calls one; Codex runs it and sends its output back, turn
    after turn (the model never stops calling: the test stops Codex after two answers)."""
    server, key = big
    gate = gate_to(server)
    env = codex_home(tmp_path, gate, key)
    args = [str(bins / "codex"), "exec", "--skip-git-repo-check", "What is 2+2?"]
    done = run(gate, tmp_path, args, env, 600, until=lambda: len(answered(gate, "/v1/responses")) >= 2)
    sent = answered(gate, "/v1/responses")
    refused = [(exchange.body()[:300], refused_item(exchange)) for exchange in sent if exchange.status != 200]
    assert not refused, refused[0]
    assert len(sent) >= 2, done.stderr[-3000:]
    first = events(sent[0])
    kinds = [event["type"] for event in first]
    # Kept alive while its 9,000 tokens were read (minutes here; Codex gives up on 300 s without an event).
    assert kinds[-1] == "response.completed" and kinds.count("response.in_progress") >= 3, kinds[:8]
    calls = [item for item in first[-1]["response"]["output"] if item["type"] == "function_call"]
    outputs = [item for item in sent[1].json()["input"] if item.get("type") == "function_call_output"]
    assert calls and [item["call_id"] for item in outputs[: len(calls)]] == [call["call_id"] for call in calls]


def refused_item(exchange: Exchange) -> Any:
    """The part of a refused request its error names (`input.6.call_id`: input item 6)."""
    found: Any = exchange.json()
    for part in str(json.loads(exchange.body())["error"].get("param") or "").split(".")[:2]:
        found = found[int(part)] if part.isdigit() and isinstance(found, list) else found.get(part, found)
    return found


def answered(gate: Gate, path: str) -> list[Exchange]:
    return [exchange for exchange in gate.to(path) if exchange.status]


AIDER_FLAGS = ["--yes-always", "--no-git", "--no-check-update", "--no-show-model-warnings", "--analytics-disable"]


def test_aider_answers_and_a_too_long_prompt_is_refused_at_once_as_a_full_context(
    aider: Path, server: Server, api_key: str, big: tuple[Server, str], gate_to: Any, tmp_path: Path
) -> None:
    """A plain question answered (streamed, as aider asks), and a prompt over the session server's
    1,024-token context refused at once, in the words litellm reads as a full context window."""
    big_server, big_key = big
    gate = gate_to(big_server)
    command = [str(aider), "--model", f"openai/{MODEL}", *AIDER_FLAGS]
    plain = run(
        gate, tmp_path / "plain", [*command, "--message", "What is 2+2?"], page_env("aider.md", gate, big_key), 600
    )
    assert plain.returncode == 0, plain.stdout[-3000:]
    (asked,) = gate.to("/v1/chat/completions")
    assert asked.status == 200 and asked.json()["stream"] and asked.body().rstrip().endswith(b"data: [DONE]")
    assert events(asked)[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "Tokens:" in plain.stdout  # aider's count of what was sent and received

    small = gate_to(server)
    long = "The quick brown fox jumps over the lazy dog. " * 120  # about 1,200 tokens
    refused = run(small, tmp_path / "long", [*command, "--message", long], page_env("aider.md", small, api_key), 300)
    (sent,) = small.to("/v1/chat/completions")
    error = json.loads(sent.body())["error"]
    assert (sent.status, error["code"]) == (400, "context_length_exceeded")
    assert "has hit a token limit!" in refused.stdout, refused.stdout[-3000:]  # aider's own words
