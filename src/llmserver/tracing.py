"""Optional OpenTelemetry tracing: spans sent over OTLP/HTTP to `otlp_endpoint` (off by default).

One span per request (`METHOD /path`, kind server), a child of the client's `traceparent` when it
sent one, with child spans for what the request waits on: `admission` (key limits, quota),
`inputs` (images fetched, files extracted), `queue` (the wait for a slot), `instance call` (the call
to llama-server, with a `first token` event; a stream's span ends with the stream). An async job's
work stays in the trace of the request that submitted it; each webhook delivery is a span of its own
(`webhook delivery`).

Off, each of those places costs one call that returns a shared no-op context (measured in
bench/hotpath.py). The OpenTelemetry SDK and its OTLP exporter are the `tracing` extra
(`pip install 'llmserver[tracing]'`), imported only when tracing is on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger(__name__)

_tracer: Tracer | None = None
_provider: Any = None
_OFF: AbstractContextManager[None] = contextlib.nullcontext()

Attributes = Mapping[str, str | int | float | bool]


def configure(endpoint: str | None, service: str) -> None:
    """Send spans to `endpoint` (its base URL: spans go to ENDPOINT/v1/traces); None: tracing off."""
    global _tracer, _provider
    if not endpoint:
        _tracer = _provider = None
        return
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(
            "otlp_endpoint is set, but the OpenTelemetry SDK is not installed: pip install 'llmserver[tracing]'"
        ) from exc
    from llmserver import __version__

    provider = TracerProvider(resource=Resource.create({"service.name": service, "service.version": __version__}))
    url = endpoint.rstrip("/") + "/v1/traces"
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url, timeout=5)))
    _provider, _tracer = provider, provider.get_tracer("llmserver")
    log.info("tracing: spans go to %s", url)


def shutdown() -> None:
    """Send the spans still buffered (at a stop)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def on() -> bool:
    return _tracer is not None


def span(name: str, attributes: Attributes | None = None) -> AbstractContextManager[Any]:
    """A child span of the current one while the block runs; a shared no-op when tracing is off."""
    if _tracer is None:
        return _OFF
    return _tracer.start_as_current_span(name, attributes=attributes)


def start(name: str, attributes: Attributes | None = None) -> Span | None:
    """A child span of the current one that the caller ends (`end`); None when tracing is off."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, attributes=attributes)


def end(started: Span | None, error: BaseException | None = None) -> None:
    if started is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        started.set_status(Status(StatusCode.ERROR, type(error).__name__))
    started.end()


def server_span(
    name: str, headers: Iterable[tuple[bytes, bytes]], attributes: Attributes
) -> AbstractContextManager[Span]:
    """A request's span (kind server), a child of the client's `traceparent` when it sent one."""
    assert _tracer is not None
    from opentelemetry.propagate import extract
    from opentelemetry.trace import SpanKind

    carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k in (b"traceparent", b"tracestate")}
    return _tracer.start_as_current_span(name, context=extract(carrier), kind=SpanKind.SERVER, attributes=attributes)
