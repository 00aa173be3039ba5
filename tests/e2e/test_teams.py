"""Teams through the real server: the admin API and its refusals, the CLI, and a team's limits holding for
its keys together (quota, requests in flight, requests per minute, models) around each key's own."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support import COUNTING, MODEL, THREADS, Server, assert_error, cli, make_key, metric, wait_for
from tests.support.receiver import Receiver


def _admin(server: Server) -> httpx.Client:
    key = make_key(server.data_dir, "team-admin", admin=True)
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _team(admin: httpx.Client, name: str, **limits: Any) -> dict[str, Any]:
    made = admin.post("/api/teams", json={"name": name, **limits})
    assert made.status_code == 201, made.text
    return dict(made.json())


def _member(admin: httpx.Client, name: str, team_id: str, **limits: Any) -> tuple[str, str]:
    made = admin.post("/api/keys", json={"name": name, "team_id": team_id, **limits})
    assert made.status_code == 201, made.text
    assert made.json()["team_id"] == team_id
    return made.json()["id"], made.json()["key"]


def _complete(server: Server, key: str, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/completions",
        json={"prompt": COUNTING, "max_tokens": max_tokens, "temperature": 0},
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def test_the_team_api_makes_changes_and_deletes_teams_and_refuses_what_would_break_them(server: Server) -> None:
    with _admin(server) as admin:
        team = _team(admin, "api-team", rpm=100, quota_tokens=5000, quota_period="day", models=[MODEL])
        assert (team["name"], team["rpm"], team["models"], team["keys"]) == ("api-team", 100, [MODEL], [])
        assert team["quota"]["left"] == 5000 and team["id"].startswith("team_")
        assert_error(admin.post("/api/teams", json={"name": "api-team"}), 409, "conflict_error")
        assert_error(admin.post("/api/teams", json={"name": "x", "quota_tokens": 5}), 400, "invalid_request_error")
        assert admin.post("/api/teams", json={"name": "x", "models": ["no-such*"]}).json()["error"]["param"] == "models"
        assert_error(admin.post("/api/teams", json={"name": ""}), 400, "invalid_request_error")
        assert_error(admin.post("/api/teams", json={"name": "x", "color": "red"}), 400, "invalid_request_error")

        # A key joins at creation (never a team that does not exist), or later, and leaves.
        key_id, _ = _member(admin, "api-member", team["id"])
        refused = admin.post("/api/keys", json={"name": "stray", "team_id": "team_missing"})
        assert_error(refused, 400, "invalid_request_error")
        assert refused.json()["error"]["param"] == "team_id"
        loner = admin.post("/api/keys", json={"name": "loner"}).json()
        assert loner["team_id"] is None
        assert admin.patch(f"/api/keys/{loner['id']}", json={"team_id": team["id"]}).json()["team_id"] == team["id"]
        assert_error(
            admin.patch(f"/api/keys/{loner['id']}", json={"team_id": "team_missing"}), 400, "invalid_request_error"
        )
        shown = admin.get(f"/api/teams/{team['id']}").json()
        assert sorted(k["id"] for k in shown["keys"]) == sorted([key_id, loner["id"]])

        # PATCH changes what it names: a rename and a limit cleared, the rest kept.
        changed = admin.patch(f"/api/teams/{team['id']}", json={"name": "api-team-2", "rpm": None})
        assert changed.status_code == 200, changed.text
        assert (changed.json()["name"], changed.json()["rpm"], changed.json()["quota_tokens"]) == (
            "api-team-2",
            None,
            5000,
        )
        other = _team(admin, "api-other")
        assert_error(admin.patch(f"/api/teams/{other['id']}", json={"name": "api-team-2"}), 409, "conflict_error")
        assert_error(admin.patch("/api/teams/team_missing", json={"rpm": 1}), 404, "not_found_error")
        assert_error(admin.get("/api/teams/team_missing"), 404, "not_found_error")
        assert {"api-team-2", "api-other"} <= {t["name"] for t in admin.get("/api/teams").json()["data"]}

        # Deleted only once no active key is in it: its limits never silently stop applying.
        busy = admin.delete(f"/api/teams/{team['id']}")
        assert_error(busy, 409, "conflict_error")
        assert "2 active keys" in busy.json()["error"]["message"]
        assert admin.patch(f"/api/keys/{loner['id']}", json={"team_id": None}).json()["team_id"] is None
        assert admin.delete(f"/api/keys/{key_id}").status_code == 200
        assert admin.delete(f"/api/teams/{team['id']}").json() == {"id": team["id"], "deleted": True}
        assert_error(admin.delete(f"/api/teams/{team['id']}"), 404, "not_found_error")

        # Each change is in the audit log, with the team as its target.
        actions = [
            (row["action"], row["target"]) for row in admin.get("/api/audit", params={"limit": 200}).json()["data"]
        ]
        assert ("teams.create", None) in actions and ("teams.delete", team["id"]) in actions
        assert ("teams.update", team["id"]) in actions

    # Only admin keys manage teams.
    user = make_key(server.data_dir, "team-user")
    assert_error(
        httpx.get(server.url + "/api/teams", headers={"Authorization": f"Bearer {user}"}), 403, "permission_error"
    )


def test_a_teams_quota_is_shared_by_its_keys_each_within_its_own(server: Server) -> None:
    with _admin(server) as admin:
        team = _team(admin, "quota-team", quota_tokens=120, quota_period="total")
        _, alice = _member(admin, "quota-alice", team["id"])
        _, bob = _member(admin, "quota-bob", team["id"], quota_tokens=40, quota_period="total")
        spent = 0
        for _ in range(2):
            answer = _complete(server, alice, max_tokens=16)
            assert answer.status_code == 200, answer.text
            spent += answer.json()["usage"]["total_tokens"]
        # bob's own quota (40) is tighter than what the team has left: his own refuses him first.
        refused = _complete(server, bob, max_tokens=64)
        assert_error(refused, 429, "insufficient_quota")
        assert refused.json()["error"]["message"].startswith("This API key's token quota (40 per total)")
        me = httpx.get(server.url + "/api/me", headers={"Authorization": f"Bearer {alice}"}).json()
        assert me["team"]["id"] == team["id"] and me["team"]["quota"]["used"] == spent
        # What the team has left is what any of its keys may still use, whoever spent the rest.
        left = 120 - spent
        refused = _complete(server, alice, max_tokens=left)
        assert_error(refused, 429, "insufficient_quota")
        assert "team 'quota-team' (120 per total)" in refused.json()["error"]["message"]
        shown = admin.get(f"/api/teams/{team['id']}").json()["quota"]
        assert (shown["used"], shown["reserved"], shown["left"]) == (spent, 0, left)


def test_a_teams_requests_in_flight_per_minute_and_models_hold_for_its_keys_together(server: Server) -> None:
    with _admin(server) as admin:
        team = _team(admin, "flight-team", max_concurrency=1)
        _, first = _member(admin, "flight-1", team["id"])
        _, second = _member(admin, "flight-2", team["id"])
        body = {"prompt": COUNTING, "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.stream(
            "POST", server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {first}"}, timeout=120
        ) as streaming:
            assert streaming.status_code == 200
            lines = streaming.iter_lines()  # held: a dropped iterator would close the stream
            assert next(lines).startswith("data: ")  # in flight
            refused = _complete(server, second)
            assert_error(refused, 429, "rate_limit_error")
            assert "team 'flight-team' already has 1 request in flight" in refused.json()["error"]["message"]
        assert _complete(server, second).status_code == 200  # the place was given back

        hasty = _team(admin, "rpm-team", rpm=2)
        keys = [_member(admin, f"rpm-{i}", hasty["id"])[1] for i in range(3)]
        assert [_complete(server, key, 1).status_code for key in keys[:2]] == [200, 200]
        refused = _complete(server, keys[2], 1)
        assert_error(refused, 429, "rate_limit_error")
        assert "team 'rpm-team' is limited to 2 requests per minute" in refused.json()["error"]["message"]

        none = _team(admin, "no-models-team", models=[])
        _, barred = _member(admin, "barred", none["id"])
        refused = _complete(server, barred)
        assert_error(refused, 403, "permission_error")
        assert refused.json()["error"]["message"] == f"This API key's team may not use the model {MODEL!r}."
        listed = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {barred}"}).json()["data"]
        assert listed == []


def test_the_cli_manages_teams_and_puts_keys_in_them(server: Server) -> None:
    made = cli(server.data_dir, "teams", "create", "cli-team", "--quota-tokens", "100", "--quota-period", "day")
    assert made.returncode == 0, made.stderr
    team_id = made.stdout.strip().splitlines()[-1]
    assert cli(server.data_dir, "teams", "create", "cli-team").returncode != 0  # the name is taken
    key = cli(server.data_dir, "keys", "create", "--name", "cli-member", "--team", "cli-team")
    assert key.returncode == 0, key.stderr
    assert cli(server.data_dir, "keys", "create", "--name", "x", "--team-admin").returncode != 0  # needs --team
    listed = json.loads(cli(server.data_dir, "teams", "list", "--json").stdout)
    (entry,) = [t for t in listed if t["id"] == team_id]
    assert (entry["quota_tokens"], len(entry["keys"])) == (100, 1)
    assert cli(server.data_dir, "teams", "update", "cli-team", "--rpm", "9", "--clear", "quota").returncode == 0
    (entry,) = [t for t in json.loads(cli(server.data_dir, "teams", "list", "--json").stdout) if t["id"] == team_id]
    assert (entry["rpm"], entry["quota_tokens"]) == (9, None)
    busy = cli(server.data_dir, "teams", "delete", team_id)
    assert busy.returncode != 0 and "1 active key" in busy.stderr
    (member,) = [
        k for k in json.loads(cli(server.data_dir, "keys", "list", "--json").stdout) if k["name"] == "cli-member"
    ]
    assert member["team_id"] == team_id
    assert member["team_admin"] is False
    assert cli(server.data_dir, "keys", "update", member["id"], "--clear", "team").returncode == 0
    assert cli(server.data_dir, "teams", "delete", "cli-team").returncode == 0
    assert cli(server.data_dir, "keys", "create", "--name", "x", "--team", "cli-team").returncode != 0


def test_a_team_admin_key_manages_its_teams_keys_within_the_teams_limits_and_nothing_else(server: Server) -> None:
    with _admin(server) as admin:
        team = _team(admin, "managed-team", rpm=30, max_concurrency=4, quota_tokens=10000, quota_period="month")
        other = _team(admin, "other-team")
        outsider_id, outsider = _member(admin, "outsider", other["id"])
        assert_error(
            admin.post("/api/keys", json={"name": "lone-lead", "team_admin": True}), 400, "invalid_request_error"
        )
        made = admin.post("/api/keys", json={"name": "team-lead", "team_id": team["id"], "team_admin": True})
        assert made.status_code == 201 and made.json()["team_admin"] is True, made.text
        lead_id = made.json()["id"]
    lead = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {made.json()['key']}"}, timeout=60)
    with lead:
        # Keys it makes are its team's, within the team's limits.
        member = lead.post("/api/keys", json={"name": "lead-made", "rpm": 10})
        assert member.status_code == 201, member.text
        assert (member.json()["team_id"], member.json()["team_admin"], member.json()["admin"]) == (
            team["id"],
            False,
            False,
        )
        member_id = member.json()["id"]
        assert _complete(server, member.json()["key"]).status_code == 200
        over = lead.post("/api/keys", json={"name": "greedy", "rpm": 31})
        assert_error(over, 400, "invalid_request_error")
        assert over.json()["error"]["message"] == "rpm: at most the team's 30"
        assert_error(lead.post("/api/keys", json={"name": "boss", "admin": True}), 403, "permission_error")
        assert_error(lead.post("/api/keys", json={"name": "lead-2", "team_admin": True}), 403, "permission_error")
        assert_error(
            lead.post("/api/keys", json={"name": "elsewhere", "team_id": other["id"]}), 403, "permission_error"
        )
        # It sees, changes, rotates and revokes its team's keys; another team's key does not exist for it.
        listed = {k["id"] for k in lead.get("/api/keys").json()["data"]}
        assert listed == {lead_id, member_id}
        assert lead.patch(f"/api/keys/{member_id}", json={"max_concurrency": 2}).json()["max_concurrency"] == 2
        assert_error(lead.patch(f"/api/keys/{member_id}", json={"team_id": None}), 403, "permission_error")
        assert_error(lead.patch(f"/api/keys/{member_id}", json={"max_concurrency": 5}), 400, "invalid_request_error")
        for method, path in [("PATCH", f"/api/keys/{outsider_id}"), ("DELETE", f"/api/keys/{outsider_id}"),
                             ("POST", f"/api/keys/{outsider_id}/rotate")]:  # fmt: skip
            assert_error(
                lead.request(method, path, json={"rpm": 1} if method == "PATCH" else None), 404, "not_found_error"
            )
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {outsider}"}).status_code == 200
        # Its team's usage, not another's, nor everyone's.
        assert lead.get("/api/usage", params={"key": member_id}).json()["requests"] == 1
        assert_error(lead.get("/api/usage", params={"key": outsider_id}), 403, "permission_error")
        assert_error(lead.get("/api/usage", params={"key": "*"}), 403, "permission_error")
        rotated = lead.post(f"/api/keys/{member_id}/rotate", params={"grace_seconds": 0})
        assert rotated.status_code == 200 and rotated.json()["key"] != member.json()["key"]
        assert lead.delete(f"/api/keys/{member_id}").json()["revoked_at"] is not None
        # Nothing beyond its team's keys: teams, models, instances are the server admins'.
        assert_error(lead.get("/api/teams"), 403, "permission_error")
        assert_error(lead.post("/api/models", json={"name": "x"}), 403, "permission_error")
    # Its actions are in the audit log under its own name.
    with _admin(server) as admin:
        rows = admin.get("/api/audit", params={"limit": 200}).json()["data"]
        assert {("keys.create", "team-lead"), ("keys.delete", "team-lead")} <= {
            (r["action"], r["key"]["name"]) for r in rows
        }


@pytest.mark.slow  # a server of its own, with prices
def test_a_teams_budget_in_money_refuses_what_it_cannot_pay_and_each_threshold_is_sent_once(
    start_server: Callable[..., Server],
) -> None:
    receiver = Receiver().start()
    try:
        config = f"""
