"""One way to fail on the command line: one line on stderr, exit 2 for usage and configuration
errors and 1 for the rest, a traceback only with --debug."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmserver.settings import ModelConfig, load_settings


def llmserver(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmserver", *args],
        capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}, check=False,
    )  # fmt: skip


def one_line(ran: subprocess.CompletedProcess[str], status: int, *words: str) -> str:
    assert ran.returncode == status, (ran.returncode, ran.stdout, ran.stderr)
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), ran.stderr
    assert all(word in lines[0] for word in words), lines[0]
    return lines[0]


def test_a_config_with_a_toml_syntax_error(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("server.port = \n")
    for command in (["config"], ["keys", "list"], ["serve", "--port", "1"]):
        one_line(llmserver(*command, "--config", str(config), "--data-dir", str(tmp_path)), 2, "not valid TOML")


def test_serve_with_a_missing_model_file(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[[models]]\nname = "x"\npath = "/no/such/model.gguf"\n')
    one_line(llmserver("serve", "--config", str(config), "--data-dir", str(tmp_path)), 2, "/no/such/model.gguf")


def test_usage_errors_are_status_2(tmp_path: Path) -> None:
    one_line(llmserver("models", "pull", "foo", "--data-dir", str(tmp_path)), 2, "NAMES", "'foo'")
    one_line(llmserver("keys", "frob"), 2, "frob")
    one_line(llmserver("ask", "hi", "--url", "http://127.0.0.1:9"), 2, "API key")


def test_an_unreachable_server_is_status_1_without_a_traceback() -> None:
    for command in (["ask", "--key", "k", "hi"], ["instances", "--key", "k"]):
        line = one_line(llmserver(*command, "--url", "http://127.0.0.1:9"), 1, "cannot reach llmserver at")
        assert "connection_error" not in line and " 0 " not in line


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[[models]]\nname = "x"\npath = "/no/such/model.gguf"\n')
    ran = llmserver("serve", "--config", str(config), "--data-dir", str(tmp_path), env={"LLMSERVER_DEBUG": "1"})
    assert ran.returncode != 0 and "Traceback" in ran.stderr


def test_hf_hub_offline_says_so(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[[models]]\nname = "q"\nhf_repo = "a/b"\nhf_file = "c.gguf"\n')
    ran = llmserver(
        "models", "pull", "q", "--config", str(config), "--data-dir", str(tmp_path), env={"HF_HUB_OFFLINE": "1"}
    )
    line = one_line(ran, 1, "HF_HUB_OFFLINE is set")
    assert "online" not in line


@pytest.mark.parametrize("cpus", [2])
def test_models_from_the_command_line_share_the_cpus_again(cpus: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("llmserver.settings.default_threads", lambda: cpus)
    configured = load_settings().models
    assert configured[0].threads == cpus  # one model: all the CPUs
    both = load_settings(models=[configured[0], ModelConfig(name="b", path=Path("/x/b.gguf"))]).models
    assert [m.threads for m in both] == [1, 1]  # two: shared out again
    fixed = load_settings(models=[ModelConfig(name="c", threads=2), ModelConfig(name="b", path=Path("/x/b.gguf"))])
    assert [m.threads for m in fixed.models] == [2, 1]  # a configured value stays


def test_keys_update_changes_only_what_it_names(tmp_path: Path) -> None:
    created = llmserver("keys", "create", "--name", "k", "--quota-tokens", "300", "--quota-period", "day",
                        "--rpm", "5", "--data-dir", str(tmp_path))  # fmt: skip
    assert created.returncode == 0, created.stderr
    key_id = created.stderr.split("key ")[1].split(" ")[0]
    assert llmserver("keys", "update", key_id, "--rpm", "100", "--data-dir", str(tmp_path)).returncode == 0
    listed = json.loads(llmserver("keys", "list", "--json", "--data-dir", str(tmp_path)).stdout)
    assert (listed[0]["rpm"], listed[0]["quota_tokens"], listed[0]["quota_period"]) == (100, 300, "day")
    assert set(listed[0]) == {"id", "name", "fingerprint", "admin", "created_at", "revoked_at", "expires_at",
                              "last_used_at", "previous_valid_until", "quota_tokens", "quota_period", "rpm",
                              "max_concurrency", "models", "budget", "budget_period", "team_id",
                              "team_admin"}  # fmt: skip  # the API's shape
    cleared = llmserver("keys", "update", key_id, "--clear", "quota", "--data-dir", str(tmp_path))
    assert cleared.returncode == 0, cleared.stderr
    listed = json.loads(llmserver("keys", "list", "--json", "--data-dir", str(tmp_path)).stdout)
    assert (listed[0]["rpm"], listed[0]["quota_tokens"], listed[0]["quota_period"]) == (100, None, None)
    one_line(llmserver("keys", "update", key_id, "--quota-tokens", "5", "--data-dir", str(tmp_path)), 2, "period")


def test_extract_over_the_file_limit_says_413(tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * (15 * 1024 * 1024 + 1))
    one_line(llmserver("extract", str(big), "--data-dir", str(tmp_path)), 1, "big.txt", "(413 request_too_large)")


def test_extract_under_a_tmpdir_too_long_for_a_socket_path(tmp_path: Path) -> None:
    """The converters' forkserver listens on a UNIX socket (at most 107 bytes of path) under TMPDIR: a long one
    used to stop `extract` with "AF_UNIX path too long"; the socket and the private folder go under /tmp then."""
    temp = tmp_path / ("t" * 80)
    temp.mkdir()
    note = tmp_path / "note.txt"
    note.write_text("Quarterly figures: 42 widgets.\n")
    ran = llmserver("extract", str(note), "--data-dir", str(tmp_path), env={"TMPDIR": str(temp)})
    assert ran.returncode == 0, ran.stderr
    assert "Quarterly figures: 42 widgets." in ran.stdout
    assert list(temp.iterdir()) == []


def test_a_node_on_the_network_needs_a_key_and_tls_unless_told_the_network_is_trusted(tmp_path: Path) -> None:
    # 192.0.2.1 (TEST-NET-1) is never bound: each refusal comes before any instance is started.
    node = ["node", "--advertise", "192.0.2.1", "--redis-url", "redis://127.0.0.1:1/0", "--data-dir", str(tmp_path)]
    one_line(llmserver(*node), 2, "without a key", "[instances] api_key", "LLMSERVER_INSTANCES__API_KEY")
    # On loopback too: its gateways reach its instances with the key, and no other local process may.
    loopback = ["node", "--redis-url", "redis://127.0.0.1:1/0", "--data-dir", str(tmp_path)]
    one_line(llmserver(*loopback), 2, "on 127.0.0.1 without a key", "[instances] api_key")
    keyed = {"LLMSERVER_INSTANCES__API_KEY": "k" * 32}
    one_line(llmserver(*node, env=keyed), 2, "in clear", "tls_cert and tls_key in [instances]", "plain_http")
    half = {**keyed, "LLMSERVER_INSTANCES__TLS_CERT": str(tmp_path / "cert.pem")}
    one_line(llmserver(*node, env=half), 2, "instances: Value error, tls_cert and tls_key go together")


def test_an_unknown_setting_names_the_one_it_may_mean(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[[models]]\nname = "a"\nctx = 1024\n')
    one_line(llmserver("config", "--config", str(config)), 2, "models.0.ctx", "did you mean ctx_size?")
