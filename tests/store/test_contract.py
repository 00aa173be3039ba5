"""What every store engine must do, run on each (a real SQLite file, a real PostgreSQL database):
keys, the ledger, single-read jobs, the webhook outbox, gateway leases and their sweep."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from llmserver.store import NO_LIMITS, AuditQuery, KeyLimits, LedgerQuery, Store, UsageBatch
from llmserver.store.migrations import POSTGRES
from tests.support import with_store as run


def test_keys_by_hash_and_revocation(database_url: str) -> None:
    async def test(store: Store) -> None:
        record = await store.insert_key("key_a", "alice", "a" * 64, "aaaaaaaa", True)
        assert record.active and record.is_admin
        assert await store.key_by_hash("a" * 64) == record
        assert await store.key_by_hash("b" * 64) is None
        assert await store.revoke_key("key_a") is True
        assert await store.revoke_key("key_a") is False  # already revoked
        assert await store.revoke_key("key_missing") is False
        revoked = await store.key_by_id("key_a")
        assert revoked is not None and not revoked.active
        assert [k.id for k in await store.list_keys()] == ["key_a"]

    run(database_url, test)


def test_a_key_expires_rotates_with_a_grace_for_its_old_secret_and_records_its_last_use(database_url: str) -> None:
    async def test(store: Store) -> None:
        record = await store.insert_key("key_e", "expiring", "e" * 64, "eeeeeeee", False, expires_at=2_000_000_000.0)
        assert record.expires_at == 2_000_000_000.0 and await store.key_by_hash("e" * 64) == record
        assert await store.set_key_expiry("key_e", None) and (await store.key_by_id("key_e")).expires_at is None  # type: ignore[union-attr]
        assert not await store.set_key_expiry("key_missing", 1.0)
        # Rotated: the new secret finds it; the old one only through its grace, and only until it ends.
        assert await store.rotate_key("key_e", "f" * 64, "ffffffff", previous_until=1000.0)
        rotated = await store.key_by_hash("f" * 64)
        assert rotated is not None and rotated.fingerprint == "ffffffff" and rotated.previous_until == 1000.0
        assert await store.key_by_hash("e" * 64) is None
        assert await store.key_by_previous_hash("e" * 64, now=999.0) == rotated
        assert await store.key_by_previous_hash("e" * 64, now=1000.0) is None
        # A second rotation within the grace ends the first old secret's.
        assert await store.rotate_key("key_e", "g" * 64, "gggggggg", previous_until=2000.0)
        assert await store.key_by_previous_hash("e" * 64, now=999.0) is None
        assert (await store.key_by_previous_hash("f" * 64, now=999.0)).id == "key_e"  # type: ignore[union-attr]
        # Last use: the latest of what gateways write, never moved back.
        await store.touch_keys({"key_e": 50.0})
        await store.touch_keys({"key_e": 40.0, "key_missing": 1.0})
        assert (await store.key_by_id("key_e")).last_used_at == 50.0  # type: ignore[union-attr]
        # Revoked: neither secret, and no rotation.
        assert await store.revoke_key("key_e")
        assert await store.key_by_previous_hash("f" * 64, now=999.0) is None
        assert not await store.rotate_key("key_e", "h" * 64, "hhhhhhhh", previous_until=3000.0)

    run(database_url, test)


def test_usage_retention_and_speed_buckets(database_url: str) -> None:
    async def test(store: Store) -> None:
        row = {
            "key_id": "k", "model": "m", "instance_id": None, "endpoint": "/api/generate", "prompt_tokens": 1,
            "completion_tokens": 1, "latency_ms": 1.0, "ttft_ms": None, "tokens_per_second": None, "outcome": "ok",
        }  # fmt: skip
        await store.record(UsageBatch(rows=[{**row, "time": 100.0}, {**row, "time": 200.0, "cost": 0.000125}]))
        assert await store.delete_usage_before(150.0) == 1
        assert [(r["time"], r["cost"]) for r in await store.usage_rows(None, 0, 1000)] == [(200.0, 0.000125)]
        assert await store.usage_rows("other", 0, 1000) == []
        await store.record(UsageBatch(speeds=[("m", 10, 5.0, 1.0), ("m", 11, 7.0, 2.0)]))
        await store.record(UsageBatch(speeds=[("m", 11, 3.0, 1.0)]))  # another gateway, the same minute
        assert sorted(await store.speed_since(11, prune=False)) == [("m", 11, 10, 3.0)]
        assert len(await store.speed_since(0)) == 2

    run(database_url, test)


def test_the_request_log_pages_newest_first_with_filters(database_url: str) -> None:
    async def test(store: Store) -> None:
        def row(i: int, key: str, model: str, outcome: str) -> dict[str, object]:
            return {
                "time": 1000.0 + i, "key_id": key, "model": model, "instance_id": f"inst-{i}", "endpoint": "/x",
                "prompt_tokens": i, "completion_tokens": 1, "latency_ms": 2.0, "ttft_ms": 1.0, "tokens_per_second": 5.0,
                "outcome": outcome,
            }  # fmt: skip

        outcomes = ["ok", "client_closed", "server_error", "ok", "rate_limit_error", "ok"]
        await store.record(
            UsageBatch(rows=[row(i, "a" if i % 2 else "b", "m1" if i < 4 else "m2", o) for i, o in enumerate(outcomes)])
        )

        async def page(**query: object) -> list[int]:
            return [int(r["prompt_tokens"]) for r in await store.usage_page(LedgerQuery(**query))]  # type: ignore[arg-type,call-overload]

        assert await page() == [5, 4, 3, 2, 1, 0]
        assert await page(limit=2) == [5, 4]
        newest = await store.usage_page(LedgerQuery(limit=2))
        assert await page(limit=2, before=newest[-1]["id"]) == [3, 2]  # the next page, by id
        assert await page(key_id="a") == [5, 3, 1]
        assert await page(model="m2") == [5, 4]
        assert await page(status="ok") == [5, 3, 0]
        assert await page(status="cancelled") == [1]
        assert await page(status="error") == [4, 2]  # neither ok nor the client's own leaving
        assert await page(since=1002.0, until=1004.0) == [3, 2]  # [since, until)
        assert await page(key_id="a", model="m1", status="ok") == [3]
        assert await page(key_id="nobody") == []
        # Written late (higher ids) but older, at one time: placed by time, those of one time by id.
        await store.record(UsageBatch(rows=[{**row(i, "a", "m1", "ok"), "time": 1002.5} for i in (6, 7)]))
        assert await page(key_id="a") == [5, 3, 7, 6, 1]
        first = await store.usage_page(LedgerQuery(key_id="a", limit=3))
        assert [r["prompt_tokens"] for r in first] == [5, 3, 7]
        assert await page(key_id="a", before=first[-1]["id"]) == [6, 1]  # the tie split across two pages
        assert await page(before=10**9) == []  # a cursor whose row retention removed: nothing more
        assert await page(before=first[-1]["id"], until=1002.0) == [1, 0]  # the range ends first

    run(database_url, test)


def test_a_finished_job_is_handed_out_once_however_many_poll_at_once(database_url: str) -> None:
    async def test(store: Store) -> None:
        await store.insert_job("j", "k", "nonce", 1.0, "gw1")
        assert (await store.job("j", "k", 2.0)).status == "pending"  # type: ignore[union-attr]
        assert await store.job("j", "someone-else", 2.0) is None
        await store.finish_job("j", result="ciphertext", error=None, now=2.0, expires_at=1e12)
        claims = await asyncio.gather(*(store.claim_job("j", "k", 3.0, f"gw{i % 2}") for i in range(8)))
        won = [claim for claim in claims if claim is not None]
        assert len(won) == 1 and won[0].result == "ciphertext"
        await store.release_claim("j")  # the answer did not reach its reader
        assert (await store.claim_job("j", "k", 3.0, "gw2")) is not None
        await store.delete_job("j")
        assert await store.job("j", "k", 3.0) is None

    run(database_url, test)


def test_a_webhook_is_queued_with_the_result_and_claimed_by_one_gateway(database_url: str) -> None:
    async def test(store: Store) -> None:
        await store.insert_job("j", "k", "nonce", 1.0, "gw1")
        payload = json.dumps({"status": "ready", "tracking_id": "j", "result": "c"})
        await store.finish_job("j", result="c", error=None, now=1.0, expires_at=1e12, webhook=("http://x/", payload))
        first, second = await asyncio.gather(store.outbox_claim("gw1", 60, 16), store.outbox_claim("gw2", 60, 16))
        assert len(first) + len(second) == 1
        item = (first or second)[0]
        assert (item.tracking_id, item.url, item.payload, item.attempts) == ("j", "http://x/", payload, 0)
        assert await store.outbox_claim("gw3", 60, 16) == []  # claimed for a minute
        await store.outbox_retry(item.id, 1, 0.0)  # failed once: due again at once, for anyone
        again = await store.outbox_claim("gw3", 60, 16)
        assert [i.attempts for i in again] == [1]
        await store.outbox_done(item.id)
        assert await store.outbox_claim("gw3", 0, 16) == []

    run(database_url, test)


def test_leases_and_the_sweep_of_a_lapsed_gateway(database_url: str) -> None:
    async def test(store: Store) -> None:
        assert await store.gateway_holder("gw1") is None
        assert await store.gateway_take("gw1", "host-a", 100, 30.0, None) is True
        assert await store.gateway_take("gw1", "host-b", 200, 30.0, None) is False  # held: not by nobody
        holder = await store.gateway_holder("gw1")
        assert holder is not None and (holder.host, holder.pid) == ("host-a", 100) and 29 < holder.seconds_left <= 30
        assert await store.gateway_take("gw2", "host-b", 200, 0.05, None) is True
        assert await store.gateway_renew("gw1", 100, 30.0) is not None  # renewed (gw2 may have lapsed already)
        assert await store.gateway_renew("gw1", 999, 30.0) is None  # not the holder
        await store.insert_job("running-on-gw2", "k", "n", 1.0, "gw2")
        await store.insert_job("running-on-gw1", "k", "n", 1.0, "gw1")
        await store.insert_job("ready", "k", "n", 1.0, "gw1")
        await store.finish_job("ready", result="c", error=None, now=1.0, expires_at=1e12)
        assert await store.claim_job("ready", "k", 2.0, "gw2") is not None  # gw2 was handing it out
        await asyncio.sleep(0.1)
        assert await store.gateway_renew("gw1", 100, 30.0) == ["gw2"]
        assert await store.sweep_gateway("gw1", error="{}", expires_at=1e12, only_if_lapsed=True) is None  # alive
        error = json.dumps({"error": {"message": "gone", "type": "server_error", "code": 500}})
        swept = await store.sweep_gateway("gw2", error=error, expires_at=1e12, only_if_lapsed=True)
        assert swept is not None and swept.jobs_failed == 1
        assert await store.sweep_gateway("gw2", error=error, expires_at=1e12, only_if_lapsed=True) is None  # once
        assert await store.gateway_renew("gw1", 100, 30.0) == []
        states = {t: await store.job(t, "k", 3.0) for t in ("running-on-gw2", "running-on-gw1", "ready")}
        assert {t: j.status for t, j in states.items() if j} == {
            "running-on-gw2": "failed", "running-on-gw1": "pending", "ready": "ready",
        }  # fmt: skip
        assert states["running-on-gw2"].error == error  # type: ignore[union-attr]
        await store.gateway_release("gw1", 100)
        assert await store.gateway_holder("gw1") is None

    run(database_url, test)


def test_a_concurrent_quota_never_overshoots(database_url: str) -> None:
    """Forty reservations at once from two gateways against 400 tokens: exactly the ten that fit."""

    async def test(store: Store) -> None:
        grants = await asyncio.gather(*(store.quota_reserve("k", "total", f"gw{i % 2}", 40, 400) for i in range(40)))
        assert sum(grant.granted for grant in grants) == 10
        assert await store.quota_counts("k", "total") == (0, 400)

    run(database_url, test)


def test_db_migrate_and_a_gateway_that_refuses_an_unmigrated_database(postgres: object) -> None:
    from tests.support.services import Postgres

    assert isinstance(postgres, Postgres)
    url = postgres.new_database()
    env = {**os.environ, "LLMSERVER_STATE__DATABASE_URL": url}

    def llmserver(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "llmserver", *args], capture_output=True, text=True, timeout=60, env=env, check=False
        )

    refused = llmserver("keys", "list")
    assert refused.returncode == 2 and "run `llmserver db migrate --database-url URL` first" in refused.stderr
    not_served = llmserver("serve", "--port", "1")
    assert not_served.returncode == 2 and "llmserver db migrate" in not_served.stderr
    assert len(not_served.stderr.strip().splitlines()) == 1  # one line, no traceback
    migrated = llmserver("db", "migrate")
    assert migrated.returncode == 0 and f"schema version {len(POSTGRES)}" in migrated.stdout, migrated.stderr
    again = llmserver("db", "migrate")  # nothing left to apply
    assert again.returncode == 0 and f"schema version {len(POSTGRES)}" in again.stdout
    created = llmserver("keys", "create", "--name", "pg")
    assert created.returncode == 0 and created.stdout.strip().splitlines()[-1].startswith("llms-")
    assert "pg" in llmserver("keys", "list").stdout
    unreachable = llmserver("keys", "list", "--database-url", "postgresql://postgres@127.0.0.1:1/none")
    assert unreachable.returncode == 1 and "cannot be reached" in unreachable.stderr


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_sqlite_engine_is_the_default(database_url: str) -> None:
    assert database_url.startswith("sqlite:///")


def test_a_swept_job_with_a_webhook_gets_its_failure_webhook(database_url: str) -> None:
    """A job whose gateway died is failed by the sweep; a client waiting for its webhook hears so (the
    30-minute cluster soak found 3 webhooks never sent: jobs of gateways killed -9)."""

    async def test(store: Store) -> None:
        await store.insert_job("hooked", "k", "n", 1.0, "gw9", webhook_url="https://example.test/hook")
        await store.insert_job("polled", "k", "n", 1.0, "gw9")
        error = json.dumps({"error": {"message": "gone", "type": "server_error", "code": 500}})
        swept = await store.sweep_gateway("gw9", error=error, expires_at=1e12, only_if_lapsed=False)
        assert swept is not None and swept.jobs_failed == 2
        (item,) = await store.outbox_claim("gw1", 60, 16)
        assert (item.tracking_id, item.url) == ("hooked", "https://example.test/hook")
        failure = {"message": "gone", "type": "server_error", "code": 500}
        assert json.loads(item.payload) == {"status": "failed", "tracking_id": "hooked", "error": failure}

    run(database_url, test)


def test_the_model_catalog_counts_revisions_and_refuses_what_would_overwrite(database_url: str) -> None:
    async def test(store: Store) -> None:
        assert await store.catalog() == []
        first = await store.catalog_put("m", '{"name":"m"}', "api", create=True)
        assert first is not None and first.revision == 1
        assert await store.catalog_put("m", '{"name":"m","parallel":2}', "api", create=True) is None  # taken
        assert await store.catalog_put("other", '{"name":"other"}', "api", create=False) is None  # absent
        second = await store.catalog_put("m", '{"name":"m","parallel":2}', "api", create=False)
        assert second is not None and second.revision == 2 and second.settings() == {"name": "m", "parallel": 2}
        assert [(e.name, e.revision, e.origin) for e in await store.catalog()] == [("m", 2, "api")]
        assert await store.catalog_delete("m") is True
        assert await store.catalog_delete("m") is False
        assert await store.catalog() == []

    run(database_url, test)


def test_a_named_lease_has_one_holder_until_it_lapses(database_url: str) -> None:
    async def test(store: Store) -> None:
        assert await store.lease_take("scheduler", "gw-1", 0.3) is True
        assert await store.lease_take("scheduler", "gw-2", 0.3) is False  # held
        assert await store.lease_take("scheduler", "gw-1", 0.3) is True  # renewed by its holder
        await asyncio.sleep(0.4)
        assert await store.lease_take("scheduler", "gw-2", 30) is True  # lapsed: taken over
        assert await store.lease_take("scheduler", "gw-1", 30) is False
        await store.lease_release("scheduler", "gw-1")  # not the holder: nothing happens
        assert await store.lease_take("scheduler", "gw-1", 30) is False
        await store.lease_release("scheduler", "gw-2")
        assert await store.lease_take("scheduler", "gw-1", 30) is True

    run(database_url, test)


def test_a_node_mark_is_set_kept_changed_and_lifted(database_url: str) -> None:
    async def test(store: Store) -> None:
        assert await store.node_marks() == []
        cordoned = await store.node_mark("worker-1", "cordoned")
        assert cordoned is not None and cordoned.state == "cordoned"
        again = await store.node_mark("worker-1", "cordoned")
        assert again == cordoned  # set again: the same mark, its time kept
        draining = await store.node_mark("worker-1", "draining")
        assert draining is not None and draining.state == "draining" and draining.since >= cordoned.since
        await store.node_mark("worker-2", "cordoned")
        assert [(m.node, m.state) for m in await store.node_marks()] == [
            ("worker-1", "draining"), ("worker-2", "cordoned"),
        ]  # fmt: skip
        assert await store.node_mark("worker-1", None) is None
        assert await store.node_mark("absent", None) is None  # lifting no mark is no error
        assert [m.node for m in await store.node_marks()] == ["worker-2"]

    run(database_url, test)


def test_the_audit_log_appends_pages_newest_first_with_filters_and_sweeps_by_age(database_url: str) -> None:
    async def test(store: Store) -> None:
        row = {"key_id": "admin-1", "key_name": "ops", "target": None, "change": None, "status": 200,
               "client": "127.0.0.1", "request_id": "r"}  # fmt: skip
        for n, action in enumerate(["keys.create", "models.update", "keys.create", "nodes.drain"]):
            await store.audit_append({**row, "time": 100.0 + n, "action": action, "target": f"t{n % 2}"})
        await store.audit_append({**row, "time": 104.0, "action": "keys.delete", "key_id": "admin-2"})
        newest = await store.audit_page(AuditQuery(limit=10))
        assert [r["action"] for r in newest] == [
            "keys.delete",
            "nodes.drain",
            "keys.create",
            "models.update",
            "keys.create",
        ]
        first, second = newest[0], newest[1]
        assert (first["key_id"], first["key_name"], first["status"], first["client"]) == (
            "admin-2",
            "ops",
            200,
            "127.0.0.1",
        )
        page = await store.audit_page(AuditQuery(limit=2, before=int(second["id"])))
        assert [r["action"] for r in page] == ["keys.create", "models.update"]
        assert len(await store.audit_page(AuditQuery(action="keys.create"))) == 2
        assert [r["time"] for r in await store.audit_page(AuditQuery(target="t1"))] == [103.0, 101.0]
        assert [r["action"] for r in await store.audit_page(AuditQuery(key_id="admin-2"))] == ["keys.delete"]
        assert len(await store.audit_page(AuditQuery(since=101.0, until=103.0))) == 2
        assert await store.delete_audit_before(102.0) == 2
        assert [r["time"] for r in await store.audit_page(AuditQuery())] == [104.0, 103.0, 102.0]

    run(database_url, test)


def test_teams_are_made_renamed_joined_left_and_deleted_only_without_active_keys(database_url: str) -> None:
    async def test(store: Store) -> None:
        limits = KeyLimits(1000, "day", 60, 4, ("a*",), budget=12.5, budget_period="month")
        team = await store.insert_team("team_r", "research", limits)
        assert team is not None and (team.name, team.limits) == ("research", limits)
        assert await store.insert_team("team_x", "research", NO_LIMITS) is None  # the name is taken
        assert await store.team_by_id("team_r") == team and await store.team_by_id("team_x") is None
        other = await store.insert_team("team_o", "ops", NO_LIMITS)
        assert [t.id for t in await store.list_teams()] == ["team_o", "team_r"]  # by name
        assert await store.update_team("team_o", "research", NO_LIMITS) is True  # another team's name
        renamed = await store.update_team("team_o", "operations", KeyLimits(rpm=5))
        assert renamed == replace(other, name="operations", limits=KeyLimits(rpm=5))  # type: ignore[type-var]
        assert await store.update_team("team_missing", "x", NO_LIMITS) is False
        # Keys join at creation or later, and leave; never a team that does not exist.
        member = await store.insert_key("key_m", "member", "m" * 64, "mmmmmmmm", False, team_id="team_r")
        assert member.team_id == "team_r" and (await store.key_by_hash("m" * 64)).team_id == "team_r"  # type: ignore[union-attr]
        await store.insert_key("key_n", "newcomer", "n" * 64, "nnnnnnnn", False)
        assert await store.set_key_team("key_n", "team_r")
        assert not await store.set_key_team("key_n", "team_missing")
        assert (await store.key_by_id("key_n")).team_id == "team_r"  # type: ignore[union-attr]
        # A team admin key is one of its team's; out of the team it is no one's admin.
        lead = await store.insert_key("key_l", "lead", "l" * 64, "llllllll", False, team_id="team_r", team_admin=True)
        assert lead.team_admin and (await store.key_by_hash("l" * 64)).team_admin  # type: ignore[union-attr]
        assert not (await store.insert_key("key_x", "x", "x" * 64, "xxxxxxxx", False, team_admin=True)).team_admin
        assert await store.set_key_team("key_l", None, team_admin=True)
        assert (await store.key_by_id("key_l")).team_admin is False  # type: ignore[union-attr]
        assert await store.set_key_team("key_n", "team_r", team_admin=True)
        assert (await store.key_by_id("key_n")).team_admin is True  # type: ignore[union-attr]
        assert await store.set_key_team("key_n", "team_r")
        # Deleted only once no active key is a member; a revoked member's record then names no team.
        assert await store.delete_team("team_r") == 2
        assert await store.set_key_team("key_n", None) and await store.revoke_key("key_m")
        assert not await store.set_key_team("key_m", "team_o")  # a revoked key moves nowhere
        assert await store.delete_team("team_r") == 0
        assert await store.team_by_id("team_r") is None and await store.delete_team("team_r") is None
        assert (await store.key_by_id("key_m")).team_id is None  # type: ignore[union-attr]

    run(database_url, test)
