"""The SDK wrappers (``flightcache.integrations.openai`` / ``.anthropic``) with the real
``openai`` and ``anthropic`` clients against the mock upstream.

The mock runs in a ``ServerThread`` of this process (its ``/stats`` count the upstream
calls); the stampedes run in real worker processes (``tests/helpers/sdk_worker.py``) on the
session's Valkey. The SDK clients are made with ``max_retries=0``, so the statuses under
test are not hidden by the SDK's own retries.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

import flightcache  # noqa: E402
from flightcache import ConfigError, EmbeddedServer  # noqa: E402
from flightcache.gateway._mock import make_mock_app  # noqa: E402
from flightcache.gateway._serve_util import ServerThread  # noqa: E402
from flightcache.integrations import anthropic as fc_anthropic  # noqa: E402
from flightcache.integrations import openai as fc_openai  # noqa: E402
from flightcache.integrations._core import Outcome  # noqa: E402

FlightCacheSync = getattr(flightcache, "FlightCacheSync", None)
needs_sync = pytest.mark.skipif(
    FlightCacheSync is None, reason="flightcache.FlightCacheSync does not exist yet"
)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mock_url() -> Iterator[str]:
    with ServerThread(make_mock_app(latency_ms=150, tokens_per_s=400)) as mock:
        yield mock.url


@pytest.fixture
def upstream(mock_url: str) -> str:
    httpx.post(f"{mock_url}/control/reset", timeout=10).raise_for_status()
    return mock_url


def calls(upstream: str) -> dict[str, Any]:
    result: dict[str, Any] = httpx.get(f"{upstream}/stats", timeout=10).json()
    return result


def control(upstream: str, **settings: Any) -> None:
    httpx.post(f"{upstream}/control", json=settings, timeout=10).raise_for_status()


_OPEN: list[Any] = []  # SDK clients made by a test, closed after it


@pytest.fixture(autouse=True)
async def _close_clients() -> Any:
    yield
    while _OPEN:
        client = _OPEN.pop()
        closed = client.close()
        if asyncio.iscoroutine(closed):
            await closed


def oai(upstream: str, key: str = "sk-test") -> Any:
    client = openai.AsyncOpenAI(base_url=f"{upstream}/v1", api_key=key, max_retries=0, timeout=20)
    _OPEN.append(client)
    return client


def claude(upstream: str, key: str = "ak-test") -> Any:
    client = anthropic.AsyncAnthropic(base_url=upstream, api_key=key, max_retries=0, timeout=20)
    _OPEN.append(client)
    return client


def sync_oai(upstream: str) -> Any:
    client = openai.OpenAI(base_url=f"{upstream}/v1", api_key="sk", max_retries=0, timeout=20)
    _OPEN.append(client)
    return client


def prompt(tag: str) -> str:
    return f"{tag} {uuid.uuid4().hex}"


def chat(tag: str, **fields: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt(tag)}]
    return {"model": "mock-chat", "messages": messages, "temperature": 0, **fields}


# -- in one process -------------------------------------------------------------------------


async def test_async_openai_answers_are_the_sdk_types_and_are_cached(
    make_cache: Any, upstream: str
) -> None:
    outcomes: list[Outcome] = []
    client = fc_openai.coalesce(oai(upstream), make_cache(), on_outcome=outcomes.append)
    body = chat("types")
    answers = await asyncio.gather(*[client.chat.completions.create(**body) for _ in range(20)])
    assert {type(a) for a in answers} == {openai.types.chat.ChatCompletion}
    assert len({a.id for a in answers}) == 1 and answers[0].choices[0].message.content
    assert calls(upstream)["calls"] == 1
    assert Counter(o.cache for o in outcomes) == {"MISS": 1, "COALESCED": 19}

    stream = await client.chat.completions.create(**body, stream=True)  # its streaming twin
    assert stream.source == "HIT"
    chunks = [chunk async for chunk in stream]
    assert {type(c) for c in chunks} == {openai.types.chat.ChatCompletionChunk}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answers[0].choices[0].message.content
    assert all(c.usage is None for c in chunks)  # not asked for: no usage chunk
    again = await client.chat.completions.create(**body)
    assert again.usage is not None and again.usage.model_extra == {"cached": True}
    assert outcomes[-1].cache == "HIT" and outcomes[-1].age is not None
    assert outcomes[-1].completion_tokens == again.usage.completion_tokens

    completion = await client.completions.create(model="mock-instruct", prompt="hi", seed=1)
    assert type(completion) is openai.types.Completion
    embedding = await client.embeddings.create(model="mock-embedding", input=prompt("e"))
    assert type(embedding) is openai.types.CreateEmbeddingResponse
    assert len(embedding.data[0].embedding) == 1536
    response = await client.responses.create(model="mock-chat", input=prompt("r"), temperature=0)
    assert type(response) is openai.types.responses.Response and response.output_text
    assert calls(upstream)["calls"] == 4


async def test_responses_and_messages_streams_are_the_sdk_event_types(
    make_cache: Any, upstream: str
) -> None:
    fc = make_cache()
    client = fc_openai.coalesce(oai(upstream), fc)
    ask = {"model": "mock-chat", "input": prompt("resp"), "temperature": 0}
    first, second = await asyncio.gather(
        client.responses.create(**ask, stream=True), client.responses.create(**ask, stream=True)
    )
    events = [[e async for e in first], [e async for e in second]]
    assert events[0] == events[1] and {first.source, second.source} == {"MISS", "COALESCED"}
    kinds = [type(e).__name__ for e in events[0]]
    assert kinds[0] == "ResponseCreatedEvent" and kinds[-1] == "ResponseCompletedEvent"
    assert isinstance(events[0][-1], openai.types.responses.ResponseCompletedEvent)
    whole = await client.responses.create(**ask)  # the non-stream twin: from the cache
    deltas = [e.delta for e in events[0] if e.type == "response.output_text.delta"]
    assert whole.output_text == "".join(deltas) and whole.id == events[0][-1].response.id

    messages = fc_anthropic.coalesce(claude(upstream), fc, cache_sampled=True)
    body = {
        "model": "mock-claude",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "x"}],
    }
    async with await messages.messages.create(**body, stream=True) as stream:
        got = [e async for e in stream]
    assert isinstance(got[0], anthropic.types.RawMessageStartEvent)
    assert isinstance(got[-1], anthropic.types.RawMessageStopEvent)
    message = await messages.messages.create(**body)
    assert type(message) is anthropic.types.Message
    assert message.content[0].text == "".join(
        e.delta.text for e in got if e.type == "content_block_delta"
    )
    assert message.usage.model_extra == {"cached": True}
    assert calls(upstream)["by_route"] == {"/v1/responses": 1, "/v1/messages": 1}


async def test_sampled_answers_are_coalesced_and_stored_only_on_request(
    make_cache: Any, upstream: str
) -> None:
    fc = make_cache()
    body = chat("sampled", temperature=0.7)
    plain = fc_openai.coalesce(oai(upstream), fc)
    twins = await asyncio.gather(*[plain.chat.completions.create(**body) for _ in range(5)])
    assert len({t.id for t in twins}) == 1 and calls(upstream)["calls"] == 1
    await plain.chat.completions.create(**body)  # not stored: a new sample
    assert calls(upstream)["calls"] == 2
    storing = fc_openai.coalesce(oai(upstream), fc, cache_sampled=True)
    first = await storing.chat.completions.create(**body)
    assert (await storing.chat.completions.create(**body)).id == first.id
    assert calls(upstream)["calls"] == 3


async def test_errors_reach_every_caller_as_sdk_exceptions_and_are_not_stored(
    make_cache: Any, upstream: str
) -> None:
    client = fc_openai.coalesce(oai(upstream), make_cache())
    body = chat("errors")
    control(upstream, mode="rate_limit", times=1, latency_ms=200, retry_after=7)
    results = await asyncio.gather(
        *[client.chat.completions.create(**body) for _ in range(10)], return_exceptions=True
    )
    assert {type(r) for r in results} == {openai.RateLimitError}
    assert {r.response.headers["retry-after"] for r in results} == {"7"}  # type: ignore[union-attr]
    assert calls(upstream)["calls"] == 1
    answer = await client.chat.completions.create(**body)  # the error was not stored
    assert answer.choices[0].message.content and calls(upstream)["calls"] == 2

    messages = fc_anthropic.coalesce(claude(upstream), make_cache())
    control(upstream, mode="fail", status=529, times=1)
    ask = {"model": "mock-claude", "max_tokens": 8, "messages": [{"role": "user", "content": "o"}]}
    with pytest.raises(anthropic.APIStatusError) as caught:
        await messages.messages.create(**ask)
    assert caught.value.status_code == 529

    control(upstream, mode="cut", times=1, cut_after=3)  # a stream cut short: for everyone
    cut = {"model": "mock-chat", "input": prompt("cut"), "temperature": 0, "stream": True}

    async def read() -> Any:
        stream = await client.responses.create(**cut)
        return [event async for event in stream]

    failures = await asyncio.gather(read(), read(), return_exceptions=True)
    assert all(isinstance(f, (openai.APIError, openai.APIConnectionError)) for f in failures)
    assert len(await read()) > 10  # not stored: the next call makes a new stream


async def test_cache_control_headers_per_call(make_cache: Any, upstream: str) -> None:
    outcomes: list[Outcome] = []
    client = fc_openai.coalesce(oai(upstream), make_cache(), on_outcome=outcomes.append)
    body = chat("headers")
    first = await client.chat.completions.create(**body)
    fresh = await client.chat.completions.create(
        **body, extra_headers={"Cache-Control": "no-cache"}
    )
    assert fresh.id != first.id and outcomes[-1].cache == "MISS"  # replaced the stored one
    assert (await client.chat.completions.create(**body)).id == fresh.id
    await client.chat.completions.create(**body, extra_headers={"cache-control": "max-age=3600"})
    assert outcomes[-1].cache == "HIT"
    await asyncio.sleep(1.1)
    old = await client.chat.completions.create(**body, extra_headers={"cache-control": "max-age=1"})
    assert outcomes[-1].cache == "MISS" and old.id != fresh.id
    unstored = chat("no-store")
    await client.chat.completions.create(**unstored, extra_headers={"Cache-Control": "no-store"})
    await client.chat.completions.create(**unstored)
    assert outcomes[-1].cache == "MISS"
    direct = {"X-Flightcache-Coalesce": "off"}
    await client.chat.completions.create(**body, extra_headers=direct)
    assert outcomes[-1].cache == "BYPASS"
    with pytest.raises(ValueError, match="X-Flightcache-TTL"):
        await client.chat.completions.create(**body, extra_headers={"X-Flightcache-TTL": "soon"})
    assert calls(upstream)["calls"] == 6


async def test_requests_that_must_not_be_shared_go_to_the_sdk_as_they_are(
    make_cache: Any, upstream: str
) -> None:
    outcomes: list[Outcome] = []
    client = fc_openai.coalesce(oai(upstream), make_cache(), on_outcome=outcomes.append)
    base = {"model": "mock-chat", "temperature": 0}
    unshared = [
        {"input": "a", "previous_response_id": "resp_earlier"},
        {"input": "b", "background": True},
        {"input": [{"type": "item_reference", "id": "msg_stored"}]},
        {"input": [{"type": "function_call_output", "call_id": "call_1", "output": "42"}]},
    ]
    for fields in unshared:
        await client.responses.create(**base, **fields)
        await client.responses.create(**base, **fields)
    assert [o.cache for o in outcomes] == ["BYPASS"] * 8
    assert calls(upstream)["calls"] == 8
    # A tool output whose call is in the same input is stateless: shared.
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    shared = [call, {"type": "function_call_output", "call_id": "c", "output": "1"}]
    await client.responses.create(**base, input=shared)
    await client.responses.create(**base, input=shared, previous_response_id=None)
    assert [o.cache for o in outcomes[-2:]] == ["MISS", "HIT"]


async def test_tenants_and_arguments(make_cache: Any, upstream: str) -> None:
    fc = make_cache()
    body = chat("tenants")
    mine = fc_openai.coalesce(oai(upstream, "sk-one"), fc)
    theirs = fc_openai.coalesce(oai(upstream, "sk-two"), fc)
    a, b = await asyncio.gather(
        mine.chat.completions.create(**body), theirs.chat.completions.create(**body)
    )
    assert a.id != b.id and calls(upstream)["calls"] == 2
    shared = fc_openai.coalesce(oai(upstream, "sk-three"), fc, share_across_keys=True)
    other = fc_openai.coalesce(oai(upstream, "sk-four"), fc, share_across_keys=True)
    c = await shared.chat.completions.create(**body)
    assert (await other.chat.completions.create(**body)).id == c.id
    assert calls(upstream)["calls"] == 3
    # Arguments in other forms make the same key: a generator of messages, an SDK model,
    # an integral float, fields that cannot change the answer.
    as_generator = {**body, "messages": (m for m in body["messages"]), "temperature": 0.0}
    assert (await mine.chat.completions.create(**as_generator, user="u1")).id == a.id
    previous = a.choices[0].message
    follow_up = [*body["messages"], previous, {"role": "user", "content": "more"}]
    first = await mine.chat.completions.create(**{**body, "messages": follow_up})
    as_dict = [*body["messages"], previous.model_dump(exclude_unset=True), follow_up[-1]]
    again = await mine.chat.completions.create(**{**body, "messages": as_dict})
    assert again.id == first.id and calls(upstream)["calls"] == 4


async def test_everything_else_is_the_clients_own(make_cache: Any, upstream: str) -> None:
    raw_client = oai(upstream)
    client = fc_openai.coalesce(raw_client, make_cache())
    assert client.api_key == "sk-test" and client.base_url == raw_client.base_url
    models = await client.models.list()
    assert [m.id for m in models.data][:1] == ["mock-chat"]
    raw = await client.chat.completions.with_raw_response.create(**chat("raw"))
    assert raw.http_response.status_code == 200  # uncached, the SDK's own
    quick = client.with_options(timeout=5)
    assert quick.timeout == 5
    body = chat("options")
    first = await quick.chat.completions.create(**body)
    assert (await client.chat.completions.create(**body)).id == first.id  # both wrapped
    assert calls(upstream)["calls"] == 3
    async with fc_openai.coalesce(oai(upstream), make_cache()) as scoped:
        assert scoped.chat.completions.create.__name__ == "create"
    with pytest.raises(ConfigError, match="FlightCacheSync"):
        fc_openai.coalesce(sync_oai(upstream), make_cache())
    if FlightCacheSync is not None:
        with pytest.raises(ConfigError, match="FlightCache"):
            fc_anthropic.coalesce(claude(upstream), FlightCacheSync("memory://"))


@needs_sync
def test_the_sync_clients_with_flightcachesync(server: EmbeddedServer, upstream: str) -> None:
    assert FlightCacheSync is not None
    namespace = "s" + uuid.uuid4().hex[:10]
    with FlightCacheSync(server.url, namespace=namespace) as fcs:
        client = fc_openai.coalesce(sync_oai(upstream), fcs)
        body = chat("sync")
        answers: list[Any] = []

        def ask() -> None:
            answers.append(client.chat.completions.create(**body))

        threads = [threading.Thread(target=ask) for _ in range(20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len({a.id for a in answers}) == 1 and len(answers) == 20
        with client.chat.completions.create(**body, stream=True) as stream:
            chunks = list(stream)
        assert stream.source == "HIT"
        assert isinstance(chunks[0], openai.types.chat.ChatCompletionChunk)
        sync_claude = anthropic.Anthropic(base_url=upstream, api_key="ak", max_retries=0)
        _OPEN.append(sync_claude)
        messages = fc_anthropic.coalesce(sync_claude, fcs)
        ask_claude = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "s"}]}
        assert type(messages.messages.create(**ask_claude)) is anthropic.types.Message
    assert calls(upstream)["calls"] == 2


# -- across processes -----------------------------------------------------------------------


def scenario(name: str, sdk: str, path: list[str], **fields: Any) -> dict[str, Any]:
    sync = fields.pop("sync", False)
    cache_sampled = fields.pop("cache_sampled", False)
    kwargs = fields
    return {"name": name, "sdk": sdk, "path": path, "kwargs": kwargs, "calls": 50} | {
        "sync": sync,
        "cache_sampled": cache_sampled,
    }


def stampede(
    server: EmbeddedServer, upstream: str, scenarios: list[dict[str, Any]], **control: Any
) -> Any:
    """4 worker processes run each scenario at once (50 calls each); their summaries, and
    the upstream's call count before the first (``control``: the mock's settings then)."""
    spec = {
        "control": control,
        "redis": server.url,
        "namespace": "w" + uuid.uuid4().hex[:10],
        "upstream": upstream,
        "workers": 4,
        "scenarios": scenarios,
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.sdk_worker", json.dumps({**spec, "index": i})],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(4)
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=150)
            assert proc.returncode == 0, err[-3000:]
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    results = {s["name"]: [o[s["name"]] for o in outputs] for s in scenarios}
    results["baseline"] = next(o["baseline"] for o in outputs if o["baseline"] is not None)
    return results


def merged(parts: list[dict[str, Any]]) -> dict[str, Any]:
    sources: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for part in parts:
        sources.update(part["sources"])
        errors.update(part["errors"])
    return {
        "types": set().union(*(p["types"] for p in parts)),
        "digests": set().union(*(p["digests"] for p in parts)),
        "containers": set().union(*(p["containers"] for p in parts)),
        "retry_after": set().union(*(p["retry_after"] for p in parts)),
        "sources": sources,
        "errors": errors,
        "count": sum(p["count"] for p in parts),
    }


@pytest.mark.timeout(240)
def test_four_processes_of_fifty_identical_wrapped_calls_make_one_upstream_call(
    server: EmbeddedServer, upstream: str
) -> None:
    """Each burst is 4 processes x 50 identical calls; the first one meets a 429, which
    reaches all 200 callers as the SDK's RateLimitError (with its retry-after) and is not
    stored."""
    control(upstream, latency_ms=600)
    user = [{"role": "user", "content": prompt("burst")}]
    limited = [{"role": "user", "content": prompt("limit")}]
    scenarios = [
        scenario("limited", "openai", ["chat", "completions"], model="mock-chat",
                 messages=limited, temperature=0),
        scenario("chat-stream", "openai", ["chat", "completions"], model="mock-chat",
                 messages=user, temperature=0, stream=True),
        scenario("responses-stream", "openai", ["responses"], model="mock-chat",
                 input=prompt("burst"), stream=True),  # sampled: coalesced, not stored
        scenario("responses", "openai", ["responses"], model="mock-chat",
                 input=prompt("burst"), temperature=0),
        scenario("messages-stream", "anthropic", ["messages"], model="mock-claude",
                 max_tokens=40, messages=user, stream=True),
        scenario("messages", "anthropic", ["messages"], model="mock-claude", max_tokens=40,
                 messages=[{"role": "user", "content": prompt("burst")}], cache_sampled=True),
    ]  # fmt: skip
    if FlightCacheSync is not None:
        scenarios += [
            scenario("chat-sync", "openai", ["chat", "completions"], model="mock-chat",
                     messages=[{"role": "user", "content": prompt("sync")}], seed=3, sync=True),
            scenario("messages-sync-stream", "anthropic", ["messages"], model="mock-claude",
                     max_tokens=40, messages=[{"role": "user", "content": prompt("sync")}],
                     stream=True, sync=True),
        ]  # fmt: skip
    results = stampede(server, upstream, scenarios, mode="rate_limit", times=1, retry_after=3)
    stats = calls(upstream)
    made = stats["calls"] - results.pop("baseline")  # after the workers' warm-up calls
    assert made == len(scenarios), stats  # one upstream call per burst
    errors = merged(results.pop("limited"))  # the mock failed it on purpose (see below)
    assert errors["errors"] == {"RateLimitError:429": 200}, errors
    assert errors["retry_after"] == {"3"}
    expected_types = {
        "chat-stream": {"ChatCompletionChunk"},
        "responses": {"Response"},
        "messages": {"Message"},
        "chat-sync": {"ChatCompletion"},
    }
    for name, parts in results.items():
        summary = merged(parts)
        assert summary["count"] == 200 and not summary["errors"], (name, summary)
        assert len(summary["digests"]) == 1, (name, summary)  # every caller got the same
        assert summary["sources"]["MISS"] == 1, (name, summary)
        assert (
            summary["sources"]["MISS"] + summary["sources"]["COALESCED"] + summary["sources"]["HIT"]
            == 200
        )
        if name in expected_types:
            assert summary["types"] == expected_types[name], (name, summary)
    assert {"ResponseCreatedEvent", "ResponseTextDeltaEvent", "ResponseCompletedEvent"} <= (
        merged(results["responses-stream"])["types"]
    )
    assert {"RawMessageStartEvent", "RawContentBlockDeltaEvent", "RawMessageStopEvent"} <= (
        merged(results["messages-stream"])["types"]
    )
    assert merged(results["chat-stream"])["containers"] == {"AsyncCoalescedStream"}
