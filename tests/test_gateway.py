"""``flightcache serve``, the OpenAI-compatible gateway, over real HTTP and real processes.

The upstream is the mock (``make_mock_app`` in a ``ServerThread`` of this process, so tests
read its ``/stats`` and switch its modes); the gateways are ``flightcache serve`` processes on
``--port 0`` sharing the session's Valkey. Every test asks with a prompt of its own, so the
module's gateways can share one namespace. The official ``openai`` clients are made with
``max_retries=0``: they retry 408, 409, 429 and 5xx, which would hide the statuses under test.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from flightcache import EmbeddedServer  # noqa: E402
from flightcache.gateway._assemble import assemble, for_client  # noqa: E402
from flightcache.gateway._mock import make_mock_app  # noqa: E402
from flightcache.gateway._serve_util import ServerThread  # noqa: E402
from flightcache.gateway._upstream import REST_S, _rest_of  # noqa: E402

from .helpers.gateway import (  # noqa: E402
    KEY,
    Gateway,
    ask,
    astats,
    control,
    reset,
    start,
    start_many,
    stats,
)

OTHER_KEY = "sk-another-tenant-key-fedcba9876543210"
LIMITS = httpx.Limits(max_connections=500, max_keepalive_connections=500)


@dataclass
class Fleet:
    a: Gateway  # two replicas on one namespace of the session server
    b: Gateway
    shared: Gateway  # --share-across-keys --no-cache-sampled --upstream-timeout 0.5


@pytest.fixture(scope="module")
def mock_url() -> Iterator[str]:
    with ServerThread(make_mock_app()) as mock:
        yield mock.url


@pytest.fixture(scope="module")
def fleet(
    mock_url: str, server: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    ns = "gw" + uuid.uuid4().hex[:8]
    replica = ("--namespace", ns, "--error-ttl", "0.5")
    shared = ("--namespace", ns + "s", "--share-across-keys", "--no-cache-sampled")
    shared += ("--upstream-timeout", "0.5")
    gateways = start_many(
        [replica, replica, shared],
        upstream=mock_url,
        redis=server.url,
        directory=tmp_path_factory.mktemp("gateways"),
    )
    try:
        yield Fleet(*gateways)
        for gateway in gateways:
            assert gateway.terminate() == 0
            assert KEY not in gateway.stderr() and OTHER_KEY not in gateway.stderr()
    finally:
        for gateway in gateways:
            gateway.close()


@pytest.fixture
def upstream(mock_url: str) -> str:
    """The module's mock, reset to its initial settings with its counters zeroed."""
    reset(mock_url)
    return mock_url


def chat(tag: str, **fields: Any) -> dict[str, Any]:
    """A chat request of this test's own (temperature 0: deterministic, always stored)."""
    content = f"{tag} {uuid.uuid4().hex}"
    return {"model": "mock-chat", "messages": [{"role": "user", "content": content}]} | {
        "temperature": 0,
        **fields,
    }


async def wait_calls(client: Any, upstream: str, calls: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (await astats(client, upstream))["calls"] < calls:
        assert time.monotonic() < deadline, f"the upstream never got {calls} call(s)"
        await asyncio.sleep(0.01)


def sync_client(gateway: Gateway, key: str = KEY) -> Any:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=20)


def async_client(gateway: Gateway, key: str = KEY) -> Any:
    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=20)


# -- the official client ---------------------------------------------------------------------


