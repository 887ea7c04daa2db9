"""``flightcache serve``: an OpenAI-compatible gateway in which identical requests, across
every replica that shares one Redis, become one upstream call (docs/gateway.md).

``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` (OpenAI's Responses
API) and ``/v1/messages`` (Anthropic's Messages API) always go upstream as streams through
``fc.stream``, so a request and its streaming twin share one flight: stream clients get the
events live as SSE, non-stream clients get the answer they add up to. ``POST
/v1/embeddings`` is a flight of one chunk. Everything else is proxied untouched.
``GET /metrics`` (Prometheus) and ``GET /healthz`` are the gateway's own. ``docs/gateway.md``
describes the keys, the policy, the headers and the error behaviour.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .._cache import FlightCache
from .._errors import BackendUnavailable, FlightError, StreamRestarted
from .._protocol.streaming import FlightStream
from .._types import UNSET
from .._waits import within
from ..integrations._answers import (
    age_of,
    answer_of,
    for_client,
    is_stamp,
    mark_cached,
    stamped,
    usage_of,
)
from ..telemetry import instrument
from ._config import GatewayConfig
from ._http import upstream_session
from ._metrics import CONTENT_TYPE_LATEST, Accounting, GatewayMetrics
from ._requestkey import ROUTES, BadRequest, Plan, Policy, plan_request
from ._response import StreamedBody
from ._tracing import Tracing
from ._upstream import Upstream, UpstreamError, describe_error, openai_error
from ._wire import anthropic_body, error_response

__all__ = ["GatewayConfig", "make_app"]

log = logging.getLogger("flightcache.gateway")

MAX_ATTEMPTS = 3  # a flight restarted before this caller sent anything is joined again
HEALTH_TIMEOUT_S = 2.0
ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def _json(body: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status, headers, media_type="application/json")


def _sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def _event(plan: Plan, data: Any) -> bytes:
    """One SSE event: ``data`` only on the completion routes, named after the event's
    ``type`` on the Responses and Messages APIs (the Anthropic client reads the names)."""
    if plan.route in ("responses", "messages") and isinstance(data, dict):
        return b"event: " + str(data.get("type")).encode() + b"\n" + _sse(data)
    return _sse(data)


def _stream_error(plan: Plan, status: int, body: dict[str, Any], sent: int) -> bytes:
    """The SSE error event that ends a stream after its first event, in the route's shape."""
    if plan.route == "messages":
        return b"event: error\n" + _sse(anthropic_body(status, body))
    if plan.route == "responses":
        given = body.get("error")
        error: dict[str, Any] = given if isinstance(given, dict) else {}
        event = {"type": "error", "code": error.get("code"), "message": error.get("message")}
        event |= {"param": error.get("param"), "sequence_number": sent}
        return b"event: error\n" + _sse(event)
    return _sse(body)


def _error_body(plan: Plan, status: int, body: dict[str, Any]) -> dict[str, Any]:
    return anthropic_body(status, body) if plan.route == "messages" else body


class _Opened:
    """A joined flight: the caller's source, its chunks so far, and the answer's age."""

    def __init__(self, source: str, flight: FlightStream, chunks: list[Any]) -> None:
        self.source = source
        self.flight = flight
        self.chunks = chunks
        self.age: float | None = None


class _Failed(Exception):
    """A flight failed before this caller got anything: the error and the caller's source."""

    def __init__(self, source: str, error: Exception) -> None:
        super().__init__(str(error))
        self.source = source
        self.error = error


