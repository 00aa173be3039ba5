"""A webhook receiver on 127.0.0.1 that records what it is sent and can fail its first calls."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tests.support.local_http import LocalHTTPServer, QuietHandler


@dataclass
class Receiver:
    fail_first: int = 0
    received: list[dict[str, Any]] = field(default_factory=list)
    attempts: int = 0
    http: LocalHTTPServer = field(default_factory=LocalHTTPServer)

    @property
    def url(self) -> str:
        return self.http.base_url + "/hook"

    def start(self) -> Receiver:
        receiver = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.attempts += 1
                status = 200
                if receiver.fail_first > 0:
                    receiver.fail_first -= 1
                    status = 503
                else:
                    receiver.received.append(json.loads(body))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.http.serve(Handler)
        return self

    def stop(self) -> None:
        self.http.stop()
