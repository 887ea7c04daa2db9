"""The library's spans and metrics: OpenTelemetry, or a ``prometheus_client`` collector
(docs/observability.md).

With ``opentelemetry-api`` installed (the ``otel`` extra) every ``FlightCache`` reports to
the global providers, with nothing to call: a span per ``do`` and per ``stream`` (a child of
the caller's current span, for ``FlightCacheSync`` too: asyncio runs each call it hands
its loop thread in a copy of the calling thread's context), and an observable counter per
counter of ``fc.stats`` plus a histogram of followers' waits on the global
``MeterProvider``. Until the app configures a tracer
provider no span is made at all, and a call pays what it pays with telemetry off (an open
cache looks for a provider once a second meanwhile). Without the package nothing is
imported and nothing recorded. ``instrument(fc, tracer_provider=..., meter_provider=...)``
sends one cache's spans or metrics elsewhere (None: nowhere).

``PrometheusCollector(fc, ...)`` serves the same counters and histogram to a
``prometheus_client`` registry: ``REGISTRY.register(PrometheusCollector(fc))``.

Span attributes: ``flightcache.namespace``, ``flightcache.digest`` (the key's digest, never
the key), ``flightcache.role`` (``hit``, ``owner``, ``takeover``, ``follower``: another
process runs it, ``coalesced``: another call of this process asked first, ``rejected``: a
Bloom filter's ``NOT_FOUND``), ``flightcache.token`` and ``flightcache.attempt`` (a run this
process owned), ``flightcache.wait_ms`` (time spent waiting for a result another call
made), ``flightcache.near_cache`` (a hit from the near cache) and ``flightcache.outcome``
(``ok``, ``not_found``, ``error``, ``timeout``, ``fail_open``, ``cancelled``, ``abandoned``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import weakref
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import fields
from typing import TYPE_CHECKING, Any, TypeVar

from ._errors import ConfigError, FlightTimeout
from ._protocol.observed import COALESCED, FOLLOWER, HIT, OWNER, TAKEOVER, CallRecord
from ._types import NOT_FOUND, UNSET, WAIT_BOUNDS_S, Histogram, Stats

if TYPE_CHECKING:
    from ._cache import FlightCache
    from ._engine import Engine
    from ._sync import FlightCacheSync

__all__ = ["PrometheusCollector", "instrument"]

T = TypeVar("T")

NAME = "flightcache"
VERSION = "0.1.0"
COUNTERS = tuple(f.name for f in fields(Stats) if f.type in ("int", int) and f.name != "owning")
POLL_S = 1.0  # how often an open cache looks for a tracer provider until there is one
WAIT_METRIC = "flightcache.follow_wait"
WAIT_HELP = "Seconds from following another process's flight to its answer (do calls)"


class _Api:
    """The OpenTelemetry API, imported on first use (``None`` without the package)."""

    def __init__(self) -> None:
        from opentelemetry import context, metrics, trace
        from opentelemetry.metrics import Observation
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self.context, self.metrics, self.trace = context, metrics, trace
        self.Observation, self.Status, self.StatusCode = Observation, Status, StatusCode
        self.internal = SpanKind.INTERNAL
        self.unset = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
        # Until the app sets a global tracer provider, the API's module-level slot for it is
        # None: reading it is the whole cost of a call then (get_tracer_provider() costs
        # more than a near-cache hit: it looks up an environment variable each time).
        # Without that slot, or with a provider named in the environment, ask the API.
        self.watch_slot = (
            hasattr(trace, "_TRACER_PROVIDER") and "OTEL_PYTHON_TRACER_PROVIDER" not in os.environ
        )


_api: _Api | None = None
_tried = False


def _otel() -> _Api | None:
    global _api, _tried
    if not _tried:
        _tried = True
        try:
            _api = _Api()
        except ImportError:  # the otel extra is not installed: nothing is recorded
            _api = None
    return _api


def _global_tracer(name: str, version: str | None = None) -> Any:
    """The global tracer provider's tracer named ``name``, once the process has configured
    one; None before (a provider is set once per process: until then, spans would go
    nowhere) and without the package."""
    api = _otel()
    if api is None or (api.watch_slot and api.trace._TRACER_PROVIDER is None):
        return None  # no provider yet: nothing to check but the slot
    provider = api.trace.get_tracer_provider()
    if isinstance(provider, api.unset):
        return None
    return provider.get_tracer(name, version)


class _Instruments:
    """The library's instruments on one meter provider, and the caches they report."""

    def __init__(self, api: _Api, provider: Any) -> None:
        self.api = api
        self.caches: weakref.WeakSet[Engine] = weakref.WeakSet()
        meter = api.metrics.get_meter(NAME, VERSION, meter_provider=provider)
        for name in COUNTERS:
            meter.create_observable_counter(
                f"flightcache.{name}", callbacks=[self._reader(name)], description=_help(name)
            )
        meter.create_observable_up_down_counter(
            "flightcache.owning", callbacks=[self._reader("owning")], description=_help("owning")
        )
        self.follow_wait = meter.create_histogram(
            WAIT_METRIC, unit="s", description=WAIT_HELP,
            explicit_bucket_boundaries_advisory=WAIT_BOUNDS_S,
        )  # fmt: skip

    def _reader(self, name: str) -> Callable[[Any], Iterable[Any]]:
        def read(options: Any) -> Iterable[Any]:
            sums: dict[str, int] = {}
            for cache in list(self.caches):
                ns = cache.namespace
                sums[ns] = sums.get(ns, 0) + getattr(cache._stats, name)
            return [
                self.api.Observation(v, {"flightcache.namespace": ns}) for ns, v in sums.items()
            ]

        return read


