"""The library's spans and metrics (flightcache.telemetry), read with the OpenTelemetry SDK's
in-memory span exporter and metric reader, and with a prometheus_client registry, against
the session's real server.

The global tracer provider can be set once per process, so these tests give each cache a
provider of its own (``instrument(fc, tracer_provider=..., meter_provider=...)``); what the
global providers get, and what happens without ``opentelemetry-api``, run in a child
process each.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode

from flightcache import (
    NOT_FOUND,
    EmbeddedServer,
    FlightCache,
    FlightCacheSync,
    FlightContext,
    RemoteError,
)
from flightcache._keys import canonical, digest_of
from flightcache.telemetry import PrometheusCollector, instrument

from .helpers.flights import wait_for_flight
from .helpers.proxy import CuttableProxy

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Otel:
    tracer_provider: TracerProvider
    exporter: InMemorySpanExporter
    meter_provider: MeterProvider
    reader: InMemoryMetricReader

    def spans(self, name: str = "flightcache.do") -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name == name]

    def metrics(self) -> dict[str, dict[str, Any]]:
        """Metric name -> namespace -> value (a sum) or data point (a histogram)."""
        found: dict[str, dict[str, Any]] = {}
        data = self.reader.get_metrics_data()
        assert data is not None
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        ns = str(point.attributes["flightcache.namespace"])
                        value = getattr(point, "value", point)
                        found.setdefault(metric.name, {})[ns] = value
        return found


@pytest.fixture
def otel() -> Iterator[Otel]:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    yield Otel(tracer_provider, exporter, meter_provider, reader)
    tracer_provider.shutdown()
    meter_provider.shutdown()


@pytest.fixture
async def traced(
    make_cache: Callable[..., FlightCache], otel: Otel
) -> AsyncIterator[Callable[..., FlightCache]]:
    """``make_cache``, each cache reporting to the test's own providers."""

    def make(url: str | None = None, **kw: Any) -> FlightCache:
        fc = make_cache(url, **kw)
        instrument(fc, tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider)
        return fc

    yield make


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


async def test_owner_hit_and_coalesced_spans_nest_under_the_callers_span(
    traced: Callable[..., FlightCache], otel: Otel
) -> None:
    fc = traced(near_cache=False)
    app = otel.tracer_provider.get_tracer("app")
    key = {"prompt": "What is relativity?", "n": uuid.uuid4().hex}
    gate = asyncio.Event()
    tokens: list[int] = []

    async def loader(flight: FlightContext) -> str:
        tokens.append(flight.token)
        with app.start_as_current_span("llm call"):
            await gate.wait()
        return "answer"

    with app.start_as_current_span("request") as request:
        first = asyncio.ensure_future(fc.do(key, loader))
        await wait_for_flight(fc, key)
        second = asyncio.ensure_future(fc.do(key, loader))
        await asyncio.sleep(0.05)
        gate.set()
        assert await asyncio.gather(first, second) == ["answer", "answer"]
        assert await fc.do(key, loader) == "answer"

    owner, coalesced, hit = otel.spans()
    digest = digest_of(canonical(key))
    for span in (owner, coalesced, hit):
        assert parent_of(span) == span_id(request)
        assert attrs(span)["flightcache.digest"] == digest
        assert attrs(span)["flightcache.namespace"] == fc.namespace
        assert attrs(span)["flightcache.outcome"] == "ok"
        assert "relativity" not in json.dumps(attrs(span))  # never the key itself
    assert attrs(owner)["flightcache.role"] == "owner"
    assert attrs(owner)["flightcache.token"] == tokens[0] > 0
    assert attrs(owner)["flightcache.attempt"] == 1
    assert "flightcache.wait_ms" not in attrs(owner)
    assert attrs(coalesced)["flightcache.role"] == "coalesced"
    assert attrs(coalesced)["flightcache.wait_ms"] >= 40  # it waited for the gate
    assert "flightcache.token" not in attrs(coalesced)
    assert attrs(hit)["flightcache.role"] == "hit"
    assert "flightcache.near_cache" not in attrs(hit)
    # The loader's own span is a child of the owner's do span (the flight task inherits it).
    (llm,) = [s for s in otel.exporter.get_finished_spans() if s.name == "llm call"]
    assert parent_of(llm) == span_id(owner)