class _Gateway:
    """The handlers of one app, and what its lifespan creates (cache, upstream client)."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self._fc: FlightCache | None = None
        self._upstream: Upstream | None = None
        self.tracer_provider: Any = UNSET  # the request spans' provider, for the cache's too

    @property
    def fc(self) -> FlightCache:
        if self._fc is None:
            raise RuntimeError("the gateway is not running (lifespan not started)")
        return self._fc

    @property
    def upstream(self) -> Upstream:
        if self._upstream is None:
            raise RuntimeError("the gateway is not running (lifespan not started)")
        return self._upstream

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        config = self.config
        http = upstream_session(
            config.upstream,
            max_connections=config.max_connections,
            upstream_timeout=config.upstream_timeout,
            connect_timeout=config.connect_timeout,
        )
        fc = FlightCache(
            config.redis_url or "embedded://",
            namespace=config.namespace,
            ttl=config.policy.ttl,
            lease=config.lease,
            timeout=config.timeout,
            error_ttl=config.error_ttl,
            max_value_bytes=config.max_value_bytes,
            near_cache=False,  # answers are streamed from the flight, never from a lease
        )
        if self.tracer_provider is not UNSET:  # the cache's spans go where the requests' go
            instrument(fc, tracer_provider=self.tracer_provider)
        async with http, fc:
            self._fc = fc
            self._upstream = Upstream(
                config.upstream,
                http,
                client_error_ttl=config.error_ttl,
                read_timeout=config.upstream_timeout,
                on_call=self.metrics.upstream_call,
            )
            self.metrics.watch(lambda: fc.stats)
            try:
                await within(fc.ping(), HEALTH_TIMEOUT_S)
            except (FlightError, asyncio.TimeoutError) as exc:
                log.warning("the cache server does not answer yet (%s)", type(exc).__name__)
            try:
                yield
            finally:
                self._fc = self._upstream = None

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        too_large = BadRequest(f"the request body is over {limit} bytes", status=413)
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        parts: list[bytes] = []
        size = 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise too_large
            parts.append(part)
        return b"".join(parts)

    def _refused(self, exc: BadRequest, route: str | None = None) -> Response:
        self.metrics.error("bad_request")
        refused = error_response(exc.status, str(exc), param=exc.param, code=exc.code)
        if route == "messages":
            body = anthropic_body(exc.status, orjson.loads(bytes(refused.body)))
            return _json(body, exc.status)
        return refused

    # -- the cached routes ---------------------------------------------------------------

    async def cached_route(self, request: Request) -> Response:
        try:
            raw = await self._read_body(request)
            plan = plan_request(request.url.path, raw, request.headers, self.config.policy)
        except BadRequest as exc:
            return self._refused(exc, ROUTES.get(request.url.path))
        if plan.bypass:
            log.debug("%s: proxied uncached (%s)", plan.route, plan.bypass_reason)
            return await self._bypass(request, raw, plan)
        forwarded = Upstream.forwarded_headers(request.headers)
        try:
            opened = await self._open(plan, forwarded)
        except BackendUnavailable as exc:
            log.warning("key %s: cache server unavailable (%s); proxying directly", plan.key, exc)
            self.metrics.error("backend")
            return await self._bypass(request, raw, plan)
        except _Failed as failed:
            return self._error_response(failed.error, failed.source, plan)
        source, flight, chunks = opened.source, opened.flight, opened.chunks
        headers = {"x-cache": source, "x-flightcache-key": plan.key}
        if source == "HIT" and opened.age is not None:
            headers["age"] = str(int(opened.age))
        log.debug("%s key %s: %s", plan.route, plan.key, source)
        if plan.stream:
            headers |= {"cache-control": "no-cache", "x-accel-buffering": "no"}
            events = self._events(plan, source, flight, chunks)
            return StreamedBody(events, headers=headers, media_type="text/event-stream")
        await flight.aclose()
        try:
            answer = answer_of(plan.route, chunks)
        except ValueError:
            message = f"flightcache gateway: no {plan.route} answer in the upstream's stream"
            failure = UpstreamError(502, openai_error(message, status=502))
            return self._error_response(failure, source, plan)
        if source == "HIT":
            answer = mark_cached(plan.route, answer)
        self._saved(plan, source, chunks)
        return _json(answer, 200, headers)

    def _saved(self, plan: Plan, source: str, chunks: list[Any]) -> None:
        """Count the tokens a caller got without an upstream call of its own."""
        if source not in ("HIT", "COALESCED"):
            return
        usage = usage_of(plan.route, chunks)
        if usage is not None:
            model = usage.model or str(plan.body.get("model") or "")
            self.metrics.saved(model, plan.tenant, usage.prompt, usage.completion)

    def _producer(self, plan: Plan, headers: Mapping[str, str]) -> Any:
        upstream = self.upstream
        if plan.route == "embeddings":

            async def one_answer() -> AsyncIterator[Any]:
                yield await upstream.fetch_json(plan.route, plan.path, plan.upstream_body, headers)

            return lambda: stamped(one_answer())
        return lambda: stamped(
            upstream.stream_chunks(plan.route, plan.path, plan.upstream_body, headers)
        )

    async def _open(self, plan: Plan, headers: Mapping[str, str]) -> _Opened:
        """Join or start the flight: the caller's source and its first event (stream
        clients) or all of them (others). Where the caller has sent nothing yet, a restarted
        stream is joined again, and under shared keys so is another caller's auth error; a
        stored answer older than the request's ``max-age`` is refreshed."""
        shared_auth_retried = False
        refresh = plan.refresh
        attempt = 0
        while True:
            attempt += 1
            producer = self._producer(plan, headers)
            flight = self.fc.stream(
                plan.key, producer, ttl=plan.ttl, refresh=refresh, store=plan.store
            )
            opened = _Opened("NONE", flight, [])
            try:
                opened.source = await flight.opened()
                async for chunk in flight:
                    opened.chunks.append(chunk)
                    if is_stamp(chunk):
                        opened.age = age_of(chunk)
                    elif plan.stream:
                        break  # the rest is streamed to the client as it comes
                stale = plan.max_age is not None and (opened.age or 0.0) > plan.max_age
                if opened.source == "HIT" and stale and not refresh:
                    await flight.aclose()
                    refresh = True  # older than the caller accepts: a new answer
                    continue
                return opened
            except StreamRestarted as exc:
                await flight.aclose()
                if attempt >= MAX_ATTEMPTS:
                    raise _Failed(opened.source, exc) from exc
                log.info("key %s: stream restarted by a new owner; joining again", plan.key)
            except BackendUnavailable:
                await flight.aclose()
                raise
            except Exception as exc:
                await flight.aclose()
                source = opened.source
                status = describe_error(exc)[0]
                foreign = self.config.policy.share_across_keys and source != "MISS"
                if not (foreign and status in (401, 403)):
                    raise _Failed(source, exc) from exc
                if not shared_auth_retried:
                    shared_auth_retried = True  # another caller's key was refused, not ours
                    continue
                # Never show one tenant the upstream's words about another tenant's key.
                message = (
                    "flightcache gateway: the upstream refused the credentials of the request "
                    "this one was coalesced with (answers are shared across keys); retry"
                )
                refused = UpstreamError(status, openai_error(message, status=status))
                raise _Failed(source, refused) from exc

    async def _events(
        self, plan: Plan, source: str, flight: FlightStream, first: list[Any]
    ) -> AsyncIterator[bytes]:
        hit = source == "HIT"
        seen = list(first)
        sent = 0

        def events_of(chunks: list[Any]) -> bytes:
            """The client's events for ``chunks``, as one write (counted in ``sent``)."""
            nonlocal sent
            events = []
            for chunk in chunks:
                out = for_client(plan.route, chunk, plan.include_usage, hit)
                if out is not None:
                    events.append(_event(plan, out))
            sent += len(events)
            return b"".join(events)

        try:
            if data := events_of(first):
                yield data
            async for chunk in flight:
                # The chunks that came together go out in one write: a replica that falls
                # behind catches up with fewer sends, not more.
                batch = [chunk, *flight.ready()]
                seen += batch
                if data := events_of(batch):
                    yield data
            if plan.route in ("chat", "completions"):
                yield b"data: [DONE]\n\n"
            self._saved(plan, source, seen)
        except Exception as exc:  # after the first byte: an SSE error event ends the stream
            status, body, _, kind = describe_error(exc)
            self.metrics.error(kind)
            log.warning("key %s: stream ended by an error (%d, %s)", plan.key, status, kind)
            yield _stream_error(plan, status, body, sent)
        finally:
            await flight.aclose()

    def _error_response(self, exc: Exception, source: str, plan: Plan) -> Response:
        status, body, headers, kind = describe_error(exc)
        self.metrics.error(kind)
        if kind == "internal":
            log.error("key %s: %s", plan.key, type(exc).__name__, exc_info=exc)
        else:
            log.info("key %s: error %d (%s)", plan.key, status, kind)
        headers = {**headers, "x-cache": source, "x-flightcache-key": plan.key}
        return _json(_error_body(plan, status, body), status, headers)

    async def _bypass(self, request: Request, raw: bytes, plan: Plan) -> Response:
        return await self.upstream.proxy(
            "POST",
            plan.path,
            request.url.query,
            request.headers.items(),
            raw,
            route=plan.route,
            extra_headers={"x-cache": "BYPASS"},
        )

    # -- everything else -----------------------------------------------------------------

    async def passthrough(self, request: Request) -> Response:
        try:
            raw = await self._read_body(request)
        except BadRequest as exc:
            return self._refused(exc)
        raw_path = request.scope.get("raw_path")
        path = raw_path.decode("latin-1") if raw_path else request.url.path
        return await self.upstream.proxy(
            request.method, path, request.url.query, request.headers.items(), raw
        )

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), headers={"content-type": CONTENT_TYPE_LATEST})

    async def healthz(self, request: Request) -> Response:
        fc = self.fc
        started = time.perf_counter()
        backend = "embedded" if self.config.redis_url is None else "redis"
        try:
            await within(fc.ping(), HEALTH_TIMEOUT_S)
        except (FlightError, asyncio.TimeoutError) as exc:
            body = {"status": "unavailable", "backend": backend, "error": type(exc).__name__}
            return _json(body, 503)
        latency_ms = round((time.perf_counter() - started) * 1000, 3)
        return _json(
            {
                "status": "ok",
                "backend": backend,
                "namespace": self.config.namespace,
                "redis_latency_ms": latency_ms,
            }
        )