_global: _Instruments | None = None
_by_provider: weakref.WeakKeyDictionary[Any, _Instruments] = weakref.WeakKeyDictionary()


def _instruments(api: _Api, provider: Any = None) -> _Instruments:
    """The instruments on ``provider`` (None: the global one), made once per provider."""
    global _global
    if provider is None:
        if _global is None:
            _global = _Instruments(api, None)
        return _global
    made = _by_provider.get(provider)
    if made is None:
        made = _by_provider[provider] = _Instruments(api, provider)
    return made


def _help(name: str) -> str:
    return f"fc.stats[{name!r}] of the caches of this process (docs/operations.md)"


class Telemetry:
    """Where one cache's spans and metrics go: its tracer (or the global provider's, once
    one is configured) and the instruments that report it."""

    __slots__ = ("api", "follows_global", "instruments", "namespace", "tracer")

    def __init__(self, api: _Api, namespace: str) -> None:
        self.api = api
        self.namespace = namespace
        self.tracer: Any = None
        self.follows_global = True  # the global provider's tracer, once one is configured
        self.instruments: list[_Instruments] = []

    def tracing(self) -> Any:
        """The tracer for the cache's spans, or None: no span (no provider configured)."""
        tracer = self.tracer
        if tracer is None and self.follows_global:
            tracer = self.tracer = _global_tracer(NAME, VERSION)
        return tracer

    def call(self, name: str, digest: str, *, current: bool) -> Call:
        return Call(self, self.tracer, name, digest, current)

    def follow_waited(self, seconds: float) -> None:
        for made in self.instruments:
            made.follow_wait.record(seconds, {"flightcache.namespace": self.namespace})


def attach(cache: Engine) -> Telemetry | None:
    """A new cache's telemetry: the global providers' (None without the package). The
    cache's calls make spans once ``cache._traced`` is set: now, if a tracer provider is
    configured already, else when ``watch`` finds one."""
    api = _otel()
    if api is None:
        return None
    tel = Telemetry(api, cache.namespace)
    made = _instruments(api)
    made.caches.add(cache)
    tel.instruments.append(made)
    cache._traced = tel if tel.tracing() is not None else None
    return tel


def watch(cache: Engine) -> None:
    """The cache is open: until the app configures a global tracer provider, look for one
    now and then every ``POLL_S`` on the cache's loop. So a call without a provider pays
    only the read of ``cache._traced`` (None), which a call with telemetry off pays too;
    a provider configured after the cache opened gets its spans within ``POLL_S``."""
    tel = cache._tel
    if tel is None or cache._traced is not None or not tel.follows_global:
        return
    loop = asyncio.get_running_loop()
    ref = weakref.ref(cache)

    def check() -> None:
        engine = ref()
        if engine is None or engine._closed or engine._tel is not tel or not tel.follows_global:
            return
        if tel.tracing() is not None:
            engine._traced = tel
        else:
            loop.call_later(POLL_S, check)

    check()


