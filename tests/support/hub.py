"""A stand-in for the Hugging Face hub's file endpoint, on 127.0.0.1, for download tests.

It serves `/{repo}/resolve/{revision}/{file}` with the headers huggingface_hub reads (X-Repo-Commit,
ETag, Content-Length), honours `Range`, and can cut its first download short to test resuming.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

from tests.support.local_http import LocalHTTPServer, QuietHandler

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class StandInHub:
    files: dict[str, bytes]  # "org/repo/file" → content
    cut_first_download_at: int | None = None
    seconds_per_download: float = 0.0  # a slow link: each body written in 20 parts over this long
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    http: LocalHTTPServer = field(default_factory=LocalHTTPServer)

    @property
    def url(self) -> str:
        return self.http.base_url

    def start(self) -> StandInHub:
        hub = self

        class Handler(QuietHandler):
            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                hub.requests.append((self.command, self.path, self.headers.get("Range")))
                parts = self.path.split("?")[0].strip("/").split("/")
                if len(parts) < 5 or parts[2] != "resolve":
                    self.send_error(404)
                    return
                key = "/".join([parts[0], parts[1], *parts[4:]])
                content = hub.files.get(key)
                if content is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start = 0
                range_header = self.headers.get("Range")
                if range_header and range_header.startswith("bytes="):
                    start = int(range_header[6:].split("-")[0] or 0)
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(content).hexdigest()}"')
                self.send_header("Content-Length", str(len(content) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(content) - 1}/{len(content)}")
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if not body:
                    return
                cut = hub.cut_first_download_at
                if cut is not None and start == 0:
                    hub.cut_first_download_at = None
                    self.wfile.write(content[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                rest = content[start:]
                if not hub.seconds_per_download:
                    self.wfile.write(rest)
                    return
                part = len(rest) // 20 + 1
                for offset in range(0, len(rest), part):
                    self.wfile.write(rest[offset : offset + part])
                    self.wfile.flush()
                    time.sleep(hub.seconds_per_download / 20)

        self.http.serve(Handler)
        return self

    def stop(self) -> None:
        self.http.stop()