async def test_near_cache_hits_and_not_found_and_errors(
    traced: Callable[..., FlightCache], otel: Otel
) -> None:
    fc = traced()  # near cache on
    key = "near-" + uuid.uuid4().hex

    async def loader() -> str:
        return "v"

    async def absent() -> Any:
        return NOT_FOUND

    async def failing() -> str:
        raise ValueError("upstream said no")

    assert await fc.do(key, loader) == "v"
    assert await fc.do(key, loader) == "v"  # leased: a near-cache hit
    assert await fc.do(key + "-absent", absent) is NOT_FOUND
    with pytest.raises(ValueError):
        await fc.do(key + "-failing", failing)
    owner, near, absent_span, failed = otel.spans()
    assert attrs(near)["flightcache.role"] == "hit"
    assert attrs(near)["flightcache.near_cache"] is True
    assert attrs(absent_span)["flightcache.outcome"] == "not_found"
    assert attrs(failed)["flightcache.outcome"] == "error"
    assert attrs(failed)["flightcache.role"] == "owner"
    assert attrs(failed)["error.type"] == "ValueError"
    assert failed.status.status_code is StatusCode.ERROR
    assert owner.status.status_code is StatusCode.UNSET


async def test_a_follower_in_another_node_and_its_wait(
    traced: Callable[..., FlightCache], otel: Otel
) -> None:
    """Two caches are two nodes: the second follows the first's flight, and its span and
    the follow-wait histogram say how long it waited; a loader error reaches it too."""
    owner_fc = traced(near_cache=False)
    other = traced(near_cache=False)
    key = "follow-" + uuid.uuid4().hex
    gate = asyncio.Event()

    async def slow() -> str:
        await gate.wait()
        return "made once"

    async def never() -> str:
        raise AssertionError("the follower must not run the loader")

    running = asyncio.ensure_future(owner_fc.do(key, slow))
    await wait_for_flight(owner_fc, key)
    following = asyncio.ensure_future(other.do(key, never))
    await wait_for_flight(owner_fc, key, followers=1)
    await asyncio.sleep(0.1)
    gate.set()
    assert await asyncio.gather(running, following) == ["made once", "made once"]

    spans = {attrs(s)["flightcache.role"]: s for s in otel.spans()}
    assert set(spans) == {"owner", "follower"}
    follower = attrs(spans["follower"])
    assert follower["flightcache.wait_ms"] >= 90
    assert "flightcache.token" not in follower
    assert follower["flightcache.outcome"] == "ok"
    assert other.stats["follows"] == 1
    wait = otel.metrics()["flightcache.follow_wait"][owner_fc.namespace]
    assert wait.count == 1 and wait.sum >= 0.09
    assert other._stats.follow_wait.count == 1 and owner_fc._stats.follow_wait.count == 0

    failing_key = key + "-failing"
    gate = asyncio.Event()

    async def fails() -> str:
        await gate.wait()
        raise KeyError("nope")

    running = asyncio.ensure_future(owner_fc.do(failing_key, fails))
    await wait_for_flight(owner_fc, failing_key)
    following = asyncio.ensure_future(other.do(failing_key, never))
    await wait_for_flight(owner_fc, failing_key, followers=1)
    gate.set()
    with pytest.raises(KeyError):
        await running
    with pytest.raises(RemoteError):
        await following
    failed = otel.spans()[-2:]
    by_role = {attrs(s).get("flightcache.role"): attrs(s) for s in failed}
    assert by_role["follower"]["flightcache.outcome"] == "error"
    assert by_role["follower"]["error.type"] == "RemoteError"
    assert by_role["owner"]["error.type"] == "KeyError"