class Call:
    """The span of one ``do`` or ``stream`` call, with what the call learns on the way."""

    __slots__ = (
        "_started",
        "_token",
        "api",
        "ended",
        "kind",
        "near",
        "not_found",
        "record",
        "span",
    )

    def __init__(self, tel: Telemetry, tracer: Any, name: str, digest: str, current: bool):
        api = self.api = tel.api
        attributes = {"flightcache.namespace": tel.namespace, "flightcache.digest": digest}
        self.span = tracer.start_span(name, kind=api.internal, attributes=attributes)
        self.kind = name
        self.record = CallRecord()
        self.near = False
        self.not_found = False
        self.ended = False
        self._started = time.monotonic()
        self._token = (
            api.context.attach(api.trace.set_span_in_context(self.span)) if current else None
        )

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        token = self.api.context.attach(self.api.trace.set_span_in_context(self.span))
        try:
            yield
        finally:
            self.api.context.detach(token)

    def end(self, error: BaseException | None = None, abandoned: bool = False) -> None:
        if self.ended:
            return
        self.ended = True
        if self._token is not None:
            self.api.context.detach(self._token)
        record, span = self.record, self.span
        role = record.role or (HIT if error is None and not abandoned else None)
        attributes: dict[str, Any] = {"flightcache.outcome": self._outcome(error, abandoned)}
        if role is not None:
            attributes["flightcache.role"] = role
        if role in (OWNER, TAKEOVER):
            attributes["flightcache.token"] = record.token
            attributes["flightcache.attempt"] = record.attempt
        waited = record.waited_s
        if role == COALESCED or (role == FOLLOWER and self.kind == "flightcache.stream"):
            waited = (record.first_at or time.monotonic()) - self._started
        if waited is not None:
            attributes["flightcache.wait_ms"] = round(waited * 1000, 3)
        if self.near:
            attributes["flightcache.near_cache"] = True
        if error is not None and not isinstance(error, asyncio.CancelledError):
            attributes["error.type"] = type(error).__qualname__
            span.record_exception(error)
            span.set_status(self.api.Status(self.api.StatusCode.ERROR, type(error).__qualname__))
        span.set_attributes(attributes)  # one call: the SDK takes a lock for each
        span.end()

    def _outcome(self, error: BaseException | None, abandoned: bool) -> str:
        if isinstance(error, asyncio.CancelledError):
            return "cancelled"
        if isinstance(error, FlightTimeout):
            return "timeout"
        if error is not None:
            return "error"
        if abandoned:
            return "abandoned"
        if self.not_found:
            return "not_found"
        return "fail_open" if self.record.fail_open else "ok"

    def result(self, value: Any) -> Any:
        self.not_found = value is NOT_FOUND
        return value


async def flown(
    stats: Stats,
    tel: Telemetry | None,
    record: CallRecord,
    work: Callable[[], Coroutine[Any, Any, T]],
) -> T:
    """A ``do`` flight of this process, ``work()``, run: whether it fell open, and a
    follower's wait, noted in ``record`` and counted in the follow-wait histograms. (The
    flight's coroutine is made here: a task cancelled before it started leaves none behind
    never awaited.)"""
    fell = stats.fail_open
    try:
        return await work()
    finally:
        record.fail_open = stats.fail_open != fell
        waited = record.answered()
        if waited is not None:
            stats.follow_wait.observe(waited)
            if tel is not None:
                tel.follow_waited(waited)


