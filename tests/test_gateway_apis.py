"""``flightcache serve`` with the Responses API and the Messages API, through two replicas,
with the official ``openai`` and ``anthropic`` clients; the cache controls (``Cache-Control``
``max-age``, ``Age``) and the saved-token metrics; the rules that keep a request out of a
flight.

The mock upstream runs in a ``ServerThread`` of this process; the gateways are ``flightcache
serve`` processes sharing the session's Valkey. Clients are made with ``max_retries=0``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from flightcache import EmbeddedServer  # noqa: E402
from flightcache.gateway._mock import make_mock_app  # noqa: E402
from flightcache.gateway._serve_util import ServerThread  # noqa: E402
from flightcache.integrations._rules import (  # noqa: E402
    BadHeader,
    Policy,
    cache_rules,
    request_digest,
    unshareable,
)

from .helpers.gateway import KEY, Gateway, ask, control, reset, start_many, stats  # noqa: E402

CLAUDE_KEY = "ak-gateway-test-key-0123456789"


@dataclass
class Pair:
    a: Gateway
    b: Gateway


@pytest.fixture(scope="module")
def mock_url() -> Iterator[str]:
    with ServerThread(make_mock_app(latency_ms=300, tokens_per_s=200)) as mock:
        yield mock.url


@pytest.fixture(scope="module")
def pair(
    mock_url: str, server: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    replica = ("--namespace", "gwa" + uuid.uuid4().hex[:8])
    gateways = start_many(
        [replica, replica],
        upstream=mock_url,
        redis=server.url,
        directory=tmp_path_factory.mktemp("gateways"),
    )
    try:
        yield Pair(*gateways)
        for gateway in gateways:
            assert gateway.terminate() == 0
            assert KEY not in gateway.stderr() and CLAUDE_KEY not in gateway.stderr()
    finally:
        for gateway in gateways:
            gateway.close()


@pytest.fixture
def upstream(mock_url: str) -> str:
    reset(mock_url)
    return mock_url


def oai(gateway: Gateway, key: str = KEY) -> Any:
    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=20)


def claude(gateway: Gateway, key: str = CLAUDE_KEY, **kw: Any) -> Any:
    return anthropic.AsyncAnthropic(
        base_url=gateway.url, api_key=key, max_retries=0, timeout=20, **kw
    )


def words(tag: str) -> str:
    return f"{tag} {uuid.uuid4().hex}"


async def test_a_burst_of_responses_streams_over_two_replicas_is_one_upstream_call(
    pair: Pair, upstream: str
) -> None:
    body = {"model": "mock-chat", "input": words("burst"), "stream": True}  # sampled

    async def one(client: Any) -> tuple[str, list[Any]]:
        raw = await client.responses.with_raw_response.create(**body)
        events = [event async for event in raw.parse()]
        return raw.headers["x-cache"], events

    clients = [oai(pair.a), oai(pair.b)]
    try:
        results = await asyncio.gather(*[one(clients[i % 2]) for i in range(100)])
    finally:
        for client in clients:
            await client.close()
    assert stats(upstream)["calls"] == 1
    caches = Counter(cache for cache, _ in results)
    assert caches["MISS"] == 1 and caches["MISS"] + caches["COALESCED"] == 100
    streams = [[e.model_dump() for e in events] for _, events in results]
    assert all(s == streams[0] for s in streams)
    events = results[0][1]
    assert isinstance(events[0], openai.types.responses.ResponseCreatedEvent)
    assert isinstance(events[-1], openai.types.responses.ResponseCompletedEvent)
    assert [e.sequence_number for e in events] == list(range(len(events)))

    client = oai(pair.b)
    try:  # the non-stream twin: the terminal event's response, from the cache
        raw = await client.responses.with_raw_response.create(**{**body, "stream": False})
    finally:
        await client.close()
    answer = raw.parse()
    assert raw.headers["x-cache"] == "HIT" and int(raw.headers["age"]) >= 0
    assert answer.id == events[-1].response.id and answer.output_text
    assert answer.usage.model_extra == {"cached": True}
    assert stats(upstream)["calls"] == 1


async def test_a_burst_of_messages_over_two_replicas_is_one_upstream_call(
    pair: Pair, upstream: str
) -> None:
    ask_claude = {
        "model": "mock-claude",
        "max_tokens": 30,
        "messages": [{"role": "user", "content": words("claude")}],
    }

    async def one(client: Any, stream: bool) -> tuple[str, Any]:
        raw = await client.messages.with_raw_response.create(**ask_claude, stream=stream)
        answer = await raw.parse()  # the anthropic client's raw response parses async
        if stream:
            return raw.headers["x-cache"], [e async for e in answer]
        return raw.headers["x-cache"], answer

    clients = [claude(pair.a), claude(pair.b)]
    try:
        results = await asyncio.gather(*[one(clients[i % 2], i % 3 > 0) for i in range(90)])
    finally:
        for client in clients:
            await client.close()
    assert stats(upstream)["by_route"] == {"/v1/messages": 1}
    assert Counter(cache for cache, _ in results)["MISS"] == 1
    streams = [got for _, got in results if isinstance(got, list)]
    answers = [got for _, got in results if not isinstance(got, list)]
    assert all([e.model_dump() for e in s] == [e.model_dump() for e in streams[0]] for s in streams)
    assert {type(m) for m in answers} == {anthropic.types.Message}
    text = "".join(e.delta.text for e in streams[0] if e.type == "content_block_delta")
    assert {m.content[0].text for m in answers} == {text}
    assert {m.usage.output_tokens for m in answers} == {30}


async def test_unshareable_requests_are_proxied_and_errors_keep_their_shape(
    pair: Pair, upstream: str
) -> None:
    client, messages = oai(pair.a), claude(pair.a)
    try:
        for fields in (
            {"previous_response_id": "resp_earlier"},
            {"background": True},
            {"conversation": "conv_1"},
        ):
            raw = await client.responses.with_raw_response.create(
                model="mock-chat", input="same", temperature=0, **fields
            )
            assert raw.headers["x-cache"] == "BYPASS"
        raw = await messages.messages.with_raw_response.create(
            model="mock-claude",
            max_tokens=5,
            messages=[{"role": "user", "content": "c"}],
            extra_body={"container": "container_1"},
        )
        assert raw.headers["x-cache"] == "BYPASS"
        assert stats(upstream)["calls"] == 4

        with pytest.raises(anthropic.BadRequestError) as bad:  # refused by the gateway
            await messages.messages.create(model="mock-claude", max_tokens=5, messages=[])
        assert bad.value.body["error"]["type"] == "invalid_request_error"
        control(upstream, mode="rate_limit", times=1, retry_after=2)
        body = {"model": "mock-claude", "max_tokens": 5}
        body["messages"] = [{"role": "user", "content": words("limit")}]
        with pytest.raises(anthropic.RateLimitError) as limited:
            await messages.messages.create(**body)
        assert limited.value.response.headers["retry-after"] == "2"
        assert limited.value.body["error"]["type"] == "rate_limit_error"

        control(upstream, mode="cut", times=1, cut_after=2)  # a stream cut after two words
        with pytest.raises(anthropic.APIStatusError):
            async for _ in await messages.messages.create(**body, stream=True):
                pass
        control(upstream, mode="cut", times=1, cut_after=2)
        cut = await client.responses.create(model="mock-chat", input=words("cut"), stream=True)
        events = [event async for event in cut]
        assert events[-1].type == "error" and events[-1].code == "cut"
        assert stats(upstream)["cuts"] == 2
    finally:
        await client.close()
        await messages.close()


async def test_max_age_age_and_the_tokens_the_cache_saved(pair: Pair, upstream: str) -> None:
    body = {"model": "mock-chat", "input": words("age"), "temperature": 0}
    async with httpx.AsyncClient(timeout=20) as http:
        first = await ask(http, pair.a.url, body, path="/v1/responses")
        assert first.cache == "MISS" and "age" not in first.headers
        await asyncio.sleep(1.1)
        hit = await ask(http, pair.b.url, body, path="/v1/responses")
        assert hit.cache == "HIT" and int(hit.headers["age"]) >= 1
        young = {"cache-control": "max-age=30"}
        assert (await ask(http, pair.b.url, body, path="/v1/responses", headers=young)).cache == (
            "HIT"
        )
        stale = {"cache-control": "max-age=1"}
        renewed = await ask(http, pair.a.url, body, path="/v1/responses", headers=stale)
        assert renewed.cache == "MISS" and renewed.body["id"] != first.body["id"]
        bad = await ask(
            http, pair.a.url, body, path="/v1/responses", headers={"cache-control": "max-age=x"}
        )
        assert bad.status == 400 and bad.error is not None
        assert stats(upstream)["calls"] == 2

        text = (await http.get(f"{pair.b.url}/metrics")).text
    saved = {
        (s.labels["model"], s.labels["kind"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "flightcache_gateway_saved_tokens_total"
    }
    usage = first.body["usage"]
    assert saved[("mock-chat", "prompt")] >= 2 * usage["input_tokens"]
    assert saved[("mock-chat", "completion")] >= 2 * usage["output_tokens"]
    requests = [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "flightcache_gateway_saved_requests_total"
    ]
    assert requests and all(len(s.labels["tenant"]) == 12 for s in requests)
    assert KEY not in text


async def test_the_messages_api_version_is_part_of_the_key(pair: Pair, upstream: str) -> None:
    body = {
        "model": "mock-claude",
        "max_tokens": 5,
        "extra_body": {"temperature": 0},  # stored: this SDK version takes no temperature
        "messages": [{"role": "user", "content": words("version")}],
    }
    older = claude(pair.a, default_headers={"anthropic-version": "2023-06-01"})
    newer = claude(pair.a)
    other_key = claude(pair.b, key="ak-someone-else-entirely")
    try:
        for client in (older, newer, newer, other_key):
            await client.messages.create(**body)
    finally:
        for client in (older, newer, other_key):
            await client.close()
    assert stats(upstream)["calls"] == 3


def test_the_rules_that_keep_a_request_out_of_a_flight() -> None:
    assert unshareable("responses", {"background": True}) == "background"
    assert unshareable("responses", {"previous_response_id": "r"}) == "previous_response_id"
    assert unshareable("responses", {"previous_response_id": "r", "store": False}) is None
    assert unshareable("responses", {"conversation": {"id": "c"}}) == "conversation"
    orphan = [{"type": "function_call_output", "call_id": "x", "output": "1"}]
    assert unshareable("responses", {"input": orphan}) == "stored_items"
    answered = [{"type": "function_call", "call_id": "x", "name": "f", "arguments": ""}, *orphan]
    assert unshareable("responses", {"input": answered}) is None
    assert unshareable("messages", {"container": "c"}) == "container"
    assert unshareable("completions", {"best_of": 2}) == "best_of"
    assert unshareable("chat", {"store": True}) is None

    policy = Policy(cache_sampled=False)
    sampled = cache_rules("messages", {}, {}, policy)
    assert sampled.sampled and not sampled.store and sampled.refresh
    zero = cache_rules("messages", {"temperature": 0.0}, {"cache-control": "max-age=60"}, policy)
    assert zero.store and zero.max_age == 60 and not zero.refresh
    assert cache_rules("chat", {"seed": 1}, {"cache-control": "max-age=0"}, policy).refresh
    with pytest.raises(BadHeader):
        cache_rules("chat", {}, {"cache-control": "max-age=-1"}, policy)
    assert cache_rules("chat", {}, {"x-flightcache-coalesce": "off"}, policy).bypass == (
        "opted_out"
    )
    one = request_digest("/v1/messages", {"model": "m"}, "t", {"anthropic-version": "1"})
    two = request_digest("/v1/messages", {"model": "m"}, "t", {"anthropic-version": "2"})
    chat = request_digest("/v1/chat/completions", {"model": "m"}, "t", {"anthropic-version": "1"})
    assert one != two and chat == request_digest("/v1/chat/completions", {"model": "m"}, "t")


def test_the_mock_answers_both_apis_deterministically(upstream: str) -> None:
    """The same request gets the same words, stream or not; a smaller limit a prefix."""
    body = {"model": "mock-chat", "input": "same words", "temperature": 0}
    with openai.OpenAI(base_url=f"{upstream}/v1", api_key="sk-m", max_retries=0) as client:
        whole = client.responses.create(**body)
        streamed = "".join(
            e.delta
            for e in client.responses.create(**body, stream=True)
            if e.type.endswith("delta")
        )
        short = client.responses.create(**body, max_output_tokens=16)
    assert whole.output_text == streamed and whole.status == "completed"
    assert whole.output_text.startswith(short.output_text) and short.status == "incomplete"
    ask_claude = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-api-key": "ak-m", "anthropic-version": "2023-06-01"}
    first = httpx.post(f"{upstream}/v1/messages", json=ask_claude, headers=headers, timeout=10)
    again = httpx.post(f"{upstream}/v1/messages", json=ask_claude, headers=headers, timeout=10)
    assert first.json()["content"] == again.json()["content"]
    assert (
        first.json()["stop_reason"] == "max_tokens" and first.json()["usage"]["output_tokens"] == 4
    )
    denied = httpx.post(f"{upstream}/v1/messages", json=ask_claude, timeout=10)
    assert denied.status_code == 401 and denied.json()["type"] == "error"
    assert denied.json()["error"]["type"] == "authentication_error"
