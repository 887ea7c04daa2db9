"""The gateway's request spans (OpenTelemetry), when ``opentelemetry-api`` is installed.

One ``SERVER`` span per request (except ``/metrics`` and ``/healthz``), a child of the
caller's span when the request carries W3C trace context (``traceparent``), from the
request to the last byte of the answer. Its name is the method and the route
(``POST /v1/chat/completions``; ``POST`` alone on passthrough paths, so names stay few);
its attributes: ``http.request.method``, ``http.route`` (cached routes), ``url.path``,
``http.response.status_code``, ``flightcache.cache`` (the ``X-Cache`` outcome),
``flightcache.key`` (the key digest, never the body), ``flightcache.age_s`` (on a hit). A
5xx answer, or one broken off, sets the span's status to error. Without the package
nothing is recorded; with it and no tracer provider configured, the API's no-op tracer
records nothing either, and the gateway makes no span at all until a provider is configured
(it looks for one at each request: the API's no-op span cost 20 us a request).
``make_app(tracer_provider=...)`` uses a provider of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from .._types import UNSET
from ..telemetry import _global_tracer

try:
    from opentelemetry import propagate, trace
    from opentelemetry.trace import SpanKind, Status, StatusCode
except ImportError:  # the otel extra is not installed: no spans
    trace = None  # type: ignore[assignment]

__all__ = ["RequestSpan", "Tracing"]

_OUTCOMES = frozenset({b"HIT", b"MISS", b"COALESCED", b"BYPASS"})


class RequestSpan:
    """What the middleware tells the span of one request as its answer goes out."""

    def __init__(self, span: Any) -> None:
        self._span = span

    def response(self, status: int, headers: Any) -> None:
        span = self._span
        if span is None:
            return
        span.set_attribute("http.response.status_code", status)
        ours = any(k.lower() == b"x-cache" and v in _OUTCOMES for k, v in headers)
        if not ours:
            return  # a passthrough answer: its headers are the upstream's
        for name, value in headers:
            key = name.lower()
            if key == b"x-cache":
                span.set_attribute("flightcache.cache", value.decode("latin-1"))
            elif key == b"x-flightcache-key":
                span.set_attribute("flightcache.key", value.decode("latin-1"))
            elif key == b"age" and value.isdigit():
                span.set_attribute("flightcache.age_s", int(value))
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))


class Tracing:
    """The tracer of one app: the provider given to it, else the global one once configured
    (None without the package: no spans)."""

    def __init__(self, provider: Any = UNSET) -> None:
        """``provider``: a tracer provider; UNSET or None for the global one."""
        self._tracer: Any = None
        self._global = trace is not None and (provider is UNSET or provider is None)
        if trace is not None and not self._global:
            self._tracer = trace.get_tracer("flightcache.gateway", tracer_provider=provider)

    def _current(self) -> Any:
        """The tracer for a request now: until the process configures a global provider,
        None (the API's no-op tracer would record nothing, and cost 20 us a request)."""
        if self._tracer is None and self._global:
            self._tracer = _global_tracer("flightcache.gateway")
        return self._tracer

    @contextlib.contextmanager
    def request(self, scope: Mapping[str, Any], route: str | None) -> Iterator[RequestSpan]:
        tracer = self._current()
        if tracer is None:
            yield RequestSpan(None)
            return
        method, path = scope["method"], scope["path"]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = propagate.extract(headers)
        name = f"{method} {path}" if route else method
        attributes: dict[str, Any] = {"http.request.method": method, "url.path": path}
        if route:
            attributes |= {"http.route": path, "flightcache.route": route}
        with tracer.start_as_current_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=attributes
        ) as span:
            yield RequestSpan(span)