def test_the_sync_openai_client_gets_well_formed_answers(fleet: Fleet, upstream: str) -> None:
    messages = chat("sync")["messages"]
    with sync_client(fleet.a) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="mock-chat", messages=messages, temperature=0
        )
        assert raw.headers["x-cache"] == "MISS"
        assert re.fullmatch(r"[0-9a-f]{32}", raw.headers["x-flightcache-key"])
        answer = raw.parse()
        assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
        assert answer.model == "mock-chat" and answer.system_fingerprint == "fp_flightcache_mock"
        [choice] = answer.choices
        assert choice.index == 0 and choice.finish_reason == "stop"
        assert choice.message.role == "assistant" and choice.message.tool_calls is None
        content = choice.message.content
        assert len(content.split()) == 32
        assert answer.usage.completion_tokens == 32
        assert (answer.usage.model_extra or {}).get("cached") is None

        # The streaming twin is the same flight's answer: a hit, without usage unless asked.
        chunks = list(
            client.chat.completions.create(
                model="mock-chat", messages=messages, temperature=0, stream=True
            )
        )
        assert all(c.object == "chat.completion.chunk" and c.usage is None for c in chunks)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == content
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason == "stop"
        chunks = list(
            client.chat.completions.create(
                model="mock-chat",
                messages=messages,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32
        assert chunks[-1].usage.model_extra["cached"] is True  # served from the cache

        prompt = f"sync {uuid.uuid4().hex}"
        text = client.completions.create(
            model="mock-instruct", prompt=prompt, temperature=0, max_tokens=5
        )
        assert text.object == "text_completion" and text.id.startswith("cmpl-")
        assert text.choices[0].finish_reason == "length"
        assert len(text.choices[0].text.split()) == 5
        streamed = client.completions.create(
            model="mock-instruct", prompt=prompt, temperature=0, max_tokens=5, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text

        vectors = client.embeddings.create(model="mock-embedding", input=["alpha", "beta"])
        assert [d.index for d in vectors.data] == [0, 1]  # base64 on the wire, decoded
        assert all(len(d.embedding) == 1536 for d in vectors.data)
        floats = client.embeddings.create(
            model="mock-embedding", input=["alpha", "beta"], encoding_format="float"
        )
        assert floats.data[0].embedding == pytest.approx(vectors.data[0].embedding, abs=1e-6)

        assert "mock-chat" in [m.id for m in client.models.list().data]  # passed through
    s = stats(upstream)
    assert s["by_route"] == {
        "/v1/chat/completions": 1,
        "/v1/completions": 1,
        "/v1/embeddings": 2,
        "/v1/models": 1,
    }
    assert s["streams"] == 2  # the gateway streams from the upstream even for plain requests


async def test_the_async_openai_client_gets_well_formed_answers(
    fleet: Fleet, upstream: str
) -> None:
    messages = chat("async")["messages"]
    async with async_client(fleet.b) as client:
        stream = await client.chat.completions.create(
            model="mock-chat", messages=messages, temperature=0, n=2, stream=True
        )
        texts = ["", ""]
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
        answer = await client.chat.completions.create(
            model="mock-chat", messages=messages, temperature=0, n=2
        )
        assert [c.index for c in answer.choices] == [0, 1]
        assert [c.message.content for c in answer.choices] == texts
        assert texts[0] != texts[1]
        assert answer.usage.completion_tokens == 64 and answer.usage.model_extra["cached"]

        prompt = f"async {uuid.uuid4().hex}"
        text = await client.completions.create(model="mock-instruct", prompt=prompt, seed=7)
        assert len(text.choices[0].text.split()) == 32
        vectors = await client.embeddings.create(model="mock-embedding", input="one", dimensions=8)
        assert len(vectors.data[0].embedding) == 8
        again = await client.embeddings.with_raw_response.create(
            model="mock-embedding", input="one", dimensions=8
        )
        assert again.headers["x-cache"] == "HIT"
        assert again.parse().data[0].embedding == vectors.data[0].embedding
    assert stats(upstream)["calls"] == 3


# -- coalescing ------------------------------------------------------------------------------


async def test_x_cache_says_miss_coalesced_and_hit(fleet: Fleet, upstream: str) -> None:
    # The upstream answers late enough that the two others join the flight on a loaded machine.
    control(upstream, latency_ms=3000)
    body = chat("x-cache")
    async with httpx.AsyncClient(timeout=20) as client:
        first = asyncio.ensure_future(ask(client, fleet.a.url, body))
        await wait_calls(client, upstream, 1)
        second, third = await asyncio.gather(
            ask(client, fleet.b.url, body), ask(client, fleet.a.url, {**body, "stream": True})
        )
        first_answer = await first
        fourth = await ask(client, fleet.b.url, body)
        assert (await astats(client, upstream))["calls"] == 1
    assert [first_answer.cache, second.cache, third.cache, fourth.cache] == [
        "MISS",
        "COALESCED",
        "COALESCED",
        "HIT",
    ]
    assert len({a.headers["x-flightcache-key"] for a in (first_answer, second, third, fourth)}) == 1
    assert first_answer.text == second.text == third.text == fourth.text
    assert fourth.body["usage"]["cached"] is True
    assert "cached" not in first_answer.body["usage"]


async def test_calls_to_the_upstream_reuse_their_connection(fleet: Fleet, upstream: str) -> None:
    """A streamed answer is read to the end of its body, past its ``[DONE]``, so the
    connection goes back to the gateway's pool: six calls one after another (streamed and
    not, each a new prompt) come on one or two connections, not six (a body left unread
    closes its connection, and each call would pay a new one, a TLS handshake on the real
    API)."""
    async with httpx.AsyncClient(timeout=20) as client:
        for i in range(6):
            answer = await ask(client, fleet.a.url, chat(f"keep-alive {i}", stream=i % 2 == 0))
            assert answer.cache == "MISS"
        upstream_stats = await astats(client, upstream)
    assert upstream_stats["calls"] == 6
    assert upstream_stats["connections"] <= 2


async def test_the_read_past_done_gives_up_after_its_bound() -> None:
    """An upstream that keeps a stream's body open after ``[DONE]`` (here: a comment every
    10 ms, forever) delays the end by ``REST_S`` at most."""
    sent = 0

    async def endless() -> AsyncIterator[str]:
        nonlocal sent
        while True:
            await asyncio.sleep(0.01)
            sent += 1
            yield ": keep-alive"

    started = time.monotonic()
    await _rest_of(endless())
    assert REST_S <= time.monotonic() - started < REST_S + 2.0
    assert sent > 10  # it did read, until the bound


@pytest.mark.timeout(90)
async def test_200_identical_streams_over_two_gateways_make_one_upstream_call(
    fleet: Fleet, upstream: str
) -> None:
    control(upstream, latency_ms=300, tokens_per_s=50)
    body = chat("burst", stream=True)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=30, limits=LIMITS) as client:
        answers = await asyncio.wait_for(
            asyncio.gather(*(ask(client, (fleet.a, fleet.b)[i % 2].url, body) for i in range(200))),
            60,
        )
        s = await astats(client, upstream)
    elapsed = time.monotonic() - started
    sources = Counter(a.cache for a in answers)
    calls = s["calls"]
    print(f"\n200 streams, 2 gateways: {calls} upstream call(s), {dict(sources)}, {elapsed:.2f} s")
    assert s["calls"] == 1
    assert all(a.status == 200 and a.done and a.error is None for a in answers)
    texts = {a.text for a in answers}
    assert len(texts) == 1 and len(texts.pop().split()) == 32
    assert sources["MISS"] == 1
    assert sources["MISS"] + sources["COALESCED"] + sources["HIT"] == 200


async def test_a_non_stream_twin_of_a_running_stream_shares_its_flight(
    fleet: Fleet, upstream: str
) -> None:
    control(upstream, latency_ms=100, tokens_per_s=40)
    body = chat("twin")
    three = asyncio.Event()
    async with httpx.AsyncClient(timeout=20) as client:
        streaming = asyncio.ensure_future(
            ask(
                client,
                fleet.a.url,
                {**body, "stream": True},
                on_event=lambda n: n >= 3 and three.set(),
            )
        )
        await asyncio.wait_for(three.wait(), 10)
        plain = await ask(client, fleet.b.url, body)
        streamed = await streaming
        assert (await astats(client, upstream))["calls"] == 1
    assert (streamed.cache, plain.cache) == ("MISS", "COALESCED")
    assert plain.body["object"] == "chat.completion"
    assert plain.text == streamed.text and len(plain.text.split()) == 32
    assert plain.body["usage"]["completion_tokens"] == 32


async def test_a_late_joiner_gets_the_whole_stream(fleet: Fleet, upstream: str) -> None:
    control(upstream, latency_ms=50, tokens_per_s=40)
    body = chat("late", stream=True, stream_options={"include_usage": True})
    halfway = asyncio.Event()
    async with httpx.AsyncClient(timeout=20) as client:
        owner = asyncio.ensure_future(
            ask(client, fleet.a.url, body, on_event=lambda n: n >= 16 and halfway.set())
        )
        await asyncio.wait_for(halfway.wait(), 10)
        late_remote, late_local = await asyncio.gather(
            ask(client, fleet.b.url, body), ask(client, fleet.a.url, body)
        )
        first = await owner
        assert (await astats(client, upstream))["calls"] == 1
    assert (first.cache, late_remote.cache, late_local.cache) == ("MISS", "COALESCED", "COALESCED")
    assert first.events == late_remote.events == late_local.events  # every chunk, in order
    assert first.done and first.events[-2]["usage"]["completion_tokens"] == 32


# -- the owner dies --------------------------------------------------------------------------


@pytest.mark.timeout(90)
async def test_the_owner_gateway_killed_mid_stream(
    upstream: str, server: EmbeddedServer, tmp_path: Path
) -> None:
    """The other gateway's stream clients that had chunks get a clear restart error event,
    its non-stream clients get the whole answer from a new upstream call; none hangs."""
    ns = "gk" + uuid.uuid4().hex[:8]
    owner_gw, other_gw = start_many(
        [("--namespace", ns, "--lease", "1")] * 2,
        upstream=upstream,
        redis=server.url,
        directory=tmp_path,
    )
    try:
        control(upstream, latency_ms=100, tokens_per_s=20, text_tokens=40)
        body = chat("kill", stream=True)
        owner_going = asyncio.Event()
        seen = [0] * 20

        def note(i: int) -> Any:
            return lambda n: seen.__setitem__(i, n)

        async with httpx.AsyncClient(timeout=30, limits=LIMITS) as client:
            owner = asyncio.ensure_future(
                ask(client, owner_gw.url, body, on_event=lambda n: n >= 2 and owner_going.set())
            )
            await asyncio.wait_for(owner_going.wait(), 10)
            streams = [
                asyncio.ensure_future(ask(client, other_gw.url, body, on_event=note(i)))
                for i in range(20)
            ]
            plain = [
                asyncio.ensure_future(ask(client, other_gw.url, {**body, "stream": False}))
                for _ in range(5)
            ]
            deadline = time.monotonic() + 10
            while min(seen) < 3:
                assert time.monotonic() < deadline, f"followers got no chunks: {seen}"
                await asyncio.sleep(0.01)
            killed_at = time.monotonic()
            owner_gw.kill()
            results = await asyncio.wait_for(asyncio.gather(*streams, *plain), 30)
            finished_in = time.monotonic() - killed_at
            lost = await asyncio.wait_for(owner, 10)
            final = await ask(client, other_gw.url, body)
            s = await astats(client, upstream)
    finally:
        owner_gw.close()
        other_gw.close()
    assert lost.broken is not None or not lost.done  # its own client lost the connection
    assert final.cache == "HIT" and final.done
    full = final.text
    assert len(full.split()) == 40
    outcomes = Counter()
    for answer in results[:20]:
        assert answer.status == 200 and answer.broken is None
        if answer.done:
            assert answer.text == full
            outcomes["full"] += 1
        else:
            assert answer.error is not None and answer.error["code"] == "stream_restarted"
            assert answer.error["type"] == "server_error"
            outcomes["restarted"] += 1
    for answer in results[20:]:
        assert answer.status == 200 and answer.text == full
        outcomes["plain-full"] += 1
    print(f"\nowner killed: {dict(outcomes)}, all answered {finished_in:.2f} s after the kill")
    assert s["calls"] == 2  # the dead owner's call, and one by the taker-over


# -- tenants ---------------------------------------------------------------------------------


async def test_api_keys_do_not_share_answers_unless_configured(fleet: Fleet, upstream: str) -> None:
    body = chat("tenants")
    async with httpx.AsyncClient(timeout=20) as client:
        mine = await ask(client, fleet.a.url, body, key=KEY)
        theirs = await ask(client, fleet.b.url, body, key=OTHER_KEY)
        theirs_again = await ask(client, fleet.a.url, body, key=OTHER_KEY)
        assert (await astats(client, upstream))["calls"] == 2
        shared = await ask(client, fleet.shared.url, body, key=KEY)
        shared_other = await ask(client, fleet.shared.url, body, key=OTHER_KEY)
        s = await astats(client, upstream)
    assert (mine.cache, theirs.cache, theirs_again.cache) == ("MISS", "MISS", "HIT")
    assert mine.headers["x-flightcache-key"] != theirs.headers["x-flightcache-key"]
    assert (shared.cache, shared_other.cache) == ("MISS", "HIT")
    assert s["calls"] == 3
    assert len(s["tenants"]) == 2  # the upstream saw each caller's own key


async def test_shared_across_keys_another_callers_refused_key_is_not_mine(
    fleet: Fleet, upstream: str
) -> None:
    """Under --share-across-keys a caller coalesced onto a flight whose owner's key was
    refused (401) joins again with its own key instead of getting the owner's error."""
    control(upstream, mode="fail", status=401, latency_ms=300, times=1)
    body = chat("shared-auth")
    async with httpx.AsyncClient(timeout=20) as client:
        owner = asyncio.ensure_future(ask(client, fleet.shared.url, body, key="sk-revoked"))
        await wait_calls(client, upstream, 1)
        follower = await ask(client, fleet.shared.url, body, key=OTHER_KEY)
        refused = await owner
        assert (await astats(client, upstream))["calls"] == 2
    assert refused.status == 401 and refused.cache == "MISS"
    assert follower.status == 200 and follower.cache == "MISS"


# -- upstream errors -------------------------------------------------------------------------


async def test_a_429_reaches_every_coalesced_caller_and_a_retry_goes_upstream(
    fleet: Fleet, upstream: str
) -> None:
    control(upstream, mode="rate_limit", retry_after=2, latency_ms=500, times=1)
    body = chat("ratelimit")
    stream = {**body, "stream": True}
    async with httpx.AsyncClient(timeout=20) as client, async_client(fleet.b) as oai:
        first = asyncio.ensure_future(ask(client, fleet.a.url, stream))
        await wait_calls(client, upstream, 1)

        async def official() -> Any:
            with pytest.raises(openai.RateLimitError) as info:
                await oai.chat.completions.create(**stream)
            return info.value

        *others, refused = await asyncio.gather(
            ask(client, fleet.b.url, stream),
            ask(client, fleet.b.url, body),
            ask(client, fleet.a.url, body),
            official(),
        )
        answers = [await first, *others]
        assert (await astats(client, upstream))["calls"] == 1
        retry = await ask(client, fleet.a.url, body)
        assert (await astats(client, upstream))["calls"] == 2
    for answer in answers:
        assert answer.status == 429 and answer.events == []
        assert answer.headers["retry-after"] == "2"
        assert answer.error is not None and answer.error["code"] == "rate_limit_exceeded"
    assert sorted(a.cache for a in answers) == ["COALESCED"] * 3 + ["MISS"]
    assert refused.status_code == 429 and refused.response.headers["retry-after"] == "2"
    assert retry.status == 200 and retry.cache == "MISS"


async def test_server_errors_are_not_cached_and_client_errors_only_briefly(
    fleet: Fleet, upstream: str
) -> None:
    body = chat("errors")
    async with httpx.AsyncClient(timeout=20) as client:
        control(upstream, mode="fail", status=500, times=1)
        failed = await ask(client, fleet.a.url, body)
        ok = await ask(client, fleet.b.url, body)
        assert (await astats(client, upstream))["calls"] == 2

        body = chat("bad-request")
        control(upstream, mode="fail", status=400, times=1)
        refused = await ask(client, fleet.a.url, body)
        refused_again = await ask(client, fleet.b.url, {**body, "stream": True})
        assert (await astats(client, upstream))["calls"] == 3  # negative-cached
        await asyncio.sleep(0.8)  # --error-ttl 0.5 (+ jitter)
        later = await ask(client, fleet.a.url, body)
        assert (await astats(client, upstream))["calls"] == 4
    assert failed.status == 500 and failed.error is not None
    assert failed.error["type"] == "server_error"
    assert ok.status == 200 and ok.cache == "MISS"
    assert refused.status == 400 and refused.cache == "MISS"
    assert refused_again.status == 400 and refused_again.cache == "HIT"
    assert refused_again.events == []
    assert later.status == 200


async def test_a_cut_stream_is_an_error_for_every_caller_and_not_cached(
    fleet: Fleet, upstream: str
) -> None:
    # The upstream answers late enough that the three callers below join the flight before
    # the cut on a loaded machine (in one CI run, with 200 ms, the SDK's first request came
    # after the flight had failed and was answered by a second call).
    control(upstream, mode="cut", cut_after=3, latency_ms=2000, tokens_per_s=50, times=1)
    body = chat("cut")
    stream = {**body, "stream": True}
    async with httpx.AsyncClient(timeout=20) as client, async_client(fleet.b) as oai:
        owner = asyncio.ensure_future(ask(client, fleet.a.url, stream))
        await wait_calls(client, upstream, 1)

        async def official() -> list[str]:
            got: list[str] = []
            with pytest.raises(openai.APIError, match=r"cut off|ended before"):
                async for chunk in await oai.chat.completions.create(**stream):
                    got.append(chunk.choices[0].delta.content)
            return got

        follower, plain, got = await asyncio.gather(
            ask(client, fleet.b.url, stream), ask(client, fleet.b.url, body), official()
        )
        cut = await owner
        assert (await astats(client, upstream))["calls"] == 1
        retry = await ask(client, fleet.a.url, body)
        assert (await astats(client, upstream))["calls"] == 2
    for answer in (cut, follower):
        assert answer.status == 200 and not answer.done and answer.broken is None
        assert answer.error is not None and answer.error["code"] == "cut"
        assert len(answer.text.split()) == 3
    assert "".join(got) == cut.text
    assert plain.status == 502 and plain.error is not None and plain.error["code"] == "cut"
    assert retry.status == 200 and retry.cache == "MISS" and len(retry.text.split()) == 32


async def test_a_client_that_hangs_up_mid_stream_is_let_go_and_the_flight_goes_on(
    fleet: Fleet, upstream: str
) -> None:
    """A stream client that hangs up after two events: its replica stops serving it at once
    (its request leaves the in-flight gauge long before the answer ends), while the flight
    goes on: the other caller gets the whole answer from one upstream call, and the answer
    is stored."""
    control(upstream, tokens_per_s=10)  # 32 tokens: more than 3 s
    body = {**chat("hang-up"), "stream": True}

    async def in_flight(client: httpx.AsyncClient, gateway: Gateway) -> float:
        text = (await client.get(f"{gateway.url}/metrics")).text
        for family in text_string_to_metric_families(text):
            if family.name == "flightcache_gateway_requests_in_flight":
                return float(family.samples[0].value)
        raise AssertionError("no in-flight gauge")

    async with httpx.AsyncClient(timeout=20) as client:
        stayer = asyncio.ensure_future(ask(client, fleet.a.url, body))
        await wait_calls(client, upstream, 1)
        headers = {"authorization": f"Bearer {KEY}"}
        url = fleet.b.url + "/v1/chat/completions"
        events = 0
        async with client.stream("POST", url, json=body, headers=headers) as response:
            assert response.headers["x-cache"] == "COALESCED"
            async for line in response.aiter_lines():
                events += line.startswith("data: ")
                if events == 2:
                    break  # leaving the block closes the connection mid-answer
            assert await in_flight(client, fleet.b) == 1
        deadline = time.monotonic() + 2
        while await in_flight(client, fleet.b) != 0:
            assert time.monotonic() < deadline, "the replica kept serving a client that left"
            await asyncio.sleep(0.02)
        assert not stayer.done()  # let go long before the answer ended
        stayed = await stayer
        # Stored: b answers from the result. (b's own flight task, which went on after its
        # client left, ends when b hears the end, a moment after a's client got it; a
        # request that comes to b before that joins it, COALESCED: then ask again.)
        for _ in range(20):
            hit = await ask(client, fleet.b.url, body)
            if hit.cache != "COALESCED":
                break
            await asyncio.sleep(0.05)
        assert (await astats(client, upstream))["calls"] == 1
    assert stayed.status == 200 and stayed.done and len(stayed.text.split()) == 32
    assert hit.cache == "HIT" and hit.text == stayed.text


async def test_an_upstream_that_does_not_answer_is_a_504(fleet: Fleet, upstream: str) -> None:
    control(upstream, mode="hang", hang_s=10, times=1)
    body = chat("hang")
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=20) as client:
        answer = await ask(client, fleet.shared.url, body)  # --upstream-timeout 0.5
        elapsed = time.monotonic() - started
        retry = await ask(client, fleet.shared.url, body)
    assert answer.status == 504 and answer.error is not None
    assert answer.error["code"] == "timeout"
    assert elapsed < 5
    assert retry.status == 200 and retry.cache == "MISS"


# -- controls --------------------------------------------------------------------------------


async def test_cache_control_ttl_and_opt_out_headers(fleet: Fleet, upstream: str) -> None:
    async with httpx.AsyncClient(timeout=20) as client:

        async def caches(body: dict[str, Any], headers: dict[str, str] | None = None) -> str:
            answer = await ask(client, fleet.a.url, body, headers=headers)
            assert answer.status == 200, answer.body
            return str(answer.cache)

        async def calls() -> int:
            return int((await astats(client, upstream))["calls"])

        body = chat("no-cache")
        assert await caches(body) == "MISS"
        assert await caches(body, {"cache-control": "no-cache"}) == "MISS"  # refreshed
        assert await caches(body) == "HIT"
        assert await calls() == 2

        body = chat("no-store")
        assert await caches(body, {"cache-control": "no-store"}) == "MISS"
        assert await caches(body) == "MISS"
        assert await calls() == 4

        body = chat("ttl")
        assert await caches(body, {"x-flightcache-ttl": "2"}) == "MISS"
        assert await caches(body) == "HIT"
        await asyncio.sleep(2.5)  # 2 s + 10 % jitter, with room for a loaded machine
        assert await caches(body) == "MISS"
        assert await calls() == 6
        for bad in ("soon", "-1", "nan", "1e99"):
            refused = await ask(client, fleet.a.url, body, headers={"x-flightcache-ttl": bad})
            assert refused.status == 400 and refused.error is not None
            assert refused.error["code"] == "invalid_header"

        body = chat("opt-out")
        off = {"x-flightcache-coalesce": "off"}
        direct = [await ask(client, fleet.a.url, body, headers=off) for _ in range(2)]
        assert [a.cache for a in direct] == ["BYPASS", "BYPASS"]
        assert all("x-flightcache-key" not in a.headers for a in direct)
        streamed = await ask(client, fleet.a.url, {**body, "stream": True}, headers=off)
        assert streamed.done and streamed.text == direct[0].text
        assert await calls() == 9
        assert await caches(body) == "MISS"  # the opt-outs stored nothing


async def test_sampled_requests_are_coalesced_and_stored_only_if_configured(
    fleet: Fleet, upstream: str
) -> None:
    control(upstream, latency_ms=300)
    sampled = chat("sampled")
    del sampled["temperature"]  # omitted: the API samples at temperature 1
    async with httpx.AsyncClient(timeout=20) as client:
        # The replicas keep the default (cache sampled answers).
        first = await ask(client, fleet.a.url, sampled)
        second = await ask(client, fleet.b.url, sampled)
        assert (first.cache, second.cache) == ("MISS", "HIT")
        # --no-cache-sampled: coalesced while in flight, never served from storage.
        burst = await asyncio.gather(*(ask(client, fleet.shared.url, sampled) for _ in range(3)))
        later = await ask(client, fleet.shared.url, sampled)
        assert (await astats(client, upstream))["calls"] == 3
        assert sorted(a.cache for a in burst) == ["COALESCED", "COALESCED", "MISS"]
        assert later.cache == "MISS"
        for fields in ({"temperature": 0}, {"temperature": 1.2, "seed": 42}):
            body = {**sampled, **fields}
            assert (await ask(client, fleet.shared.url, body)).cache == "MISS"
            assert (await ask(client, fleet.shared.url, body)).cache == "HIT"


async def test_bad_requests_are_openai_shaped_400s(fleet: Fleet, upstream: str) -> None:
    url = f"{fleet.a.url}/v1/chat/completions"
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(timeout=20) as client:
        for content in (b"{not json", b"[1, 2]", b"", b'{"model": "m", "messages": "hi"}'):
            r = await client.post(url, content=content, headers=headers)
            assert r.status_code == 400, content
            assert r.json()["error"]["type"] == "invalid_request_error"
        for field, value in (
            ("model", 5),
            ("temperature", "hot"),
            ("n", True),
            ("stream", "yes"),
            ("tools", {}),
            ("stop", [1]),
        ):
            r = await client.post(url, json={**chat("bad"), field: value}, headers=headers)
            assert r.status_code == 400 and r.json()["error"]["param"] == field
        r = await client.post(f"{fleet.a.url}/v1/embeddings", json={"model": "m"}, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        assert (await astats(client, upstream))["calls"] == 0
    with sync_client(fleet.a) as oai, pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="mock-chat", messages=[], temperature=0)


def test_other_paths_are_passed_through(fleet: Fleet, upstream: str) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{fleet.a.url}/v1/nope?x=1", headers=headers, content=b"{}")
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "Invalid URL (POST /v1/nope)"
    r = httpx.get(f"{fleet.a.url}/v1/chat/completions", headers=headers)  # not a POST
    assert r.status_code == 404
    r = httpx.get(f"{fleet.a.url}/v1/models/mock-chat", headers=headers)
    assert r.status_code == 200 and r.json()["id"] == "mock-chat"
    assert httpx.get(f"{fleet.a.url}/v1/models").status_code == 401  # no key: the upstream's
    assert stats(upstream)["calls"] == 4


# -- operations ------------------------------------------------------------------------------


async def test_metrics_and_healthz(fleet: Fleet, upstream: str) -> None:
    body = chat("metrics")
    async with httpx.AsyncClient(timeout=20) as client:
        await ask(client, fleet.a.url, body)
        await ask(client, fleet.a.url, body)
        health = await client.get(f"{fleet.a.url}/healthz")
        text = (await client.get(f"{fleet.a.url}/metrics")).text
    assert health.status_code == 200
    assert health.json()["status"] == "ok" and health.json()["backend"] == "redis"
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    assert value("flightcache_gateway_requests_total", route="chat", cache="MISS", status="200")
    assert value("flightcache_gateway_requests_total", route="chat", cache="HIT", status="200")
    assert value("flightcache_gateway_upstream_requests_total", route="chat", status="200")
    assert value("flightcache_streams_total") >= 2
    assert value("flightcache_hits_total") >= 1
    assert value("flightcache_loader_runs_total") >= 1
    assert value("flightcache_gateway_request_duration_seconds_count", route="chat", cache="HIT")
    assert value("flightcache_gateway_time_to_first_byte_seconds_count", route="chat", cache="MISS")
    assert "flightcache_gateway_requests_in_flight" in text
    assert KEY not in text


def test_at_debug_level_the_http_clients_log_no_url_that_may_hold_a_key(
    mock_url: str, server: EmbeddedServer, tmp_path: Path
) -> None:
    """Some upstreams take a key in the query string: an HTTP client's own loggers (aiohttp's,
    or httpx's and httpcore's, which log each request's URL) stay at warning even when the
    gateway logs at debug."""
    secret = "sk-query-" + uuid.uuid4().hex
    gateway = start(
        mock_url,
        "--namespace",
        "quiet",
        "--log-level",
        "debug",
        redis=server.url,
        directory=tmp_path,
    )
    try:
        headers = {"authorization": f"Bearer {KEY}"}
        r = httpx.get(f"{gateway.url}/v1/models/mock-chat?api-key={secret}", headers=headers)
        assert r.status_code == 200
        with sync_client(gateway) as client:
            client.chat.completions.create(**chat("quiet"))
        assert gateway.terminate() == 0
        logged = gateway.stderr()
        assert "flightcache" in logged  # it did log at debug
        assert secret not in logged and KEY not in logged
    finally:
        gateway.close()


def test_serve_on_the_embedded_server_prints_its_address_and_stops_on_sigterm(
    mock_url: str, tmp_path: Path
) -> None:
    gateway = start(mock_url, "--namespace", "solo", redis=None, directory=tmp_path)
    try:
        assert "embedded server" in gateway.banner
        assert re.search(r"listening on http://127\.0\.0\.1:\d+ ", gateway.banner)
        health = httpx.get(f"{gateway.url}/healthz", timeout=10).json()
        assert health["status"] == "ok" and health["backend"] == "embedded"
        with sync_client(gateway) as client:
            for _ in range(2):
                answer = client.completions.with_raw_response.create(
                    model="mock-instruct", prompt=f"solo {uuid.uuid4().hex}", temperature=0
                )
                assert answer.headers["x-cache"] == "MISS"
        assert gateway.terminate() == 0
        assert KEY not in gateway.stderr()
    finally:
        gateway.close()


def test_serve_needs_an_upstream() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flightcache", "serve", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 2
    assert "--upstream" in done.stderr


@pytest.mark.timeout(60)
def test_without_redis_it_fails_open_and_healthz_says_so(
    mock_url: str, private_server: EmbeddedServer, tmp_path: Path
) -> None:
    gateway = start(mock_url, "--namespace", "down", redis=private_server.url, directory=tmp_path)
    try:
        assert httpx.get(f"{gateway.url}/healthz", timeout=10).status_code == 200
        private_server.stop()
        health = httpx.get(f"{gateway.url}/healthz", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        with sync_client(gateway) as client:
            answer = client.chat.completions.with_raw_response.create(**chat("down"))
        # Fail-open: the replica still coalesces identical requests in its own process.
        assert answer.headers["x-cache"] == "MISS"
        assert len(answer.parse().choices[0].message.content.split()) == 32
        assert gateway.terminate() == 0
    finally:
        gateway.close()


# -- assembly of answers the mock does not produce -------------------------------------------


def test_tool_calls_refusals_and_logprobs_are_assembled_from_chunks() -> None:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def chunk(delta: dict[str, Any], **choice: Any) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, **choice}], "usage": None}

    def logprob(token: str) -> dict[str, Any]:
        return {"token": token, "logprob": -0.25, "bytes": None, "top_logprobs": []}

    call = {"index": 0, "id": "call_1", "type": "function"}
    chunks = [
        chunk(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{**call, "function": {"name": "get_weather", "arguments": ""}}],
            }
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "get_time", "arguments": "{}"},
                    }
                ]
            }
        ),
        chunk({"refusal": "I can"}, logprobs={"content": None, "refusal": [logprob("I")]}),
        chunk({"refusal": "not."}, logprobs={"content": None, "refusal": [logprob("not")]}),
        chunk({}, finish_reason="tool_calls"),
        {
            **base,
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
        },
    ]
    frozen = repr(chunks)
    answer = openai.types.chat.ChatCompletion.model_validate(assemble("chat", chunks))
    assert repr(chunks) == frozen  # the shared chunks are not touched
    [choice] = answer.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("call_1", "get_weather", '{"city": "Paris"}'),
        ("call_2", "get_time", "{}"),
    ]
    assert choice.message.refusal == "I cannot."
    assert [t.token for t in choice.logprobs.refusal] == ["I", "not"]
    assert answer.usage.total_tokens == 8
    assert for_client(chunks[-1], include_usage=False, hit=False) is None
    assert "usage" not in for_client(chunks[0], include_usage=False, hit=False)
    assert for_client(chunks[-1], include_usage=True, hit=True)["usage"]["cached"] is True

    text = [
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": i % 2,
                    "text": word,
                    "finish_reason": "stop" if n >= 2 else None,
                    "logprobs": {
                        "tokens": [word],
                        "token_logprobs": [-0.5],
                        "top_logprobs": None,
                        "text_offset": [n],
                    },
                }
            ],
        }
        for n, (i, word) in enumerate(enumerate(["a", "x", " b", " y"]))
    ]
    completion = openai.types.Completion.model_validate(assemble("completions", text))
    assert [c.text for c in completion.choices] == ["a b", "x y"]
    assert completion.choices[0].logprobs.tokens == ["a", " b"]
