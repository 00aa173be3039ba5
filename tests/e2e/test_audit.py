"""The audit log against the real server: every admin action through the API is one row — who (the
admin key's id and name), what, on what, the change (never a key or a secret), the answer's status,
the client and the request id — readable at GET /api/audit (admin only, paged and filtered), with the
CLI, and counted in /metrics. Reads are not actions; a refused attempt by a key that is not an admin key is
recorded with its 403 under that key, and the CLI's changes with the operator as the actor (issue 82)."""

from __future__ import annotations

import json
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support import Server, cli, create_key


def audited(server: Server, admin: str, **query: object) -> dict[str, Any]:
    answer = httpx.get(server.url + "/api/audit", params=query, headers={"Authorization": f"Bearer {admin}"})
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def counted(server: Server, key: str) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {key}"}).text
    return {
        s.labels["action"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "llmserver_admin_actions_total"
    }


def test_every_admin_action_is_one_row_naming_who_what_and_the_change_never_a_secret(server: Server) -> None:
    admin = create_key(server.data_dir, "auditor", admin=True)
    headers = {"Authorization": f"Bearer {admin}"}
    me = httpx.get(server.url + "/api/me", headers=headers).json()
    newest = audited(server, admin, limit=1)["data"]
    start = newest[0]["id"] if newest else 0
    metrics_before = counted(server, admin)

    made = httpx.post(server.url + "/api/keys", json={"name": "audited", "rpm": 5}, headers=headers)
    assert made.status_code == 201, made.text
    secret, made_id = made.json()["key"], made.json()["id"]
    sent = [made]
    sent.append(httpx.patch(f"{server.url}/api/keys/{made_id}", json={"rpm": 9, "api_key": admin}))  # key in body
    sent.append(httpx.patch(f"{server.url}/api/keys/{made_id}", json={"rpm": 0}, headers=headers))  # refused
    assert httpx.get(server.url + "/api/keys", headers=headers).status_code == 200  # a read: no row
    sent.append(httpx.delete(f"{server.url}/api/keys/{made_id}", headers=headers))
    model = {"name": "audited-model", "min_instances": 0, "max_instances": 0, "ctx_size": 512, "parallel": 1}
    sent.append(httpx.post(server.url + "/api/models", json=model, headers=headers))
    sent.append(httpx.post(server.url + "/api/models/audited-model/start", params={"instances": 0}, headers=headers))
    sent.append(httpx.delete(server.url + "/api/models/audited-model", headers=headers))
    sent.append(httpx.post(server.url + "/api/nodes/no-such-node/drain", headers=headers))  # no node: 404
    assert [a.status_code for a in sent] == [201, 200, 400, 200, 201, 200, 200, 404], [a.text for a in sent]
    user = create_key(server.data_dir, "not-an-admin")
    refused = httpx.post(server.url + "/api/keys", json={"name": "x"}, headers={"Authorization": f"Bearer {user}"})
    assert refused.status_code == 403  # recorded under the refused key (below)

    everything = [row for row in audited(server, admin, limit=100)["data"] if row["id"] > start][::-1]
    rows = [row for row in everything if row["key"]["id"] == me["id"]]
    assert [(r["action"], r["target"], r["status"]) for r in rows] == [
        ("keys.create", made_id, 201),  # a create's target is what its answer names
        ("keys.update", made_id, 200),
        ("keys.update", made_id, 400),
        ("keys.delete", made_id, 200),
        ("models.create", "audited-model", 201),
        ("models.start", "audited-model", 200),
        ("models.delete", "audited-model", 200),
        ("nodes.drain", "no-such-node", 404),
    ]
    assert all(r["key"] == {"id": me["id"], "name": "auditor"} and r["client"] == "127.0.0.1" for r in rows)
    assert [r["request_id"] for r in rows] == [a.headers["x-request-id"] for a in sent]
    assert rows[0]["change"] == {"name": "audited", "rpm": 5}
    assert rows[1]["change"] == {"rpm": 9}  # the key it came with is no part of the change
    assert rows[4]["change"] == model and rows[5]["change"] == {"instances": "0"}
    assert rows[3]["change"] is None and rows[7]["change"] is None
    attempt = [row for row in everything if row["request_id"] == refused.headers["x-request-id"]]
    assert [(r["action"], r["status"], r["key"]["name"]) for r in attempt] == [("keys.create", 403, "not-an-admin")]
    written = json.dumps(everything)
    assert secret not in written and admin not in written and user not in written

    # Filters and pages, as the request log's.
    assert [r["status"] for r in audited(server, admin, action="keys.update", target=made_id)["data"]] == [400, 200]
    first = audited(server, admin, target=made_id, limit=2)
    assert [r["action"] for r in first["data"]] == ["keys.delete", "keys.update"] and first["has_more"]
    rest = audited(server, admin, target=made_id, limit=2, before=first["next_before"])
    assert [r["action"] for r in rest["data"]] == ["keys.update", "keys.create"] and not rest["has_more"]
    assert audited(server, admin, key=me["id"], since=rows[0]["time"])["data"][-1]["id"] == rows[0]["id"]

    # Counted when it went through (the refused change and the unknown node are not).
    metrics_after = counted(server, admin)
    grown = {a: metrics_after[a] - metrics_before.get(a, 0.0) for a in metrics_after}
    assert {a: n for a, n in grown.items() if n} == {
        "keys.create": 1, "keys.update": 1, "keys.delete": 1, "models.create": 1, "models.start": 1, "models.delete": 1
    }  # fmt: skip

    # The CLI reads the same rows.
    listed = cli(server.data_dir, "audit", "list", "--url", server.url, "--key", admin, "--target", made_id)
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[2:4] for line in listed.stdout.splitlines()] == [
        ["keys.delete", made_id], ["keys.update", made_id], ["keys.update", made_id], ["keys.create", made_id]
    ]  # fmt: skip
    as_json = cli(server.data_dir, "audit", "list", "--url", server.url, "--key", admin, "--action", "keys.create",
                  "--json", "--limit", "1", "--by", me["id"])  # fmt: skip
    assert json.loads(as_json.stdout)[0]["change"] == {"name": "audited", "rpm": 5}