@pytest.mark.timeout(60)
async def test_a_takeover_and_the_metrics_of_both_nodes(
    server: EmbeddedServer, namespace: str, otel: Otel
) -> None:
    """The owner is cut off from the server; the other node takes the flight over: its span
    says takeover with the new token and attempt 2, and the metrics count the takeover and
    the lost owner's lease or fenced write."""
    proxy = CuttableProxy("127.0.0.1", server.port).start()
    cut_off = FlightCache(
        f"redis://127.0.0.1:{proxy.port}/0",
        namespace=namespace,
        lease=0.5,
        socket_timeout=1.0,
        near_cache=False,
    )
    other = FlightCache(server.url, namespace=namespace, lease=0.5, near_cache=False)
    for fc in (cut_off, other):
        instrument(fc, tracer_provider=otel.tracer_provider, meter_provider=otel.meter_provider)
    gate = asyncio.Event()
    tokens: list[int] = []

    async def stuck() -> str:
        await gate.wait()
        return "from the cut-off owner"

    async def new(flight: FlightContext) -> str:
        tokens.append(flight.token)
        return "from the new owner"

    try:
        owner_task = asyncio.ensure_future(cut_off.do("k", stuck))
        first = await wait_for_flight(other, "k")
        proxy.cut()
        assert await asyncio.wait_for(other.do("k", new), 15) == "from the new owner"
        proxy.heal()
        gate.set()
        assert await asyncio.wait_for(owner_task, 20) == "from the new owner"
    finally:
        gate.set()
        await cut_off.aclose()
        await other.aclose()
        proxy.close()

    by_node = {attrs(s)["flightcache.role"]: attrs(s) for s in otel.spans()}
    takeover = by_node["takeover"]
    assert takeover["flightcache.token"] == tokens[0] != first.token
    assert takeover["flightcache.attempt"] == 2
    assert takeover["flightcache.wait_ms"] > 0  # it followed before it took over
    metrics = otel.metrics()
    assert metrics["flightcache.takeovers"][namespace] == 1
    assert metrics["flightcache.loader_runs"][namespace] == 2
    lost = metrics["flightcache.lease_lost"][namespace]
    assert lost + metrics["flightcache.fenced_writes"][namespace] >= 1
    stats = [cut_off.stats, other.stats]
    for name in ("calls", "hits", "misses", "follows", "takeovers", "loader_runs"):
        assert metrics[f"flightcache.{name}"][namespace] == sum(s[name] for s in stats), name


async def test_streams_have_spans_too(traced: Callable[..., FlightCache], otel: Otel) -> None:
    fc = traced(near_cache=False)
    app = otel.tracer_provider.get_tracer("app")
    key = "stream-" + uuid.uuid4().hex

    async def producer() -> AsyncIterator[str]:
        with app.start_as_current_span("producing"):
            for word in ("one", "two", "three"):
                await asyncio.sleep(0.01)
                yield word

    async def read(stream: Any) -> list[str]:
        return [chunk async for chunk in stream]

    with app.start_as_current_span("request") as request:
        first, second = fc.stream(key, producer), fc.stream(key, producer)
        assert await asyncio.gather(read(first), read(second)) == [["one", "two", "three"]] * 2
        assert await read(fc.stream(key, producer)) == ["one", "two", "three"]
        left = fc.stream(key, producer)
        assert await left.__anext__() == "one"
        await left.aclose()

    owner, coalesced, hit, abandoned = otel.spans("flightcache.stream")
    assert [attrs(s)["flightcache.role"] for s in (owner, coalesced, hit)] == [
        "owner",
        "coalesced",
        "hit",
    ]
    assert all(parent_of(s) == span_id(request) for s in (owner, coalesced, hit, abandoned))
    assert attrs(owner)["flightcache.token"] > 0
    assert attrs(coalesced)["flightcache.wait_ms"] > 0  # until its first chunk
    assert attrs(abandoned)["flightcache.outcome"] == "abandoned"
    (producing,) = [s for s in otel.exporter.get_finished_spans() if s.name == "producing"]
    assert parent_of(producing) == span_id(owner)


