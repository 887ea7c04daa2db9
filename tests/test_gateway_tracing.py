"""The gateway's request spans, read with the OpenTelemetry SDK's in-memory exporter.

The gateway runs in a ``ServerThread`` of this process with a tracer provider of its own
(``make_app(tracer_provider=...)``): no global provider is set.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")
pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

from flightcache import EmbeddedServer  # noqa: E402
from flightcache.gateway._app import make_app  # noqa: E402
from flightcache.gateway._mock import make_mock_app  # noqa: E402
from flightcache.gateway._serve_util import ServerThread  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture
def traced(server: EmbeddedServer) -> Iterator[tuple[str, str, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with ServerThread(make_mock_app()) as mock:
        app = make_app(
            upstream=mock.url,
            redis_url=server.url,
            namespace="tr" + uuid.uuid4().hex[:8],
            tracer_provider=provider,
        )
        with ServerThread(app) as gateway:
            yield gateway.url, mock.url, exporter
    provider.shutdown()


def post(url: str, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    sent = {"authorization": "Bearer sk-trace", **headers}
    return httpx.post(url + path, json=body, headers=sent, timeout=20)


def test_a_span_per_request_under_the_callers_span(
    traced: tuple[str, str, InMemorySpanExporter],
) -> None:
    url, mock, exporter = traced
    body = {"model": "mock-chat", "input": uuid.uuid4().hex, "temperature": 0}
    parent = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    first = post(url, "/v1/responses", body, **parent)
    again = post(url, "/v1/responses", body)
    models = httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer k"}, timeout=10)
    httpx.post(f"{mock}/control", json={"mode": "fail", "status": 503, "times": 1}, timeout=10)
    failed = post(url, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user"}]})
    httpx.get(f"{url}/metrics", timeout=10)
    assert (first.status_code, again.status_code, models.status_code) == (200, 200, 200)
    assert failed.status_code == 503

    # The request spans (the cache's own spans, their children, are test_telemetry.py's).
    spans = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert [s.name for s in spans] == [
        "POST /v1/responses",
        "POST /v1/responses",
        "GET",  # a passthrough path: the method alone
        "POST /v1/chat/completions",
    ]  # and none for /metrics
    owner, hit, passthrough, error = spans
    assert owner.kind is SpanKind.SERVER
    assert format(owner.context.trace_id, "032x") == TRACE_ID
    assert owner.parent is not None and format(owner.parent.span_id, "016x") == PARENT_ID
    assert hit.parent is None
    assert owner.attributes is not None and hit.attributes is not None
    assert owner.attributes["flightcache.cache"] == "MISS"
    assert hit.attributes["flightcache.cache"] == "HIT" and "flightcache.age_s" in hit.attributes
    assert owner.attributes["flightcache.key"] == first.headers["x-flightcache-key"]
    assert owner.attributes["http.route"] == "/v1/responses"
    assert owner.attributes["flightcache.route"] == "responses"
    assert owner.attributes["http.response.status_code"] == 200
    assert passthrough.attributes is not None
    assert "flightcache.cache" not in passthrough.attributes
    assert error.status.status_code is StatusCode.ERROR
    assert "sk-trace" not in str([dict(s.attributes or {}) for s in spans])


GLOBAL_PROVIDER_LATER = """
import json
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from flightcache.gateway._tracing import Tracing

tracing = Tracing()  # as make_app() without tracer_provider: the global provider's
scope = {"method": "POST", "path": "/v1/chat/completions", "headers": []}
with tracing.request(scope, "chat") as before:
    before.response(200, [(b"x-cache", b"MISS")])
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
with tracing.request(scope, "chat") as after:
    after.response(200, [(b"x-cache", b"HIT")])
print(json.dumps({
    "span_before": before._span is not None,
    "spans": [[s.name, s.attributes["flightcache.cache"]] for s in exporter.get_finished_spans()],
}))
"""


def test_no_span_is_made_until_a_global_provider_is_configured_and_then_every_request_has_one() -> (
    None
):
    """Without a provider the API's no-op span would record nothing and cost about 20 us a
    request: none is made. A provider configured later is found by the next request. (In
    a child process: a global provider is set once per process.)"""
    done = subprocess.run(
        [sys.executable, "-c", GLOBAL_PROVIDER_LATER],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {"span_before": False, "spans": [["POST /v1/chat/completions", "HIT"]]}
