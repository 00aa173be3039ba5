"""The deployment files under deploy/ against their specifications and against the code: the Kubernetes
manifests validated with kubernetes-validate against a pinned Kubernetes version, the compose file
against the compose specification's JSON schema (fetched from the docker-compose package at test
time), the compose stack's Prometheus configuration with promtool; and in all of them, every
`LLMSERVER_*` name a real setting, every command one the CLI takes, every probe a real path on the
port that serves it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import click
import jsonschema
import kubernetes_validate
import pytest
import yaml

from llmserver.cli import cli
from llmserver.settings import NodeSettings, env_name, setting_paths

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBERNETES_VERSION = "1.30.0"  # pinned: the oldest minor version still maintained when these were written
COMPOSE_SCHEMA_FROM = "docker-compose==1.29.2"  # its wheel carries the compose specification's schema
NOT_SETTINGS = {"LLMSERVER_DEBUG"}  # read by the CLI itself (`llmserver --debug`)
SETTINGS = {env_name(path) for path in setting_paths()} | NOT_SETTINGS  # the new names: no deprecation line
GATEWAY_PATHS = {"/health", "/ready", "/metrics"}
NODE_PATHS = {"/health", "/ready", "/metrics"}  # cluster/node_http.py


def manifests() -> list[tuple[str, dict[str, Any]]]:
    return [
        (path.name, document)
        for path in sorted((DEPLOY / "kubernetes").glob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
        if document
    ]


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    return loaded


def parses(args: list[str]) -> None:
    """`llmserver ARGS` as the CLI would read it (nothing run): an unknown command or option, or a bad
    value, fails the test."""
    command: click.Command = cli
    while isinstance(command, click.Group):
        name, *args = args
        found = command.get_command(click.Context(command), name)
        assert found is not None, f"llmserver has no command {name!r}"
        command = found
    command.make_context(command.name or "", list(args))


@pytest.mark.parametrize(("name", "document"), manifests(), ids=lambda value: value if isinstance(value, str) else "")
def test_the_kubernetes_manifests_are_valid(name: str, document: dict[str, Any]) -> None:
    kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_the_kubernetes_manifests_agree_with_the_code() -> None:
    documents = [document for _, document in manifests()]
    kinds = {document["kind"] for document in documents}
    assert {"Deployment", "Service", "PodDisruptionBudget", "StatefulSet", "ConfigMap", "Secret", "Job"} <= kinds
    names: set[str] = set()
    for document in documents:
        names |= set(document.get("data", {})) | set(document.get("stringData", {}))
        pod = document.get("spec", {}).get("template", {}).get("spec")
        for container in (pod or {}).get("containers", []):
            names |= {variable["name"] for variable in container.get("env", [])}
            parses(container["args"])
            ports = {port["name"]: port["containerPort"] for port in container.get("ports", [])}
            role = container["args"][0]
            for probe in ("readinessProbe", "livenessProbe"):
                if probe not in container:
                    continue
                check = container[probe]["httpGet"]
                port = ports[check["port"]] if isinstance(check["port"], str) else check["port"]
                if role == "serve":
                    assert check["path"] in GATEWAY_PATHS and port == int(container["args"][-1])
                else:
                    assert role == "node" and check["path"] in NODE_PATHS
                    assert port == NodeSettings.model_fields["port"].default
    llmserver_names = {name for name in names if name.startswith("LLMSERVER_")}
    assert llmserver_names - SETTINGS == set()
    assert {"LLMSERVER_STATE__DATABASE_URL", "LLMSERVER_STATE__REDIS_URL", "LLMSERVER_ADMIN_KEY",
            "LLMSERVER_INSTANCES__API_KEY", "LLMSERVER_INSTANCES__HOST", "LLMSERVER_NODE__ID",
            "LLMSERVER_STATE__GATEWAY_ID"} <= llmserver_names  # fmt: skip


@pytest.fixture(scope="module")
def compose_schema(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("compose-schema")
    fetched = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
         "--dest", str(folder), COMPOSE_SCHEMA_FROM],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert fetched.returncode == 0, fetched.stderr
    (wheel,) = folder.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        schema: dict[str, Any] = json.loads(archive.read("compose/config/compose_spec.json"))
    return schema


def test_the_compose_file_follows_the_compose_specification(compose_schema: dict[str, Any]) -> None:
    # Its `$schema` names draft 2019-09 with a trailing `#` that jsonschema does not look up: say which.
    validator = jsonschema.Draft201909Validator(compose_schema)
    validator.validate(compose())
    broken = {**compose(), "services": {"gateway": {"image": "x", "depends_on": {"db": {"condition": "whenever"}}}}}
    with pytest.raises(jsonschema.ValidationError):  # the check can fail
        validator.validate(broken)


def test_the_compose_stack_agrees_with_the_code() -> None:
    services = compose()["services"]
    assert {"postgres", "redis", "migrate", "node-1", "node-2", "gateway-1", "gateway-2", "prometheus"} <= set(services)
    for name, service in services.items():
        if service.get("image", "").startswith("${LLMSERVER_IMAGE"):
            parses(service["command"])
            assert set(service["environment"]) - SETTINGS == set(), name
            probe = " ".join(service.get("healthcheck", {}).get("test", []))
            for path in re.findall(r"http://127\.0\.0\.1:(\d+)(/\w+)", probe):
                port, where = int(path[0]), path[1]
                assert where in GATEWAY_PATHS if port == 8000 else (port == 8081 and where in NODE_PATHS), probe
    # The ordering: schema first, then the gateways; the nodes once Redis answers.
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["gateway-1"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["node-1"]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_the_compose_stack_s_prometheus_configuration_checks(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool is not None, "promtool is missing: scripts/setup.sh --test installs Debian's prometheus"
    (tmp_path / "token").write_text("t")
    config = (DEPLOY / "compose" / "prometheus.yml").read_text().replace("/prometheus/token", str(tmp_path / "token"))
    (tmp_path / "prometheus.yml").write_text(config)
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    checked = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                             text=True, timeout=60, check=False)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    targets = yaml.safe_load(config)["scrape_configs"]
    hosts = {target.split(":")[0] for job in targets for group in job["static_configs"] for target in group["targets"]}
    assert hosts == {"gateway-1", "gateway-2", "node-1", "node-2"} <= set(compose()["services"])


def test_the_systemd_units_set_only_real_settings() -> None:
    for unit in (DEPLOY / "systemd").glob("*.service"):
        names = set(re.findall(r"\b(LLMSERVER_[A-Z_]+)=", unit.read_text()))
        assert names and names - SETTINGS == set(), unit.name
        command = re.search(r"^ExecStart=\S+ (.*)$", unit.read_text(), re.M)
        assert command is not None
        parses(command[1].split())


def test_the_containerfile_agrees_with_the_compose_stack_and_the_manifests() -> None:
    """What the other files rely on the image for (tests/e2e/test_container.py builds and runs it)."""
    text = (DEPLOY / "container" / "Containerfile").read_text()
    assert 'ENTRYPOINT ["llmserver"]' in text and "LLMSERVER_DATA_DIR=/data" in text and "VOLUME /data" in text
    uid = re.search(r"--uid (\d+)", text)
    assert uid is not None
    for _, document in manifests():
        pod = document.get("spec", {}).get("template", {}).get("spec")
        if pod and pod.get("containers"):
            assert pod["securityContext"]["runAsUser"] == int(uid[1])
            mounts = {m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
            assert "/data" in mounts or document["kind"] == "Job", document["metadata"]["name"]
    for name, service in compose()["services"].items():
        if name.startswith(("node-", "gateway-")):
            assert any(volume.endswith(":/data") for volume in service["volumes"]), name
    health = re.search(r"HEALTHCHECK.*?'/health'", text, re.S)
    assert health is not None and "/health" in GATEWAY_PATHS
