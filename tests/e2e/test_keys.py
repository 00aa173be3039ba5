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
