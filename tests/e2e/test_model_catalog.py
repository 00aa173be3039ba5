"""The model catalog on one host (role `all`), against a real server: models added, changed and removed
through the admin API and `llmserver models`, a changed setting rolled out under a steady load of
streamed requests without one failing, a removed model answered 404, and the rules between the
config file and the catalog (models/catalog.py)."""

from __future__ import annotations

import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from llmserver.models.files import embedded_model_path
from tests.support import (
    MODEL,
    TEST_DATABASE,
    Server,
    SteadyStreams,
    assert_error,
    cli,
    make_key,
    metric,
    shared_servers,
    stream,
    wait_for,
)

FILE_MODEL = f"""
[[models]]
name = "{MODEL}"
parallel = 1
ctx_size = 512
threads = 1
"""
# The file's models are rows of the catalog on one host's SQLite; a gateway of role `all` on PostgreSQL
# (this suite's second pass) keeps them out of the catalog other gateways share (models/catalog.py).
FILE_ROWS = TEST_DATABASE != "postgresql"
B = {"name": "b", "min_instances": 1, "parallel": 2, "ctx_size": 512, "threads": 1}


def admin_call(server: Server, admin: str, method: str, path: str, body: object = None) -> httpx.Response:
    return httpx.request(
        method, server.url + path, json=body, headers={"Authorization": f"Bearer {admin}"}, timeout=120
    )


def live(server: Server, admin: str, model: str) -> list[dict[str, Any]]:
    answer = admin_call(server, admin, "GET", "/api/instances")
    return [i for i in answer.json()["data"] if i["model"] == model and i["status"] != "stopped"]


def context_of(server: Server, instance: dict[str, Any]) -> int:
    """The context llama-server itself says the instance runs with (its /props)."""
    props = httpx.get(f"http://{instance['host']}:{instance['port']}/props", headers=server.instance_headers).json()
    return int(props["default_generation_settings"]["n_ctx"])


def test_models_added_changed_and_removed_through_the_api(start_server: Callable[..., Server]) -> None:
    server = start_server(FILE_MODEL)
    admin = make_key(server.data_dir, "admin", admin=True)
    user = make_key(server.data_dir, "user")

    listed = admin_call(server, admin, "GET", "/api/models").json()["data"]
    if FILE_ROWS:
        assert [(m["name"], m["origin"], m["revision"]) for m in listed] == [(MODEL, "file", 1)]
        assert listed[0]["settings"]["ctx_size"] == 512 and listed[0]["ready_instances"] == 1
    else:  # a gateway of role `all` on PostgreSQL keeps its own file's models out of the shared catalog
        assert listed == []

    added = admin_call(server, admin, "POST", "/api/models", B)
    assert added.status_code == 201, added.text
    assert added.json()["origin"] == "api" and added.json()["settings"]["parallel"] == 2
    assert wait_for(lambda: any(i["status"] == "ready" for i in live(server, admin, "b")), 60), server.log()
    assert stream(server, user, "b") is None
    names = {m["id"] for m in httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {user}"})
             .json()["data"]}  # fmt: skip
    assert names == {MODEL, "b"}

    # What the catalog refuses, each in the envelope.
    assert_error(admin_call(server, admin, "POST", "/api/models", B), 409, "conflict_error", "name")
    assert_error(admin_call(server, admin, "POST", "/api/models", {**B, "name": "c", "parallel": 0}), 400,
                 "invalid_request_error", "parallel")  # fmt: skip
    assert_error(admin_call(server, admin, "POST", "/api/models", {**B, "name": "c", "colour": "red"}), 400,
                 "invalid_request_error", "colour")  # fmt: skip
    refused = admin_call(server, admin, "POST", "/api/models", {**B, "name": "c", "llama_server_args": ["--port", "1"]})
    assert_error(refused, 400, "invalid_request_error", "llama_server_args")
    refusal = (409, "conflict_error") if FILE_ROWS else (404, "not_found_error")  # the file's, not the API's
    assert_error(admin_call(server, admin, "PATCH", f"/api/models/{MODEL}", {"parallel": 2}), *refusal)
    assert_error(admin_call(server, admin, "DELETE", f"/api/models/{MODEL}"), *refusal)
    assert_error(admin_call(server, admin, "PATCH", "/api/models/nope", {"parallel": 2}), 404, "not_found_error")
    assert_error(admin_call(server, admin, "PATCH", "/api/models/b", {"name": "c"}), 400, "invalid_request_error")
    assert_error(
        httpx.post(server.url + "/api/models", json={**B, "name": "d"}, headers={"Authorization": f"Bearer {user}"}),
        403, "permission_error",
    )  # fmt: skip

    # A setting that needs no restart: taken at once, the same instance serving on.
    before = live(server, admin, "b")
    changed = admin_call(server, admin, "PATCH", "/api/models/b", {"max_queue": 8})
    assert changed.status_code == 200 and changed.json()["revision"] == 2, changed.text
    assert [i["pid"] for i in live(server, admin, "b")] == [i["pid"] for i in before]

    # One that does: rolled out under a steady load of streams, none of them failing.
    assert context_of(server, before[0]) == 512
    with SteadyStreams([server] * 3, user, "b") as load:
        assert load.reach(3)
        rolled = admin_call(server, admin, "PATCH", "/api/models/b", {"ctx_size": 1024})
        assert rolled.status_code == 200 and rolled.json()["settings"]["ctx_size"] == 1024, rolled.text

        def rolled_over() -> bool:
            now = live(server, admin, "b")
            return len(now) == 1 and now[0]["status"] == "ready" and now[0]["pid"] != before[0]["pid"]

        assert wait_for(rolled_over, 90), server.log()
        assert load.reach(load.done + 3)  # and the new one serves the load
    assert load.failures == [] and load.done >= 6, load.failures
    assert context_of(server, live(server, admin, "b")[0]) == 1024  # a slot's context, as ctx_size says

    # Removed: its requests are answered 404, its instance stops.
    removed = admin_call(server, admin, "DELETE", "/api/models/b")
    assert removed.status_code == 200 and removed.json()["name"] == "b"
    gone = httpx.post(server.url + "/api/generate", json={"model": "b", "prompt": "hi", "max_tokens": 2},
                      headers={"Authorization": f"Bearer {user}"}, timeout=60)  # fmt: skip
    assert_error(gone, 404, "model_not_found", "model")
    assert wait_for(lambda: live(server, admin, "b") == [], 30)
    assert [m["name"] for m in admin_call(server, admin, "GET", "/api/models").json()["data"]] == FILE_ROWS * [MODEL]