def test_the_audit_log_is_for_admins_and_answers_with_its_limits(server: Server) -> None:
    admin = create_key(server.data_dir, "audit-limits", admin=True)
    user = create_key(server.data_dir, "audit-reader")
    denied = httpx.get(server.url + "/api/audit", headers={"Authorization": f"Bearer {user}"})
    assert denied.status_code == 403 and denied.json()["error"]["type"] == "permission_error"
    for query, param in (({"limit": 0}, "limit"), ({"limit": 501}, "limit"), ({"before": 0}, "before"),
                         ({"since": "yesterday"}, "since")):  # fmt: skip
        answer = httpx.get(server.url + "/api/audit", params=query, headers={"Authorization": f"Bearer {admin}"})
        error = answer.json()["error"]
        assert (answer.status_code, error["type"], error["param"]) == (400, "invalid_request_error", param), query
    assert len(audited(server, admin, limit=500)["data"]) <= 500


def test_the_cli_s_changes_are_audited_with_the_operator_as_the_actor(server: Server) -> None:
    """Issue 82, row 5: `keys create`, `teams …` and `models update --set` wrote the store with no row."""
    import getpass

    admin = create_key(server.data_dir, "cli-auditor", admin=True)
    start = (audited(server, admin, limit=1)["data"] or [{"id": 0}])[0]["id"]
    made = cli(server.data_dir, "keys", "create", "--name", "by-cli", "--rpm", "3")
    assert made.returncode == 0, made.stderr
    team = cli(server.data_dir, "teams", "create", "cli-team", "--rpm", "10")
    assert team.returncode == 0, team.stderr
    team_id = team.stdout.strip().splitlines()[-1]
    missing = cli(server.data_dir, "keys", "revoke", "key_000000000000")
    assert missing.returncode != 0
    added = cli(server.data_dir, "models", "add", "cli-model", "--set", "min_instances=0", "--set", "ctx_size=512")
    assert added.returncode == 0, added.stderr
    changed = cli(server.data_dir, "models", "update", "cli-model", "--set", "ctx_size=768")
    assert changed.returncode == 0, changed.stderr
    removed = cli(server.data_dir, "models", "remove", "cli-model")
    assert removed.returncode == 0, removed.stderr
    rows = [row for row in audited(server, admin, limit=50)["data"] if row["id"] > start][::-1]
    cli_rows = [r for r in rows if r["key"]["id"] == "cli"]
    assert [(r["action"], r["status"]) for r in cli_rows] == [
        ("keys.create", 201), ("teams.create", 201), ("keys.delete", 404), ("models.create", 201),
        ("models.update", 200), ("models.delete", 200),
    ], cli_rows  # fmt: skip
    assert cli_rows[1]["target"] == team_id and cli_rows[1]["change"] == {"name": "cli-team", "rpm": 10}
    assert cli_rows[4]["target"] == "cli-model" and cli_rows[4]["change"] == {"ctx_size": 768}
    assert cli_rows[0]["change"]["rpm"] == 3 and made.stdout.strip().splitlines()[-1] not in json.dumps(rows)
    assert all(r["key"]["name"].startswith(f"{getpass.getuser()}@") for r in cli_rows)


def test_a_team_admins_refused_attempt_on_an_admin_route_is_recorded(server: Server) -> None:
    admin = create_key(server.data_dir, "attempts-auditor", admin=True)
    headers = {"Authorization": f"Bearer {admin}"}
    team = httpx.post(server.url + "/api/teams", json={"name": "attempts", "budget": 5, "budget_period": "day"},
                      headers=headers).json()  # fmt: skip
    made = httpx.post(
        server.url + "/api/keys",
        json={"name": "attempts-ta", "team_id": team["id"], "team_admin": True},
        headers=headers,
    ).json()
    theirs = {"Authorization": f"Bearer {made['key']}"}
    raised = httpx.patch(f"{server.url}/api/teams/{team['id']}", json={"budget": 100000}, headers=theirs)
    model = httpx.post(server.url + "/api/models", json={"name": "attempted", "min_instances": 0}, headers=theirs)
    assert raised.status_code == 403 and model.status_code == 403
    rows = audited(server, admin, key=made["id"])["data"][::-1]
    assert [(r["action"], r["target"], r["status"]) for r in rows] == [
        ("teams.update", team["id"], 403), ("models.create", None, 403)
    ]  # fmt: skip
    assert rows[0]["change"] == {"budget": 100000}
