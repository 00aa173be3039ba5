"""Keys made with the CLI act at once on the running server, revoked ones within key_cache_seconds (1 s);
every way to send a key works."""

from __future__ import annotations

import json
import time

import httpx

from tests.support import MODEL, Server, cli, create_key, wait_for


def test_cli_keys_take_effect_on_the_running_server(server: Server) -> None:
    key = create_key(server.data_dir, "late-comer")
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    listed = cli(server.data_dir, "keys", "list", "--json")
    (entry,) = [k for k in json.loads(listed.stdout) if k["name"] == "late-comer"]
    assert key not in listed.stdout
    revoked = cli(server.data_dir, "keys", "revoke", entry["id"])
    assert revoked.returncode == 0, revoked.stderr
    # The server reuses a key's record for key_cache_seconds (1 s): the revocation shows within it.
    revoked_at = time.monotonic()
    assert wait_for(
        lambda: httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 401, 3
    )
    assert time.monotonic() - revoked_at < 1.5
    again = cli(server.data_dir, "keys", "revoke", entry["id"])
    assert again.returncode != 0 and "no active key" in again.stderr


def test_key_in_body_query_or_header(server: Server, api_key: str) -> None:
    body = {"prompt": "hi", "max_tokens": 1}
    assert httpx.post(server.url + "/api/generate", json={**body, "api_key": api_key}, timeout=60).status_code == 200
    assert (
        httpx.post(server.url + "/api/generate", params={"api_key": api_key}, json=body, timeout=60).status_code == 200
    )
    assert httpx.get(server.url + "/v1/models", params={"api_key": api_key}).status_code == 200


def test_keys_never_reach_the_log(server: Server, api_key: str) -> None:
    httpx.get(server.url + "/v1/models", params={"api_key": api_key})
    log = server.log()
    assert "GET /v1/models 200" in log
    assert api_key not in log


def test_an_admin_key_travels_like_any_key(server: Server) -> None:
    """The README's rule holds for admin endpoints too: header, query string, or `api_key` in the body."""
    admin = create_key(server.data_dir, "admin-anywhere", admin=True)
    made = httpx.post(server.url + "/api/keys", json={"name": "made-with-body-key", "api_key": admin})
    assert made.status_code == 201, made.text
    assert made.json()["name"] == "made-with-body-key" and "api_key" not in made.json()
    changed = httpx.patch(server.url + f"/api/keys/{made.json()['id']}", json={"rpm": 7, "api_key": admin})
    assert changed.status_code == 200 and changed.json()["rpm"] == 7
    assert httpx.get(server.url + "/api/keys", params={"api_key": admin}).status_code == 200
    # A key that is not an admin key is still refused wherever it travels.
    user = create_key(server.data_dir, "not-admin")
    refused = httpx.post(server.url + "/api/keys", json={"name": "x", "api_key": user})
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
    assert httpx.post(server.url + "/api/keys", json={"name": "x"}).status_code == 401


def test_an_allow_list_must_name_models_the_server_has_and_each_refusal_names_its_field(server: Server) -> None:
    """A typo in a key's model list would make a key every request refuses: refused at `models`, as is an
    empty entry (never read as every model); a quota and its period are each refused at the one missing."""
    admin = {"Authorization": f"Bearer {create_key(server.data_dir, 'allow-lists', admin=True)}"}
    url = server.url + "/api/keys"

    def refused(body: dict[str, object], param: str, method: str = "POST", to: str = url) -> str:
        answer = httpx.request(method, to, json=body, headers=admin)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param)
        return str(error["message"])

    message = refused({"name": "typo", "models": [MODEL, "no-such-model"]}, "models")
    assert "'no-such-model' matches no model" in message and MODEL in message  # names what there is
    assert "'zz*'" in refused({"name": "pattern", "models": ["zz*"]}, "models")  # a pattern that matches nothing
    refused({"name": "empty", "models": [""]}, "models")
    assert "needs a period" in refused({"name": "no period", "quota_tokens": 10}, "quota_period")
    refused({"name": "no quota", "quota_period": "day"}, "quota_tokens")
    assert [k["name"] for k in httpx.get(url, headers=admin).json()["data"] if k["name"] == "typo"] == []
    # Names and patterns that match are kept as given; [] is a key allowed no model (for later), null every one.
    made = httpx.post(url, json={"name": "fine", "models": [MODEL, "SmolLM2-*"]}, headers=admin)
    assert made.status_code == 201 and made.json()["models"] == [MODEL, "SmolLM2-*"]
    none = httpx.post(url, json={"name": "none yet", "models": []}, headers=admin).json()
    assert none["models"] == []
    forbidden = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                           headers={"Authorization": f"Bearer {none['key']}"})  # fmt: skip
    assert forbidden.status_code == 403 and forbidden.json()["error"]["param"] == "model"
    # A PATCH is checked the same way, and a refused one changes nothing.
    key_url = f"{url}/{made.json()['id']}"
    refused({"models": ["no-such-model"]}, "models", "PATCH", key_url)
    refused({"quota_period": "month"}, "quota_tokens", "PATCH", key_url)
    kept = [k["models"] for k in httpx.get(url, headers=admin).json()["data"] if k["id"] == made.json()["id"]]
    assert kept == [[MODEL, "SmolLM2-*"]]