def test_the_cli_manages_the_catalog_and_a_file_that_disagrees_is_refused(start_server: Callable[..., Server]) -> None:
    server = start_server(FILE_MODEL)
    admin = make_key(server.data_dir, "admin", admin=True)
    data = server.data_dir
    added = cli(data, "models", "add", "c", "--set", "min_instances=0", "--set", "parallel=1", "--set", "ctx_size=512")
    assert added.returncode == 0 and added.stdout.startswith("c  revision 1  (api)"), added.stderr
    # A running gateway serves what the CLI wrote within its next read of the catalog.
    assert wait_for(lambda: "c" in server_models(server, admin), 10)
    updated = cli(data, "models", "update", "c", "--set", "ctx_size=1024", "--reset", "parallel")
    assert updated.returncode == 0 and "revision 2" in updated.stdout and '"ctx_size":1024' in updated.stdout
    assert '"parallel"' not in updated.stdout  # back to its default, so not stored
    bad = cli(data, "models", "update", "c", "--set", "ctx_size=12")
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [
        "Error: ctx_size: Input should be greater than or equal to 128"
    ]
    assert cli(data, "models", "remove", MODEL).returncode == 1  # from the config file: change it there
    listed = cli(data, "models", "list")
    assert [line.split()[0] for line in listed.stdout.splitlines()] == [*FILE_ROWS * [MODEL], "c"]
    server.stop()

    # The file names `c`, which the API added with other settings: which is meant? Refused, in one line.
    conflicting = FILE_MODEL + '\n[[models]]\nname = "c"\nparallel = 3\n'
    (data / "config.toml").write_text(conflicting)
    refused = cli(data, "serve", "--config", str(data / "config.toml"), "--port", "1")
    assert refused.returncode == 1, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        "Error: the model 'c' is in the config file and was added through the API with other settings "
        "(ctx_size, min_instances, parallel): remove it from one of them (`llmserver models remove c`, or the file)"
    ]
    # A model the file no longer names leaves the catalog at the next start; the API's stay.
    renamed = FILE_MODEL.replace(f'name = "{MODEL}"', 'name = "renamed"')
    restarted = start_server(renamed, data_dir=data)
    assert sorted(server_models(restarted, admin)) == ["c", *FILE_ROWS * ["renamed"]]


def server_models(server: Server, admin: str) -> list[str]:
    return [m["name"] for m in admin_call(server, admin, "GET", "/api/models").json()["data"]]


def test_a_model_added_with_a_file_that_is_not_there_is_refused_at_once(start_server: Callable[..., Server]) -> None:
    server = start_server(FILE_MODEL)
    admin = make_key(server.data_dir, "admin", admin=True)
    missing = str(server.data_dir / "models" / "nowhere.gguf")  # in an allowed directory, but not there
    answer = admin_call(server, admin, "POST", "/api/models", {**B, "name": "missing", "path": missing})
    error = assert_error(answer, 400, "invalid_request_error")
    assert error["param"] == "path" and missing in str(error["message"])
    assert "missing" not in server_models(server, admin)


