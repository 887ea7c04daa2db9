"""The gateway's Prometheus metrics, in a registry of each app's own (prometheus-client).

Counted by :class:`Accounting`, an ASGI middleware that sees every response: requests by
route, ``X-Cache`` outcome and status, the request duration (to the last byte) and the time
to the first byte. The upstream client counts its calls by route and status, the handlers
count errors by kind and the tokens a cached or coalesced answer saved (by model and tenant
digest), and the :class:`flightcache.FlightCache` counters are read at scrape time. Routes
are a fixed set of labels (``chat``, ``completions``, ``embeddings``, ``responses``,
``messages``, ``other``), never the raw path; at most ``MAX_SAVED_SERIES`` (model, tenant)
pairs are labelled, later ones count as ``other``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._requestkey import ROUTES
from ._tracing import RequestSpan, Tracing

__all__ = ["CONTENT_TYPE_LATEST", "Accounting", "GatewayMetrics"]

_LATENCY_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
)
_STAT_HELP = {
    "calls": "fc.do() calls",
    "hits": "calls answered from a stored result",
    "streams": "fc.stream() calls (one per gateway request through the cache)",
    "gets": "fc.get() calls (health checks)",
    "get_hits": "fc.get() calls that found a value",
    "misses": "calls that found no stored result and joined or started a flight",
    "coalesced": "callers that joined a flight already running in this process",
    "follows": "times this process followed another process's flight",
    "loader_runs": "flights this process owned (upstream calls made through the cache)",
    "loader_errors": "owned flights that ended in an error",
    "timeouts": "owned flights that ran past their timeout",
    "takeovers": "flights this process took over from an owner whose lease lapsed",
    "lease_lost": "owned flights whose lease another process took over",
    "fenced_writes": "writes refused because another owner held the flight",
    "commands": "Redis commands sent",
}
_NAME = re.compile(r"[^a-zA-Z0-9_]")
_OUTCOMES = frozenset({b"HIT", b"MISS", b"COALESCED", b"BYPASS"})
MAX_SAVED_SERIES = 1000


class _CacheCollector:
    """The FlightCache counters of this process, read at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, int] | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        stats = self._stats()
        if not stats:
            return
        for name, value in sorted(stats.items()):
            metric = "redis_commands" if name == "commands" else _NAME.sub("_", name)
            doc = _STAT_HELP.get(name, f"flightcache counter {name}")
            yield CounterMetricFamily(f"flightcache_{metric}", doc, value=value)


class GatewayMetrics:
    """Every metric of one gateway app."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()

        def latency(name: str, doc: str) -> Histogram:
            """A time from the request to a point of its answer, by route and X-Cache."""
            return Histogram(name, doc, ["route", "cache"], buckets=_LATENCY_BUCKETS, registry=r)

        self.requests = Counter(
            "flightcache_gateway_requests",
            "Requests answered, by route, X-Cache outcome (NONE: not through the cache) and "
            "HTTP status",
            ["route", "cache", "status"],
            registry=r,
        )
        self.upstream = Counter(
            "flightcache_gateway_upstream_requests",
            "Requests sent to the upstream, by route and status (or timeout, connect_error)",
            ["route", "status"],
            registry=r,
        )
        self.errors = Counter(
            "flightcache_gateway_errors",
            "Errors, by kind: bad_request, upstream, restarted, backend, timeout, internal",
            ["kind"],
            registry=r,
        )
        self.duration = latency(
            "flightcache_gateway_request_duration_seconds",
            "Time from the request to the last byte of the answer",
        )
        self.first_byte = latency(
            "flightcache_gateway_time_to_first_byte_seconds",
            "Time from the request to the first byte of the answer's body",
        )
        self.in_flight = Gauge(
            "flightcache_gateway_requests_in_flight", "Requests being answered", registry=r
        )
        self.saved_tokens = Counter(
            "flightcache_gateway_saved_tokens",
            "Tokens not bought: the upstream's usage of answers served from the cache (HIT) "
            "or shared from another caller's flight (COALESCED), by model, tenant digest and "
            "kind (prompt, completion)",
            ["model", "tenant", "kind"],
            registry=r,
        )
        self.saved_requests = Counter(
            "flightcache_gateway_saved_requests",
            "Answers served without an upstream call of their own (HIT or COALESCED), by "
            "model and tenant digest",
            ["model", "tenant"],
            registry=r,
        )
        self._saved_series: set[tuple[str, str]] = set()
        self._stats: Callable[[], dict[str, int] | None] = lambda: None
        r.register(_CacheCollector(lambda: self._stats()))

    def watch(self, stats: Callable[[], dict[str, int] | None]) -> None:
        """Read the FlightCache counters from ``stats`` at scrape time."""
        self._stats = stats

    def upstream_call(self, route: str, status: str) -> None:
        self.upstream.labels(route, status).inc()

    def error(self, kind: str) -> None:
        self.errors.labels(kind).inc()

    def saved(self, model: str, tenant: str, prompt: int, completion: int) -> None:
        """An answer this caller got without an upstream call of its own, and its tokens."""
        series = (model[:100], tenant)
        if series not in self._saved_series:
            if len(self._saved_series) >= MAX_SAVED_SERIES:
                series = ("other", "other")
            else:
                self._saved_series.add(series)
        self.saved_requests.labels(*series).inc()
        self.saved_tokens.labels(*series, "prompt").inc(prompt)
        self.saved_tokens.labels(*series, "completion").inc(completion)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def route_label(method: str, path: str) -> str:
    route = ROUTES.get(path)
    return route if route is not None and method == "POST" else "other"


class Accounting:
    """ASGI middleware: counts and times every response except ``/metrics`` and ``/healthz``."""

    def __init__(
        self, app: ASGIApp, metrics: GatewayMetrics, tracing: Tracing | None = None
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.tracing = tracing or Tracing(None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in ("/metrics", "/healthz"):
            await self.app(scope, receive, send)
            return
        metrics = self.metrics
        route = route_label(scope["method"], scope["path"])
        started = time.perf_counter()
        seen: dict[str, Any] = {"status": 0, "cache": "NONE", "first": False}
        span: RequestSpan | None = None

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                if span is not None:
                    span.response(message["status"], message.get("headers", ()))
                for name, value in message.get("headers", ()):
                    if name.lower() == b"x-cache" and value in _OUTCOMES:
                        seen["cache"] = value.decode()  # not an upstream's own X-Cache
            elif message["type"] == "http.response.body" and not seen["first"]:
                if message.get("body") or not message.get("more_body", False):
                    seen["first"] = True
                    elapsed = time.perf_counter() - started
                    metrics.first_byte.labels(route, seen["cache"]).observe(elapsed)
            await send(message)

        metrics.in_flight.inc()
        try:
            with self.tracing.request(scope, None if route == "other" else route) as span:
                await self.app(scope, receive, counting_send)
        finally:
            metrics.in_flight.dec()
            cache = seen["cache"]
            metrics.requests.labels(route, cache, str(seen["status"] or "none")).inc()
            metrics.duration.labels(route, cache).observe(time.perf_counter() - started)
