"""The one error type of the API and the envelope it renders to.

Every error any endpoint returns is `{"error": {"message", "type", "code"[, "param"]}}` with
`code` equal to the HTTP status. Raise an `APIError` subclass; the handlers in `app.py` render it.
"""

from __future__ import annotations

import datetime
from typing import Any, ClassVar


class APIError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    # Why a request was refused, for the `llmserver_refusals_total{reason}` metric when the type alone
    # does not say (rpm, concurrency, queue_full, queue_timeout, no_instance): a fixed word, never input.
    reason: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.type, self.message, self.param)

    def body_for(self, path: str) -> dict[str, Any]:
        """The error as the API of `path` shapes its errors."""
        return for_path(path, self.body())


def error_body(status: int, type_: str, message: str, param: str | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"message": message, "type": type_, "code": status}
    if param is not None:
        error["param"] = param
    return {"error": error}


# Anthropic's Messages API answers its errors in Anthropic's own shape, which its SDK and clients read:
# `{"type": "error", "error": {"type", "message"}}`, with our types mapped to Anthropic's.
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
ANTHROPIC_TYPES = {
    "context_length_exceeded": "invalid_request_error",
    "model_not_found": "not_found_error",
    "unsupported_media_type": "invalid_request_error",
    "unprocessable_file": "invalid_request_error",
    "insufficient_quota": "rate_limit_error",
    "upstream_error": "api_error",
    "server_error": "api_error",
    "timeout_error": "api_error",
    "client_closed_request": "api_error",
}


def anthropic_error(error: dict[str, Any]) -> dict[str, Any]:
    """Our envelope's `error` as Anthropic's error object."""
    kind = str(error.get("type", "api_error"))
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(kind, kind), "message": error.get("message", "")}}


def for_path(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """An error body (our envelope) as the API of `path` shapes its errors."""
    return anthropic_error(body["error"]) if path in ANTHROPIC_PATHS else body


class InvalidRequest(APIError):
    status = 400
    type = "invalid_request_error"


OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


class ContextLengthExceeded(APIError):
    status = 400
    type = "context_length_exceeded"

    def __init__(self, message: str, *, param: str | None = None, tokens: int | None = None, context: int = 0) -> None:
        super().__init__(message, param=param)
        self.tokens, self.context = tokens, context

    def body_for(self, path: str) -> dict[str, Any]:
        if path in ANTHROPIC_PATHS and self.tokens is not None:
            # Anthropic's own words, which Claude Code reads to compact the conversation and say why.
            message = f"prompt is too long: {self.tokens} tokens > {self.context} maximum"
            return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
        body = super().body_for(path)
        if path in OPENAI_PATHS:
            # OpenAI's clients branch on this `code` (Codex then says its context window is full).
            body["error"]["code"] = self.type
        return body


class AuthenticationError(APIError):
    status = 401
    type = "authentication_error"

    def __init__(self) -> None:
        # The seed fixes this message: it says nothing about whether the key exists.
        super().__init__("Invalid API key")


class KeyExpired(AuthenticationError):
    """A key past its `expires_at`: only its holder can see this, so it may say what happened."""

    def __init__(self, expired_at: float) -> None:
        when = datetime.datetime.fromtimestamp(expired_at, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        APIError.__init__(self, f"This API key expired at {when}: ask an admin for a new key or a later expiry.")


class PermissionDenied(APIError):
    status = 403
    type = "permission_error"


class NotFound(APIError):
    status = 404
    type = "not_found_error"


class ModelNotFound(APIError):
    status = 404
    type = "model_not_found"


class MethodNotAllowed(APIError):
    status = 405
    type = "invalid_request_error"


class Conflict(APIError):
    status = 409
    type = "conflict_error"


class RequestTooLarge(APIError):
    status = 413
    type = "request_too_large"


class UnsupportedMediaType(APIError):
    status = 415
    type = "unsupported_media_type"


class RateLimited(APIError):
    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class ClientClosedRequest(APIError):
    """Nobody reads this one: it only marks the request in the access log (nginx's 499)."""

    status = 499
    type = "client_closed_request"


class UpstreamError(APIError):
    status = 502
    type = "upstream_error"


class InstanceUnavailable(UpstreamError):
    """The instance could not be reached or dropped the connection: it may have died."""


class Overloaded(APIError):
    status = 503
    type = "overloaded_error"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class GatewayTimeout(APIError):
    status = 504
    type = "timeout_error"


class ServerError(APIError):
    status = 500
    type = "server_error"


class StateUnavailable(Overloaded):
    """The shared state (the database, or Redis for a key's limits) cannot be reached: retry shortly."""


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class FieldProblem(ValueError):
    """A check across fields (a pydantic model validator's) that knows which one to fix: the 400 names it
    as its `param`, so that a form shows the problem at that field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param

    def refusal(self) -> InvalidRequest:
        """The 400 for it, as pydantic's own errors read: `param: message`, naming the param."""
        return InvalidRequest(f"{self.param}: {self}", param=self.param)


def validation_error(errors: Any) -> InvalidRequest:
    """Our 400 for the first of pydantic's (or FastAPI's) validation errors, naming the parameter."""
    first = errors[0] if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path")]
    # Drop the tags pydantic adds for union members (`str`, `list[...]`, `constrained-str`, …).
    location = [part for part in location if not ("[" in part or "-" in part or part in _TYPE_TAGS)]
    problem = (first.get("ctx") or {}).get("error")
    if not location and isinstance(problem, FieldProblem):
        location = [problem.param]
    param = ".".join(location) or None
    message = str(first.get("msg", "Invalid request")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = "Field required"
    if first.get("type") == "extra_forbidden":
        # OpenAI's words for a field it does not know.
        return InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param)
    return InvalidRequest(f"{param}: {message}" if param else message, param=param)