def test_a_model_whose_file_went_away_never_stops_a_start(start_server: Callable[..., Server]) -> None:
    """A catalog row that cannot run is that model's problem: the server starts and serves the others, the
    row says why (/api/models, /ready's detail, a 503 at once), and it serves again once its file is back."""
    server = start_server(FILE_MODEL)
    data = server.data_dir
    admin = make_key(data, "admin", admin=True)
    copy = data / "models" / "copy.gguf"
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(embedded_model_path(), copy)
    body = {**B, "name": "copy", "path": str(copy)}
    assert admin_call(server, admin, "POST", "/api/models", body).status_code == 201
    assert wait_for(lambda: [i["status"] for i in live(server, admin, "copy")] == ["ready"], 60)
    server.stop()
    copy.rename(copy.with_suffix(".away"))  # gone while the server was down
    restarted = start_server(FILE_MODEL, data_dir=data)  # ready: MODEL serves (start_server waits for /ready)
    row = admin_call(restarted, admin, "GET", "/api/models/copy").json()
    assert "not found" in str(row["blocked"]) and str(copy) in str(row["blocked"])
    ready = httpx.get(restarted.url + "/ready").json()
    assert ready["models"] == {MODEL: True, "copy": False} and str(copy) in ready["problems"]["copy"][0]
    assert metric(restarted, admin, "llmserver_model_blocked", model="copy") == 1
    started_at = time.monotonic()
    answer = httpx.post(restarted.url + "/api/generate", json={"model": "copy", "prompt": "hi", "max_tokens": 2},
                        headers={"Authorization": f"Bearer {admin}"}, timeout=120)  # fmt: skip
    error = assert_error(answer, 503, "overloaded_error")  # at once: no instance can be started to wait for
    assert str(copy) in str(error["message"]) and time.monotonic() - started_at < 5
    copy.with_suffix(".away").rename(copy)  # back: found again within the backoff (5 s, then doubling)
    assert wait_for(lambda: httpx.get(restarted.url + "/ready").json()["models"].get("copy") is True, 60)
    assert admin_call(restarted, admin, "GET", "/api/models/copy").json()["blocked"] is None
    assert metric(restarted, admin, "llmserver_model_blocked", model="copy") == 0


