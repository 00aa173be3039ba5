"""OpenTelemetry tracing (otlp_endpoint): a real server sends its spans over OTLP/HTTP to a receiver
here, decoded with opentelemetry-proto. One chat request carries the client's traceparent: its span is
a child of the client's, with child spans for admission, the inputs, the queue and the instance call
(a `first token` event); an async job's webhook delivery is a span too."""

from __future__ import annotations

import base64
import os
import secrets
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.support import MODEL, Server, make_key, wait_for

CONFIG = f"""
jobs.webhook_allow_private = true
[[models]]
name = "{MODEL}"
parallel = 1
ctx_size = 512
threads = 1
"""


class Receiver:
    """An OTLP/HTTP trace receiver: POST /v1/traces, protobuf bodies; the spans, decoded."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.webhooks = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/v1/traces":
                    request = ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    for resource in request.resource_spans:
                        for scope in resource.scope_spans:
                            receiver.spans.extend(scope.spans)
                else:  # the job's webhook
                    receiver.webhooks += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def named(self, name: str) -> list[Any]:
        return [span for span in self.spans if span.name == name]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Receiver]]:
    receiver = Receiver()
    env = {
        "LLMSERVER_OBSERVABILITY__OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    server = Server(tmp_path_factory.mktemp("traced"), CONFIG, env=env).start()
    yield server, receiver
    server.stop()
    receiver.server.shutdown()
    receiver.server.server_close()


def test_a_chat_request_is_one_trace_under_the_clients_span_with_its_steps(traced: tuple[Server, Receiver]) -> None:
    server, receiver = traced
    key = make_key(server.data_dir, "traced")
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": MODEL, "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}]}  # fmt: skip
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, timeout=60,
        headers={"Authorization": f"Bearer {key}", "traceparent": f"00-{trace_id}-{parent_id}-01"},
    ) as answer:  # fmt: skip
        assert answer.status_code == 200
        assert "data: [DONE]" in answer.read().decode()

    def request_span() -> Any:
        found = [s for s in receiver.named("POST /v1/chat/completions") if s.trace_id.hex() == trace_id]
        return found[0] if found else None

    assert wait_for(lambda: request_span() is not None and len(receiver.named("instance call")) >= 1, 15)
    root = request_span()
    assert root.parent_span_id.hex() == parent_id and root.kind == 2  # SPAN_KIND_SERVER
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["http.response.status_code"].int_value == 200
    children = {s.name: s for s in receiver.spans if s.trace_id.hex() == trace_id and s.parent_span_id == root.span_id}
    assert {"admission", "inputs", "queue", "instance call"} <= set(children), set(children)
    call = children["instance call"]
    assert [event.name for event in call.events] == ["first token"]
    assert root.start_time_unix_nano <= children["admission"].start_time_unix_nano
    assert call.end_time_unix_nano <= root.end_time_unix_nano + 50_000_000  # ended with the stream


def test_an_async_jobs_webhook_delivery_is_a_span(traced: tuple[Server, Receiver]) -> None:
    server, receiver = traced
    key = make_key(server.data_dir, "traced-async")
    body = {"prompt": "Say hi.", "max_tokens": 2, "mode": "async",
            "key": base64.b64encode(os.urandom(32)).decode(),
            "webhook_url": f"http://127.0.0.1:{receiver.port}/hook"}  # fmt: skip
    submitted = httpx.post(server.url + "/api/generate", json=body, headers={"Authorization": f"Bearer {key}"})
    assert submitted.status_code == 200, submitted.text
    tracking_id = submitted.json()["tracking_id"]

    def delivered() -> bool:
        return any(
            a.key == "tracking_id" and a.value.string_value == tracking_id
            for span in receiver.named("webhook delivery")
            for a in span.attributes
        )

    assert wait_for(delivered, 30) and receiver.webhooks >= 1