async def _internal_error(request: Request, exc: Exception) -> Response:
    message = f"flightcache gateway: internal error ({type(exc).__name__})"
    return _json(openai_error(message, status=500), 500)


def make_app(
    *,
    upstream: str,
    redis_url: str | None,
    namespace: str = "gateway",
    share_across_keys: bool = False,
    cache_sampled: bool = True,
    ttl: float = 3600.0,
    lease: float = 3.0,
    timeout: float = 600.0,
    error_ttl: float = 2.0,
    upstream_timeout: float = 300.0,
    connect_timeout: float = 10.0,
    max_connections: int = 256,
    max_body_bytes: int = 32 * 1024 * 1024,
    max_value_bytes: int = 64 * 1024 * 1024,
    tracer_provider: Any = UNSET,
) -> Starlette:
    """The gateway as a Starlette app; its lifespan opens and closes the cache and client.

    ``upstream``: the upstream API's base URL (``/v1`` at its end is optional).
    ``redis_url``: the shared Redis/Valkey (None: a private embedded server, not shared).
    ``share_across_keys``: one answer for every API key (else the key's digest is part of the
    cache key). ``cache_sampled``: store sampled answers (temperature > 0 or omitted, no
    seed); they are coalesced either way. ``ttl``: seconds an answer is stored.
    ``lease``/``timeout``: the flight's owner lease and the bound on one whole upstream
    answer. ``error_ttl``: seconds a 4xx answer (other than 401, 403, 408, 409, 429) is
    negative-cached. ``upstream_timeout``: seconds without a byte from the upstream before a
    call fails with 504; ``connect_timeout``, ``max_connections``: the upstream client's.
    ``max_body_bytes``: the largest request body (413 above). ``max_value_bytes``: the
    largest answer the cache stores (a larger one fails with 502). ``tracer_provider``:
    the OpenTelemetry provider of the request spans (default: the global one; spans need
    ``opentelemetry-api``, see ``_tracing``).
    """
    config = GatewayConfig(
        upstream=upstream,
        redis_url=redis_url,
        namespace=namespace,
        policy=Policy(share_across_keys=share_across_keys, cache_sampled=cache_sampled, ttl=ttl),
        lease=lease,
        timeout=timeout,
        error_ttl=error_ttl,
        upstream_timeout=upstream_timeout,
        connect_timeout=connect_timeout,
        max_connections=max_connections,
        max_body_bytes=max_body_bytes,
        max_value_bytes=max_value_bytes,
    )
    config.check()
    metrics = GatewayMetrics()
    gateway = _Gateway(config, metrics)
    gateway.tracer_provider = tracer_provider
    routes = [
        Route("/v1/chat/completions", gateway.cached_route, methods=["POST"]),
        Route("/v1/completions", gateway.cached_route, methods=["POST"]),
        Route("/v1/embeddings", gateway.cached_route, methods=["POST"]),
        Route("/v1/responses", gateway.cached_route, methods=["POST"]),
        Route("/v1/messages", gateway.cached_route, methods=["POST"]),
        Route("/metrics", gateway.metrics_endpoint, methods=["GET"]),
        Route("/healthz", gateway.healthz, methods=["GET"]),
        Route("/{path:path}", gateway.passthrough, methods=ALL_METHODS),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(Accounting, metrics=metrics, tracing=Tracing(tracer_provider))],
        lifespan=gateway.lifespan,
        exception_handlers={Exception: _internal_error},
    )
    app.state.gateway_config = config
    app.state.metrics = metrics
    return app