def test_a_start_that_fails_says_why_with_the_instance_s_last_log_lines(start_server: Callable[..., Server]) -> None:
    """A GGUF whose header is damaged is that model's problem at once (blocked, saying so; the server's
    other models serve on). One whose header reads but that llama-server cannot load (no tensors): its
    instance fails to start, and the model's record and /api/instances say when, why, and what
    llama-server wrote last."""
    server = start_server(FILE_MODEL)
    admin = make_key(server.data_dir, "admin", admin=True)
    folder = server.data_dir / "models"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "damaged.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 64)  # a string "longer" than the file
    (folder / "empty.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))  # version 3, nothing in it
    for name in ("damaged", "empty"):
        body = {**B, "name": name, "path": str(folder / f"{name}.gguf")}
        assert admin_call(server, admin, "POST", "/api/models", body).status_code == 201

    def blocked() -> str:
        return str(admin_call(server, admin, "GET", "/api/models/damaged").json()["blocked"] or "")

    assert wait_for(lambda: "not a readable GGUF file" in blocked(), 30), server.log()[-3000:]
    assert "damaged" in blocked()

    def failed() -> dict[str, Any] | None:
        record: dict[str, Any] = admin_call(server, admin, "GET", "/api/models/empty").json()
        return record["last_start_failure"]  # type: ignore[no-any-return]

    assert wait_for(failed, 60), server.log()[-3000:]
    failure = failed()
    assert failure is not None and failure["node"] is None and "exited with code" in failure["message"]
    assert any("gguf" in line.lower() or "model" in line.lower() for line in failure["log"]), failure["log"]
    assert abs(failure["at"] - time.time()) < 120
    listed = admin_call(server, admin, "GET", "/api/instances").json()["models"]
    summary = next(m for m in listed if m["model"] == "empty")
    assert summary["last_start_failure"]["instance_id"] == failure["instance_id"]
    listed_cli = cli(server.data_dir, "models", "list", "--status", "--url", server.url, "--key", admin)
    assert listed_cli.returncode == 0, listed_cli.stderr
    shown = listed_cli.stdout
    assert "blocked: " in shown and "not a readable GGUF file" in shown  # damaged's row
    assert "last start failed at " in shown and failure["message"] in shown and failure["log"][-1] in shown
    assert stream(server, admin, MODEL) is None  # the other model serves throughout


def test_gateways_of_role_all_on_one_database_keep_their_own_models(
    start_server: Callable[..., Server], tmp_path: Path
) -> None:
    """Two gateways running their own instances on one PostgreSQL, with different config files: each
    serves its own file's models (kept out of the catalog, where the other's start would remove them)
    and the catalog's, which a model added through either reaches both."""
    postgres, shared = shared_servers()
    database_url = postgres.new_database()
    assert cli(tmp_path, "db", "migrate", env={"LLMSERVER_STATE__DATABASE_URL": database_url}).returncode == 0
    admin = "role-all-admin-key-0123456789abcdef"
    env = {
        "LLMSERVER_STATE__DATABASE_URL": database_url,
        "LLMSERVER_STATE__REDIS_URL": shared.url,
        "LLMSERVER_ADMIN_KEY": admin,
    }
    first = start_server(FILE_MODEL.replace(f'"{MODEL}"', '"first"'), data_dir=tmp_path / "a",
                         env={**env, "LLMSERVER_STATE__GATEWAY_ID": "role-all-a"})  # fmt: skip
    second = start_server(FILE_MODEL.replace(f'"{MODEL}"', '"second"'), data_dir=tmp_path / "b",
                          env={**env, "LLMSERVER_STATE__GATEWAY_ID": "role-all-b"})  # fmt: skip
    assert server_models(first, admin) == [] and server_models(second, admin) == []  # nothing of theirs written
    added = admin_call(second, admin, "POST", "/api/models", {**B, "name": "shared", "min_instances": 0})
    assert added.status_code == 201, added.text

    def serves(server: Server) -> set[str]:
        listed = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {admin}"}).json()["data"]
        return {model["id"] for model in listed}

    assert wait_for(lambda: serves(first) == {"first", "shared"}, 10), serves(first)
    assert serves(second) == {"second", "shared"}
    assert [i["model"] for i in live(first, admin, "first")] == ["first"]  # still running: the other's start left it


def test_a_model_stops_now_and_starts_again(start_server: Callable[..., Server]) -> None:
    """`llmserver models stop` (another process: the gateway follows the catalog) stops a model's instances
    now and keeps its row; its requests are answered 503 at once; the API starts it again. Lowering
    min_instances to 0 stops an idle instance at once, not after its idle_timeout (300 s)."""
    server = start_server(FILE_MODEL)
    admin = make_key(server.data_dir, "admin", admin=True)
    assert admin_call(server, admin, "POST", "/api/models", {**B, "name": "b"}).status_code == 201
    assert wait_for(lambda: [i["status"] for i in live(server, admin, "b")] == ["ready"], 60)
    stopped_at = time.monotonic()
    stopped = cli(server.data_dir, "models", "stop", "b")
    assert stopped.returncode == 0 and stopped.stdout.startswith("stopped b"), stopped.stderr
    assert wait_for(lambda: live(server, admin, "b") == [], 30)
    took = time.monotonic() - stopped_at
    row = admin_call(server, admin, "GET", "/api/models/b").json()
    assert (row["settings"]["min_instances"], row["settings"]["max_instances"], row["instances"]) == (0, 0, 0)
    answer = httpx.post(server.url + "/api/generate", json={"model": "b", "prompt": "hi", "max_tokens": 2},
                        headers={"Authorization": f"Bearer {admin}"}, timeout=30)  # fmt: skip
    assert "is stopped" in str(assert_error(answer, 503, "overloaded_error")["message"])
    started = admin_call(server, admin, "POST", "/api/models/b/start")
    counts = started.json()["settings"]
    assert started.status_code == 200 and (counts["min_instances"], counts["max_instances"]) == (1, 1)
    assert wait_for(lambda: [i["status"] for i in live(server, admin, "b")] == ["ready"], 60)
    lowered_at = time.monotonic()
    assert admin_call(server, admin, "PATCH", "/api/models/b", {"min_instances": 0}).status_code == 200
    assert wait_for(lambda: live(server, admin, "b") == [], 10)  # idle, above the new minimum: stopped now
    print(f"\nmodels stop → no instance in {took:.1f} s; min_instances 0 → idle instance gone in "
          f"{time.monotonic() - lowered_at:.1f} s")  # fmt: skip


def test_a_server_that_runs_its_instances_itself_has_no_nodes(start_server: Callable[..., Server]) -> None:
    server = start_server(FILE_MODEL)
    admin = make_key(server.data_dir, "admin", admin=True)
    assert admin_call(server, admin, "GET", "/api/nodes").json() == {"object": "list", "data": []}
    assert_error(admin_call(server, admin, "POST", "/api/nodes/worker-1/drain"), 404, "not_found_error", "node")
    listed = cli(server.data_dir, "nodes", "list", "--url", server.url, "--key", admin)
    assert listed.returncode == 0 and "no worker node" in listed.stderr, listed.stdout + listed.stderr