async def test_the_prometheus_collector(make_cache: Callable[..., FlightCache]) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    fc = make_cache(near_cache=False)
    other = make_cache(near_cache=False)
    registry.register(PrometheusCollector(fc, other))

    async def loader() -> str:
        return "v"

    await fc.do("a", loader)
    await fc.do("a", loader)
    await other.do("a", loader)
    await other.do("b", loader)
    fc._stats.follow_wait.observe(0.003)  # as a follower's wait is counted
    other._stats.follow_wait.observe(20.0)

    def sample(name: str, **labels: str) -> float | None:
        value = registry.get_sample_value(name, {"namespace": fc.namespace, **labels})
        return value

    assert sample("flightcache_calls_total") == 4
    assert sample("flightcache_hits_total") == 2
    assert sample("flightcache_loader_runs_total") == 2
    assert sample("flightcache_misses_total") == 2
    assert sample("flightcache_takeovers_total") == 0
    assert sample("flightcache_owning") == 0
    assert sample("flightcache_follow_wait_seconds_bucket", le="0.001") == 0
    assert sample("flightcache_follow_wait_seconds_bucket", le="0.005") == 1
    assert sample("flightcache_follow_wait_seconds_bucket", le="30.0") == 2
    assert sample("flightcache_follow_wait_seconds_bucket", le="+Inf") == 2
    assert sample("flightcache_follow_wait_seconds_count") == 2
    assert sample("flightcache_follow_wait_seconds_sum") == pytest.approx(20.003)
    text = prometheus_client.generate_latest(registry).decode()
    assert "# TYPE flightcache_fenced_writes_total counter" in text
    assert "# TYPE flightcache_follow_wait_seconds histogram" in text


def test_the_sync_client_carries_the_callers_span(
    server: EmbeddedServer, namespace: str, otel: Otel
) -> None:
    """FlightCacheSync runs the engine on a loop thread of its own: the span of each call is
    still a child of the calling thread's span, for do and stream alike (asyncio hands the
    loop a copy of the calling thread's context with each call)."""
    app = otel.tracer_provider.get_tracer("app")
    with FlightCacheSync(server.url, namespace=namespace, near_cache=False) as fcs:
        instrument(fcs, tracer_provider=otel.tracer_provider)
        made = threading.Event()

        def loader() -> str:
            made.set()
            return "sync value"

        def producer() -> Iterator[str]:
            yield from ("a", "b")

        with app.start_as_current_span("request") as request:
            assert fcs.do("k", loader) == "sync value"
            assert fcs.do("k", loader) == "sync value"
            assert list(fcs.stream("s", producer)) == ["a", "b"]
        assert fcs.do("k", loader) == "sync value"  # no caller span: a root span
    assert made.is_set()
    owner, hit, root = otel.spans()
    (stream,) = otel.spans("flightcache.stream")
    assert [attrs(s)["flightcache.role"] for s in (owner, hit, stream)] == ["owner", "hit", "owner"]
    assert all(parent_of(s) == span_id(request) for s in (owner, hit, stream))
    assert root.parent is None


def test_the_gateway_cache_spans_nest_under_its_request_spans(server: EmbeddedServer) -> None:
    pytest.importorskip("starlette")
    httpx = pytest.importorskip("httpx")
    from flightcache.gateway._app import make_app
    from flightcache.gateway._mock import make_mock_app
    from flightcache.gateway._serve_util import ServerThread

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    body = {"model": "mock-chat", "messages": [{"role": "user", "content": uuid.uuid4().hex}]}
    with ServerThread(make_mock_app()) as mock:
        app = make_app(
            upstream=mock.url,
            redis_url=server.url,
            namespace="tg" + uuid.uuid4().hex[:8],
            tracer_provider=provider,
        )
        with ServerThread(app) as gateway:
            for _ in range(2):
                answer = httpx.post(
                    gateway.url + "/v1/chat/completions",
                    json={**body, "temperature": 0},
                    headers={"authorization": "Bearer sk-t"},
                    timeout=20,
                )
                assert answer.status_code == 200
    provider.shutdown()
    spans = exporter.get_finished_spans()
    requests = [s for s in spans if s.name == "POST /v1/chat/completions"]
    flights = [s for s in spans if s.name == "flightcache.stream"]
    assert len(requests) == 2 and len(flights) == 2
    assert [parent_of(f) for f in flights] == [span_id(r) for r in requests]
    assert [attrs(f)["flightcache.role"] for f in flights] == ["owner", "hit"]