def instrument(
    cache: FlightCache | FlightCacheSync,
    *,
    tracer_provider: Any = UNSET,
    meter_provider: Any = UNSET,
) -> None:
    """Send the spans (``tracer_provider``) or the metrics (``meter_provider``) of one
    cache to providers of its own instead of the global ones; None: none at all. An
    argument not given is left as it was. A ``FlightCacheSync`` applies it to its engine
    in every process (a forked child's too)."""
    core = getattr(cache, "_core", None)
    if core is not None:  # FlightCacheSync: the FlightCache of each engine it makes
        make = core.make

        def made(url: str | None) -> FlightCache:
            fc: FlightCache = make(url)
            instrument(fc, tracer_provider=tracer_provider, meter_provider=meter_provider)
            return fc

        core.make = made
        running = core.engine
        if running is not None and running.pid == os.getpid():
            instrument(
                running.cache, tracer_provider=tracer_provider, meter_provider=meter_provider
            )
        return
    engine: Engine = cache  # type: ignore[assignment]
    api = _otel()
    if api is None:
        if tracer_provider not in (UNSET, None) or meter_provider not in (UNSET, None):
            raise ConfigError("telemetry needs opentelemetry-api: pip install 'flightcache[otel]'")
        return
    tel = engine._tel or Telemetry(api, engine.namespace)
    if tracer_provider is not UNSET:
        tel.follows_global = False
        tel.tracer = None if tracer_provider is None else tracer_provider.get_tracer(NAME, VERSION)
    if meter_provider is not UNSET:
        for made_before in tel.instruments:
            made_before.caches.discard(engine)
        tel.instruments = [] if meter_provider is None else [_instruments(api, meter_provider)]
        for now in tel.instruments:
            now.caches.add(engine)
    wanted = tel.tracer is not None or tel.follows_global or tel.instruments
    engine._tel = tel if wanted else None
    engine._traced = tel if wanted and tel.tracing() is not None else None


def waits_of(cache: Any) -> Histogram | None:
    """The follow-wait histogram of a ``FlightCache``, or of a ``FlightCacheSync``'s engine
    in this process (None before it has one)."""
    core = getattr(cache, "_core", None)
    if core is not None:
        engine = core.engine
        if engine is None or engine.pid != os.getpid():
            return None
        cache = engine.cache
    stats: Stats = cache._stats
    return stats.follow_wait


class PrometheusCollector:
    """The counters of ``fc.stats`` and the follow-wait histogram of ``caches`` for a
    ``prometheus_client`` registry: ``REGISTRY.register(PrometheusCollector(fc))``.

    ``flightcache_<counter>_total`` for every counter (``flightcache_hits_total``,
    ``flightcache_takeovers_total``, ...), ``flightcache_owning`` (a gauge), and
    ``flightcache_follow_wait_seconds`` (a histogram), each labelled ``namespace``; caches
    of one namespace are summed.
    """

    def __init__(self, *caches: FlightCache | FlightCacheSync) -> None:
        self.caches = caches

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        counts: dict[str, dict[str, int]] = {}
        waits: dict[str, Histogram] = {}
        for cache in self.caches:
            ns = cache.namespace
            sums = counts.setdefault(ns, dict.fromkeys((*COUNTERS, "owning"), 0))
            stats = cache.stats
            for name in COUNTERS:
                sums[name] += stats.get(name, 0)
            owning = _owning(cache)
            sums["owning"] += owning
            hist = waits_of(cache)
            if hist is not None:
                into = waits.setdefault(ns, Histogram())
                into.counts = [a + b for a, b in zip(into.counts, hist.counts, strict=True)]
                into.total += hist.total
        for name in COUNTERS:
            family = CounterMetricFamily(f"flightcache_{name}", _help(name), labels=["namespace"])
            for ns, sums in counts.items():
                family.add_metric([ns], sums[name])
            yield family
        gauge = GaugeMetricFamily("flightcache_owning", _help("owning"), labels=["namespace"])
        for ns, sums in counts.items():
            gauge.add_metric([ns], sums["owning"])
        yield gauge
        hist_family = HistogramMetricFamily(
            "flightcache_follow_wait_seconds", WAIT_HELP, labels=["namespace"]
        )
        for ns, hist in waits.items():
            running, buckets = 0, []
            for bound, count in zip((*hist.bounds, float("inf")), hist.counts, strict=True):
                running += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
            hist_family.add_metric([ns], buckets, hist.total)
        yield hist_family


def _owning(cache: Any) -> int:
    core = getattr(cache, "_core", None)
    if core is not None:
        engine = core.engine
        if engine is None or engine.pid != os.getpid():
            return 0
        cache = engine.cache
    return int(cache._stats.owning)
