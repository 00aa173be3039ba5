"""A small Python client for llmserver's native API, async mode included (stdlib only).

    from llmserver.client import Client
    client = Client("http://127.0.0.1:8000", api_key="llms-…")
    client.generate("Explain recursion.", max_tokens=64)            # sync (follows a fallback)
    client.generate_async("Explain recursion.", max_tokens=64)      # submit, poll, decrypt

Async results are decrypted here with the key this client generated (or the one the server sent
back on a sync→async fallback): nobody needs to write the XChaCha20-Poly1305 part themselves.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from llmserver.jobs import crypto

JSON = dict[str, Any]


class LLMServerError(RuntimeError):
    """An error envelope from the server (or a transport failure, with status 0)."""

    def __init__(self, status: int, type_: str, message: str) -> None:
        super().__init__(f"{status} {type_}: {message}")
        self.status = status
        self.type = type_
        self.message = message


def unreachable(url: str, exc: BaseException) -> str:
    reason = getattr(exc, "reason", exc)
    return f"cannot reach llmserver at {url}: {reason}"


def described(exc: LLMServerError) -> str:
    """One line for a CLI: the server's message with its status and type, or why it was not reached."""
    return exc.message if exc.status == 0 else f"{exc.message} ({exc.status} {exc.type})"


class JobGone(LLMServerError):
    """404 from a poll: unknown, expired or already consumed. Polling again cannot help."""


@dataclass(frozen=True)
class AsyncJob:
    tracking_id: str
    nonce: bytes
    key: bytes


class Client:
    def __init__(
        self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, timeout: float = 600
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def _request(self, method: str, path: str, body: JSON | None = None, query: dict[str, str] | None = None) -> JSON:
        url = self.base_url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                answer: JSON = json.load(response)
                return answer
        except urllib.error.HTTPError as exc:
            try:
                error = json.load(exc)["error"]
                status, type_, message = int(error["code"]), str(error["type"]), str(error["message"])
            except (ValueError, KeyError, TypeError):
                status, type_, message = exc.code, "http_error", str(exc.reason)
            kind = JobGone if status == 404 and path == "/api/async_result" else LLMServerError
            raise kind(status, type_, message) from None
        except (urllib.error.URLError, OSError) as exc:
            raise LLMServerError(0, "connection_error", unreachable(self.base_url, exc)) from None

    def generate(self, prompt: str, **params: Any) -> JSON:
        """A sync generation; if the server turned it into an async job (sync_timeout), wait for that."""
        answer = self._request("POST", "/api/generate", {"prompt": prompt, **params})
        if answer.get("mode") == "async":
            job = AsyncJob(answer["tracking_id"], base64.b64decode(answer["nonce"]), base64.b64decode(answer["key"]))
            return self.result(job)
        return answer

    def submit(self, prompt: str, *, webhook_url: str | None = None, **params: Any) -> AsyncJob:
        """Submit an async generation under a fresh random key, which stays in this process."""
        key = crypto.new_key()
        body: JSON = {"prompt": prompt, "mode": "async", "key": crypto.b64(key), **params}
        if webhook_url is not None:
            body["webhook_url"] = webhook_url
        answer = self._request("POST", "/api/generate", body)
        return AsyncJob(answer["tracking_id"], base64.b64decode(answer["nonce"]), key)

    def result(
        self, job: AsyncJob, *, timeout: float | None = None, first_interval: float = 0.25, max_interval: float = 5.0
    ) -> JSON:
        """Poll with exponential backoff until the job is ready, then decrypt it.

        Raises JobGone on 404 (stop: it will never come back) and LLMServerError when the job failed."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        interval = first_interval
        while True:
            answer = self._request("GET", "/api/async_result", query={"tracking_id": job.tracking_id})
            if answer["status"] == "ready":
                plain: JSON = json.loads(crypto.decrypt(answer["result"], job.key, job.nonce))
                return plain
            if answer["status"] == "failed":
                error = answer.get("error") or {}
                raise LLMServerError(
                    int(error.get("code", 500)), str(error.get("type", "server_error")), str(error.get("message", ""))
                )
            if time.monotonic() + interval > deadline:
                raise LLMServerError(
                    0, "timeout_error", f"job {job.tracking_id} still pending after the client's timeout"
                )
            time.sleep(interval)
            interval = min(max_interval, interval * 2)

    def generate_async(self, prompt: str, **params: Any) -> JSON:
        return self.result(self.submit(prompt, **params))