billing.currency = "EUR"
billing.budget_alerts = [50, 90]
billing.budget_webhook = "{receiver.url}"
[[models]]
name = "{MODEL}"
parallel = 2
ctx_size = 1024
threads = {THREADS}
prices = {{ input = 1000.0, output = 1000.0 }}
"""
        server = start_server(config)
        with _admin(server) as admin:
            team = _team(admin, "paying-team", budget=0.2, budget_period="day")
            keys = [_member(admin, f"payer-{i}", team["id"])[1] for i in range(2)]
            spent, answers = 0.0, []
            for i in range(8):  # 0.001 a token: about 0.038 a request; the 8th cannot fit
                answer = _complete(server, keys[i % 2])
                answers.append(answer)
                if answer.status_code == 200:
                    spent += answer.json()["usage"]["total_tokens"] * 0.001
            refused = [a for a in answers if a.status_code != 200]
            assert refused and all(a.status_code == 429 for a in refused)
            message = refused[0].json()["error"]["message"]
            assert message.startswith("The budget of this API key's team 'paying-team' (0.2 EUR per day)"), message
            assert_error(refused[0], 429, "insufficient_quota")
            standing = admin.get(f"/api/teams/{team['id']}").json()["spend"]
            assert standing["spent"] == pytest.approx(spent) and standing["reserved"] == 0
            assert spent <= 0.2 and standing["currency"] == "EUR"
            cost = admin.get("/api/usage", params={"key": "*"}).json()["cost"]
            assert cost == pytest.approx(spent)  # the ledger's rows and the budget's counter agree
            # Each threshold crossed once, to the operator's (private) webhook and in the metric.
            assert wait_for(lambda: len(receiver.received) == 2, 15), receiver.received
            sent = sorted(receiver.received, key=lambda alert: alert["threshold"])
            assert [(a["threshold"], a["owner"], a["id"], a["team"]) for a in sent] == [
                (50, "team", team["id"], "paying-team"),
                (90, "team", team["id"], "paying-team"),
            ]
            admin_key = admin.headers["Authorization"].removeprefix("Bearer ")
            assert metric(server, admin_key, "llmserver_budget_alerts_total", owner="team", threshold="50") == 1
    finally:
        receiver.stop()
