"""The alert rules and the dashboard shipped for operators (deploy/): checked and unit-tested by
Prometheus's own promtool. That the metrics they name exist is checked against real gateways and
nodes (tests/e2e/test_worker_hosts.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
PROMTOOL = shutil.which("promtool")


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None, "promtool is missing: `bash scripts/setup.sh --test` installs Debian's prometheus"
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


def test_the_alert_rules_are_valid_and_pass_their_unit_tests() -> None:
    checked = promtool("check", "rules", "alerts.yml", cwd=DEPLOY / "prometheus")
    assert checked.returncode == 0 and "SUCCESS: 10 rules found" in checked.stdout, checked.stdout + checked.stderr
    tested = promtool("test", "rules", "alerts_test.yml", cwd=DEPLOY / "prometheus")
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_a_broken_expectation_fails_the_unit_tests(tmp_path: Path) -> None:
    """The unit tests can fail: one expected alert left out, and promtool says so."""
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", tmp_path)
    tests = (DEPLOY / "prometheus" / "alerts_test.yml").read_text()
    (tmp_path / "alerts_test.yml").write_text(tests.replace('summary: "Node node-1:8081 is gone"', 'summary: "x"'))
    assert promtool("test", "rules", "alerts_test.yml", cwd=tmp_path).returncode != 0


def test_the_sample_prometheus_configuration_is_valid(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("metrics-token\n")
    config = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    (tmp_path / "prometheus.yml").write_text(config.replace("/etc/prometheus/llmserver-metrics-token", str(token)))
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", tmp_path)
    checked = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def shipped_metric_names() -> set[str]:
    """The metric families the alert rules and the dashboard query (without _total, _bucket, ...)."""
    text = (DEPLOY / "prometheus" / "alerts.yml").read_text()
    dashboard = json.loads((DEPLOY / "grafana" / "llmserver.json").read_text())
    text += "\n".join(t["expr"] for panel in dashboard["panels"] for t in panel["targets"])
    return {re.sub(r"_(total|bucket|count|sum)$", "", name) for name in re.findall(r"\bllmserver_[a-z_]+", text)}


def test_the_dashboard_is_grafana_json_with_queries() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "llmserver.json").read_text())
    assert dashboard["uid"] and dashboard["panels"]
    assert all(panel["targets"] and all(t["expr"] for t in panel["targets"]) for panel in dashboard["panels"])
    assert {"llmserver_component_up", "llmserver_requests", "llmserver_queue_depth"} <= shipped_metric_names()