def test_the_cli_refuses_an_allow_list_with_an_empty_entry(server: Server) -> None:
    for listed in (",,,", f"{MODEL},,x"):
        result = cli(server.data_dir, "keys", "create", "--name", "commas", "--models", listed)
        assert result.returncode == 2 and "empty entry" in result.stderr, result.stderr
    made = cli(server.data_dir, "keys", "create", "--name", "no-model-yet", "--models", "")
    assert made.returncode == 0, made.stderr
    listed = json.loads(cli(server.data_dir, "keys", "list", "--json").stdout)
    assert [k["models"] for k in listed if k["name"] == "no-model-yet"] == [[]]


def admin_headers(server: Server, name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {create_key(server.data_dir, name, admin=True)}"}


def answers(server: Server, key: str) -> httpx.Response:
    return httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})


def test_a_key_that_expires_is_refused_after_with_a_401_that_says_so(server: Server) -> None:
    admin = admin_headers(server, "expiry-admin")
    past = httpx.post(server.url + "/api/keys", json={"name": "late", "expires_at": time.time() - 1}, headers=admin)
    assert past.status_code == 400 and past.json()["error"]["param"] == "expires_at", past.text
    iso = httpx.post(server.url + "/api/keys", json={"name": "x", "expires_at": "not a time"}, headers=admin)
    assert iso.status_code == 400 and iso.json()["error"]["param"] == "expires_at", iso.text
    expires_at = time.time() + 2
    made = httpx.post(server.url + "/api/keys", json={"name": "brief", "expires_at": expires_at}, headers=admin)
    assert made.status_code == 201 and made.json()["expires_at"] == expires_at, made.text
    key, key_id = made.json()["key"], made.json()["id"]
    assert answers(server, key).status_code == 200
    assert wait_for(lambda: answers(server, key).status_code == 401, 10)
    error = answers(server, key).json()["error"]
    assert error["type"] == "authentication_error" and error["message"].startswith("This API key expired at 20")
    assert time.time() >= expires_at
    unknown = answers(server, "llms-" + "x" * 43).json()["error"]
    assert unknown["message"] == "Invalid API key"  # an unknown key is told nothing more
    # A later expiry (ISO-8601) through PATCH: accepted again at once; null: never expires.
    later = httpx.patch(f"{server.url}/api/keys/{key_id}", json={"expires_at": "2099-01-01T00:00:00Z"}, headers=admin)
    assert later.status_code == 200 and later.json()["expires_at"] == 4070908800.0, later.text
    assert answers(server, key).status_code == 200
    cleared = httpx.patch(f"{server.url}/api/keys/{key_id}", json={"expires_at": None, "rpm": 50}, headers=admin)
    assert cleared.json()["expires_at"] is None and cleared.json()["rpm"] == 50


def test_a_rotated_key_takes_a_new_secret_and_its_old_one_works_through_the_grace_only(server: Server) -> None:
    admin = admin_headers(server, "rotation-admin")
    made = httpx.post(server.url + "/api/keys", json={"name": "rotating", "rpm": 100}, headers=admin).json()
    old, key_id = made["key"], made["id"]
    assert answers(server, old).status_code == 200
    rotated = httpx.post(f"{server.url}/api/keys/{key_id}/rotate", params={"grace_seconds": 2}, headers=admin)
    assert rotated.status_code == 200 and rotated.headers["cache-control"] == "no-store", rotated.text
    new = rotated.json()["key"]
    assert new != old and rotated.json()["rpm"] == 100 and rotated.json()["previous_valid_until"] > time.time()
    assert rotated.json()["fingerprint"] != made["fingerprint"]
    assert answers(server, new).status_code == 200 and answers(server, old).status_code == 200  # the grace
    assert wait_for(lambda: answers(server, old).status_code == 401, 10)
    assert (
        answers(server, old).json()["error"]["message"] == "Invalid API key" and answers(server, new).status_code == 200
    )
    for params, status, param in (({"grace_seconds": -1}, 400, "grace_seconds"),
                                  ({"grace_seconds": 31 * 86400}, 400, "grace_seconds")):  # fmt: skip
        refused = httpx.post(f"{server.url}/api/keys/{key_id}/rotate", params=params, headers=admin)
        assert (refused.status_code, refused.json()["error"]["param"]) == (status, param), refused.text
    missing = httpx.post(f"{server.url}/api/keys/key_000000000000/rotate", headers=admin)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    # The CLI rotates too: a new secret alone on the last line; grace 0 ends the old one at once.
    by_cli = cli(server.data_dir, "keys", "rotate", key_id, "--grace", "0")
    assert by_cli.returncode == 0, by_cli.stderr
    newest = by_cli.stdout.strip().splitlines()[-1]
    assert answers(server, newest).status_code == 200
    assert wait_for(lambda: answers(server, new).status_code == 401, 3)  # within key_cache_seconds (1 s)


def test_each_key_says_when_it_was_last_used(server: Server) -> None:
    admin = admin_headers(server, "last-use-admin")
    made = httpx.post(server.url + "/api/keys", json={"name": "used-once"}, headers=admin).json()
    assert made["last_used_at"] is None
    before = time.time()
    assert answers(server, made["key"]).status_code == 200

    def last_used() -> float | None:
        listed = httpx.get(server.url + "/api/keys", headers=admin).json()["data"]
        value: float | None = next(k for k in listed if k["id"] == made["id"])["last_used_at"]
        return value

    assert wait_for(lambda: last_used() is not None, 10)  # written on the gateway's next lease beat (2 s)
    assert before <= (last_used() or 0) <= time.time()
    listed = cli(server.data_dir, "keys", "list")
    (line,) = [row for row in listed.stdout.splitlines() if row.startswith(made["id"])]
    assert line.split()[-2].endswith("Z")  # LAST USED holds a time (UTC), not "-"