CHILD_GLOBAL = """
import asyncio, json, sys
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from flightcache import FlightCache

async def main():
    fc = FlightCache(sys.argv[1], namespace=sys.argv[2], near_cache=False)
    async def loader():
        return 1
    await fc.do("before", loader)  # no provider yet: no span
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    await asyncio.sleep(1.5)  # an open cache looks for a tracer provider once a second
    await fc.do("after", loader)
    await fc.do("after", loader)
    await fc.aclose()
    points = {
        m.name: [p.value for p in m.data.data_points]
        for r in reader.get_metrics_data().resource_metrics
        for s in r.scope_metrics
        for m in s.metrics
        if m.name.startswith("flightcache.") and m.name != "flightcache.follow_wait"
    }
    roles = [s.attributes["flightcache.role"] for s in exporter.get_finished_spans()]
    print(json.dumps({"roles": roles, "metrics": points}))

asyncio.run(main())
"""


def run_child(code: str, *args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_global_providers_get_spans_and_metrics_with_nothing_to_call(
    server: EmbeddedServer, namespace: str
) -> None:
    """In a process of its own (the global providers are set once a process): a cache made
    before the app configured OpenTelemetry reports to it once it is configured."""
    out = run_child(CHILD_GLOBAL, server.url, namespace)
    assert out["roles"] == ["owner", "hit"]
    assert out["metrics"]["flightcache.calls"] == [3]
    assert out["metrics"]["flightcache.hits"] == [1]
    assert out["metrics"]["flightcache.loader_runs"] == [2]


CHILD_WITHOUT_OTEL = """
import asyncio, json, sys
sys.modules["opentelemetry"] = None  # as if the otel extra were not installed
from flightcache import FlightCache, FlightCacheSync
from flightcache.telemetry import PrometheusCollector, instrument

async def main():
    fc = FlightCache(sys.argv[1], namespace=sys.argv[2])
    async def loader():
        return "v"
    values = [await fc.do("k", loader) for _ in range(3)]
    chunks = [c async for c in fc.stream("s", lambda: agen())]
    instrument(fc, tracer_provider=None)
    await fc.aclose()
    return fc, values, chunks

async def agen():
    yield 1

fc, values, chunks = asyncio.run(main())
with FlightCacheSync(sys.argv[1], namespace=sys.argv[2]) as fcs:
    sync_value = fcs.do("k", lambda: "w")
    inner = fcs._core.engine.cache
import prometheus_client
registry = prometheus_client.CollectorRegistry()
registry.register(PrometheusCollector(fc))
print(json.dumps({
    "values": values, "chunks": chunks, "sync": sync_value,
    "tel": [repr(fc._tel), repr(inner._tel)],
    "imported": sorted(m for m in sys.modules if m.startswith("opentelemetry") and sys.modules[m]),
    "hits": registry.get_sample_value("flightcache_hits_total", {"namespace": sys.argv[2]}),
}))
"""


def test_without_opentelemetry_nothing_is_recorded(server: EmbeddedServer, namespace: str) -> None:
    out = run_child(CHILD_WITHOUT_OTEL, server.url, namespace)
    assert out["values"] == ["v"] * 3 and out["chunks"] == [1] and out["sync"] == "v"
    assert out["tel"] == ["None", "None"]
    assert out["imported"] == []
    assert out["hits"] == 2  # the Prometheus collector needs no OpenTelemetry
