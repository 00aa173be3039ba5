"""Every route of the node's own listener (cluster/node_http.py), read from its route table: the probes are
public, /metrics takes a token, the saved prompt routes only a request signed with the instance key."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from starlette.routing import Route

from llmserver.cluster import transfer
from llmserver.cluster.node_http import node_app
from llmserver.health import Readiness
from llmserver.metrics.prometheus import Metrics
from llmserver.models.lineup import Lineup
from llmserver.pool.supervisor import Supervisor
from llmserver.settings import Settings

KEY = "node-http-instance-key-0123456789abcdef"
PUBLIC = {"/health", "/ready"}


def test_every_route_but_the_probes_refuses_a_call_without_credentials(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, instances={"api_key": KEY})
    supervisor = Supervisor(settings, Lineup())
    app = node_app(settings, supervisor, Readiness({}), Metrics({}))
    routes = [(path, method) for r in app.routes if isinstance(r, Route) for path in [r.path]
              for method in sorted((r.methods or {"GET"}) - {"HEAD"})]  # fmt: skip
    assert {path for path, _ in routes} == {*PUBLIC, "/metrics", "/prompts/{identity}/{name}"}
    sample = f"/prompts/{'0' * 24}/{'0' * 32}.slot"

    async def calls() -> list[tuple[str, str, int, str]]:
        answers = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node") as client:
            for path, method in routes:
                url = path.replace("/prompts/{identity}/{name}", sample)
                for headers in (
                    {},
                    {"Authorization": f"Bearer {KEY}"},
                    {"Authorization": transfer.sign("wrong-key-0123456789abcdef", method, url)},
                ):
                    answer = await client.request(method, url, headers=headers)
                    if path in PUBLIC or (path == "/metrics" and headers.get("Authorization") == f"Bearer {KEY}"):
                        continue
                    answers.append((method, url, answer.status_code, answer.json()["error"]["type"]))
        return answers

    refused = asyncio.run(calls())
    assert len(refused) == 8  # /metrics without and with a wrong token; GET and PUT /prompts three ways each
    assert all(status == 401 and kind == "authentication_error" for *_, status, kind in refused), refused
