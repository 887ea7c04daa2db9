"""``flightcache mock-upstream``, the test double of an OpenAI-compatible API, driven by the
official ``openai`` client (sync and async, stream and non-stream) over real HTTP.

The clients are made with ``max_retries=0``: the openai client retries 408, 409, 429 and 5xx
(twice by default, honouring ``retry-after``), which would hide the statuses under test.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import math
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from flightcache.gateway._mock import MockSettings, MockState, make_mock_app  # noqa: E402
from flightcache.gateway._serve_util import ServerThread  # noqa: E402

KEY = "sk-mock-test-key-0123456789"
MESSAGES = [{"role": "user", "content": "Say something about flights."}]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with ServerThread(make_mock_app()) as server:
        yield server.url


@pytest.fixture
def url(server_url: str) -> str:
    """The shared mock, reset to its initial settings and zero counters for each test."""
    httpx.post(f"{server_url}/control/reset").raise_for_status()
    return server_url


@pytest.fixture
def client(url: str) -> Iterator[Any]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=10) as c:
        yield c


@pytest.fixture
async def aclient(url: str) -> AsyncIterator[Any]:
    async with openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=10
    ) as c:
        yield c


def control(url: str, **settings: Any) -> dict[str, Any]:
    response = httpx.post(f"{url}/control", json=settings)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def stats(url: str) -> dict[str, Any]:
    result: dict[str, Any] = httpx.get(f"{url}/stats").json()
    return result


def wait_for(url: str, field: str, value: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while stats(url)[field] != value:
        assert time.monotonic() < deadline, f"/stats {field} never became {value}"
        time.sleep(0.01)


# -- shapes, through the official client --------------------------------------------------


def test_chat_non_stream(client: Any) -> None:
    r = client.chat.completions.create(model="mock-chat", messages=MESSAGES)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == "mock-chat"
    assert isinstance(r.created, int)
    [choice] = r.choices
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert len(choice.message.content.split()) == 32
    usage = r.usage
    assert usage.completion_tokens == 32
    assert usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    raw = client.chat.completions.with_raw_response.create(model="mock-chat", messages=MESSAGES)
    assert raw.headers["x-request-id"].startswith("req_")
    assert raw.parse().choices[0].message.content == choice.message.content


def test_chat_max_tokens_gives_a_prefix(client: Any) -> None:
    full = client.chat.completions.create(model="m", messages=MESSAGES).choices[0]
    for field in ("max_tokens", "max_completion_tokens"):
        short = client.chat.completions.create(model="m", messages=MESSAGES, **{field: 5})
        assert short.choices[0].finish_reason == "length"
        assert short.usage.completion_tokens == 5
        assert short.choices[0].message.content.split() == full.message.content.split()[:5]


def test_chat_stream_with_usage(client: Any) -> None:
    stream = client.chat.completions.create(
        model="m", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 32
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = client.chat.completions.create(model="m", messages=MESSAGES, n=1)
    assert text == plain.choices[0].message.content


def test_chat_stream_wire_format(url: str) -> None:
    body = {"model": "m", "messages": MESSAGES, "stream": True, "max_tokens": 3}
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert len(events[:-2]) == 1 + 3 + 1  # role, three tokens, finish_reason


def test_chat_n_choices(client: Any) -> None:
    r = client.chat.completions.create(model="m", messages=MESSAGES, n=3, max_tokens=4)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 3
    assert r.usage.completion_tokens == 12
    chunks = list(
        client.chat.completions.create(model="m", messages=MESSAGES, n=3, max_tokens=4, stream=True)
    )
    texts = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in r.choices]


async def test_async_chat(aclient: Any) -> None:
    r = await aclient.chat.completions.create(model="m", messages=MESSAGES, max_tokens=7)
    assert r.choices[0].finish_reason == "length"
    stream = await aclient.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    text = ""
    usage = None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text == r.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 7


def test_legacy_completions(client: Any) -> None:
    r = client.completions.create(model="mock-instruct", prompt=["one", "two"], n=2, max_tokens=3)
    assert r.object == "text_completion"
    assert r.id.startswith("cmpl-")
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" and len(c.text.split()) == 3 for c in r.choices)
    assert r.usage.completion_tokens == 12
    single = client.completions.create(model="mock-instruct", prompt="one", max_tokens=3)
    assert single.choices[0].text == r.choices[0].text
    chunks = list(
        client.completions.create(
            model="mock-instruct",
            prompt="one",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == single.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


async def test_async_legacy_completion_stream(aclient: Any) -> None:
    stream = await aclient.completions.create(model="m", prompt="hi", stream=True)
    text = "".join([c.choices[0].text async for c in stream])
    assert len(text.split()) == 32


def test_embeddings(client: Any, url: str) -> None:
    # the client asks for base64 unless told otherwise, and decodes it
    r = client.embeddings.create(model="mock-embedding", input=["a cat", "a dog"])
    assert r.object == "list"
    assert [d.index for d in r.data] == [0, 1]
    assert all(d.object == "embedding" and len(d.embedding) == 1536 for d in r.data)
    assert r.data[0].embedding != r.data[1].embedding
    assert math.isclose(math.fsum(v * v for v in r.data[0].embedding), 1.0, rel_tol=1e-4)
    assert r.usage.prompt_tokens == 4 and r.usage.total_tokens == 4
    floats = client.embeddings.create(
        model="mock-embedding", input="a cat", dimensions=8, encoding_format="float"
    )
    assert len(floats.data[0].embedding) == 8
    again = client.embeddings.create(model="mock-embedding", input="a cat", dimensions=8)
    assert again.data[0].embedding == pytest.approx(floats.data[0].embedding, rel=1e-6)
    raw = httpx.post(
        f"{url}/v1/embeddings",
        json={
            "model": "mock-embedding",
            "input": "a cat",
            "dimensions": 8,
            "encoding_format": "base64",
        },
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()
    decoded = struct.unpack("<8f", base64.b64decode(raw["data"][0]["embedding"]))
    assert decoded == pytest.approx(floats.data[0].embedding, rel=1e-6)


async def test_async_embeddings(aclient: Any) -> None:
    r = await aclient.embeddings.create(model="e", input=[[1, 2, 3]], dimensions=4)
    assert len(r.data[0].embedding) == 4 and r.usage.prompt_tokens == 3


def test_models(client: Any) -> None:
    ids = [m.id for m in client.models.list()]
    assert "mock-chat" in ids
    assert client.models.retrieve("mock-chat").id == "mock-chat"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


# -- determinism --------------------------------------------------------------------------


def test_text_is_a_function_of_the_request(client: Any) -> None:
    def text(**kw: Any) -> str:
        kw.setdefault("messages", MESSAGES)
        r = client.chat.completions.create(model="m", **kw)
        return str(r.choices[0].message.content)

    first = text(temperature=0.7, seed=1)
    assert text(temperature=0.7, seed=1) == first
    assert text(temperature=0.7, seed=1, user="someone") == first
    assert text(temperature=0.7, seed=2) != first
    assert text(temperature=0.2, seed=1) != first
    assert text(temperature=0.7, seed=1, messages=[{"role": "user", "content": "x"}]) != first
    assert text() != text(top_p=0.5)


# -- auth ---------------------------------------------------------------------------------


def test_401_without_a_key(url: str) -> None:
    for headers in ({}, {"Authorization": "Basic abc"}, {"Authorization": "Bearer"}):
        r = httpx.post(
            f"{url}/v1/chat/completions", json={"model": "m", "messages": MESSAGES}, headers=headers
        )
        assert r.status_code == 401
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert stats(url)["by_status"] == {"401": 4}


def test_only_configured_keys() -> None:
    with ServerThread(make_mock_app(api_keys=frozenset({"sk-good"}))) as server:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-bad", max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError) as info:
                c.models.list()
        assert info.value.status_code == 401
        assert info.value.code == "invalid_api_key"
        assert "sk-bad" not in info.value.response.text
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-good", max_retries=0) as c:
            assert c.models.list().data


# -- /stats ---------------------------------------------------------------------------------


def test_stats_count_calls_routes_and_tenants(client: Any, url: str) -> None:
    assert stats(url)["calls"] == 0
    client.chat.completions.create(model="m", messages=MESSAGES)
    list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
    client.completions.create(model="m", prompt="x")
    client.embeddings.create(model="m", input="x")
    s = stats(url)
    assert s["calls"] == 4
    assert s["by_route"] == {
        "/v1/chat/completions": 2,
        "/v1/completions": 1,
        "/v1/embeddings": 1,
    }
    assert s["by_status"] == {"200": 4}
    assert s["streams"] == 1
    assert s["in_flight"] == 0 and s["max_in_flight"] == 1
    digest = hashlib.sha256(KEY.encode()).hexdigest()[:12]
    assert s["tenants"] == {digest: 4}
    assert KEY not in httpx.get(f"{url}/stats").text
    httpx.post(f"{url}/control/reset").raise_for_status()
    assert stats(url)["calls"] == 0


async def test_stats_in_flight(url: str, aclient: Any) -> None:
    control(url, latency_ms=300)
    calls = [aclient.chat.completions.create(model="m", messages=MESSAGES) for _ in range(5)]
    await asyncio.gather(*calls)
    s = stats(url)
    assert s["calls"] == 5 and s["max_in_flight"] == 5 and s["in_flight"] == 0


def test_unknown_route_is_an_openai_404(url: str) -> None:
    r = httpx.post(f"{url}/v1/nope", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "Invalid URL (POST /v1/nope)"
    assert stats(url)["calls"] == 1


def test_bad_requests_are_400(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[])
    assert info.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="m", messages=MESSAGES, stream_options={"include_usage": True}
        )
    assert info.value.param == "stream_options"
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="m", input="")


# -- /control modes -------------------------------------------------------------------------


def test_control_validates(url: str) -> None:
    for bad in ({"mode": "explode"}, {"status": 200}, {"latency_ms": -1}, {"colour": "red"}):
        r = httpx.post(f"{url}/control", json=bad)
        assert r.status_code == 400, bad
        assert "error" in r.json()
    assert httpx.get(f"{url}/control").json()["mode"] == "normal"


@pytest.mark.parametrize(
    ("status", "exc"),
    [
        (500, "InternalServerError"),
        (503, "InternalServerError"),
        (400, "BadRequestError"),
        (404, "NotFoundError"),
    ],
)
def test_fail(client: Any, url: str, status: int, exc: str) -> None:
    control(url, mode="fail", status=status)
    with pytest.raises(getattr(openai, exc)) as info:
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.status_code == status
    assert set(info.value.body) == {"message", "type", "param", "code"}
    with pytest.raises(getattr(openai, exc)):
        list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
    assert stats(url)["by_status"] == {str(status): 2}


def test_fail_times_then_normal(client: Any, url: str) -> None:
    control(url, mode="fail", status=502, times=2)
    for _ in range(2):
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model="m", prompt="x")
    assert client.completions.create(model="m", prompt="x").choices[0].text
    assert httpx.get(f"{url}/control").json()["mode"] == "normal"


def test_rate_limit(client: Any, url: str) -> None:
    control(url, mode="rate_limit", retry_after=7)
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.status_code == 429
    assert info.value.response.headers["retry-after"] == "7"
    assert info.value.code == "rate_limit_exceeded"
    assert stats(url)["calls"] == 1


def test_rate_limit_is_retried_by_a_default_client(url: str) -> None:
    control(url, mode="rate_limit", retry_after=0.05, times=1)
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY) as c:  # default: 2 retries
        assert c.chat.completions.create(model="m", messages=MESSAGES).choices
    assert stats(url)["by_status"] == {"429": 1, "200": 1}


async def test_async_rate_limit_stream(aclient: Any, url: str) -> None:
    control(url, mode="rate_limit")
    with pytest.raises(openai.RateLimitError):
        await aclient.chat.completions.create(model="m", messages=MESSAGES, stream=True)


def test_hang_until_the_client_gives_up(url: str) -> None:
    control(url, mode="hang")
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=0.3) as c:
        with pytest.raises(openai.APITimeoutError):
            c.chat.completions.create(model="m", messages=MESSAGES)
    wait_for(url, "in_flight", 0)
    assert stats(url)["hanging"] == 0


def test_hang_is_bounded(client: Any, url: str) -> None:
    control(url, mode="hang", hang_s=0.2)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert info.value.status_code == 504


async def test_hang_released_proceeds_normally(aclient: Any, url: str) -> None:
    control(url, mode="hang", times=1)
    held = asyncio.create_task(
        aclient.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3)
    )
    async with httpx.AsyncClient() as http:
        for _ in range(500):
            if (await http.get(f"{url}/stats")).json()["hanging"] == 1:
                break
            await asyncio.sleep(0.01)
        # mode already back to normal (times=1): a second request is not held
        free = await aclient.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3)
        assert not held.done()
        (await http.post(f"{url}/control", json={"mode": "normal"})).raise_for_status()
    r = await asyncio.wait_for(held, 5)
    assert r.choices[0].message.content == free.choices[0].message.content


def test_cut_stream(client: Any, url: str) -> None:
    control(url, mode="cut", cut_after=3)
    got: list[str] = []
    with pytest.raises(openai.APIConnectionError):
        for chunk in client.chat.completions.create(model="m", messages=MESSAGES, stream=True):
            got.append(chunk.choices[0].delta.content)
    assert len(got) == 1 + 3  # the role chunk, then three tokens
    s = stats(url)
    assert s["cuts"] == 1 and s["in_flight"] == 0


def test_cut_stream_on_the_wire(url: str) -> None:
    control(url, mode="cut")  # default: half of the tokens
    body = {"model": "m", "messages": MESSAGES, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    received = b""
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            for data in r.iter_bytes():
                received += data
    assert b"[DONE]" not in received
    assert received.count(b"data: ") == 1 + 16


async def test_async_cut(aclient: Any, url: str) -> None:
    control(url, mode="cut", cut_after=2)
    stream = await aclient.completions.create(model="m", prompt="x", stream=True)
    texts = []
    with pytest.raises(openai.APIConnectionError):
        async for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert len(texts) == 2
    with pytest.raises(openai.APIConnectionError):
        await aclient.chat.completions.create(model="m", messages=MESSAGES)  # a cut body


def test_latency_and_token_rate(client: Any, url: str) -> None:
    control(url, latency_ms=150, tokens_per_s=100, text_tokens=11)
    start = time.monotonic()
    stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
    arrivals = [time.monotonic() - start for _ in stream]
    assert arrivals[0] >= 0.15
    assert arrivals[-1] >= 0.15 + 0.1  # 11 tokens at 100/s: 100 ms after the first
    start = time.monotonic()
    client.chat.completions.create(model="m", messages=MESSAGES)
    assert time.monotonic() - start >= 0.25


def test_state_object() -> None:
    state = MockState(MockSettings(text_tokens=4))
    app = make_mock_app(state=state)
    assert app.state.mock is state
    with ServerThread(app) as server:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as c:
            r = c.chat.completions.create(model="m", messages=MESSAGES)
        assert r.usage.completion_tokens == 4
        assert state.calls == 1
    with pytest.raises(ValueError, match="mode"):
        state.configure({"mode": "sideways"})


# -- the command ----------------------------------------------------------------------------


def test_cli_help_says_test_double() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "flightcache", "mock-upstream", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "TEST DOUBLE" in out and "not a model" in out


def test_cli_serves_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "flightcache", "mock-upstream", "--port", "0", "--latency-ms", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("mock-upstream listening on http://127.0.0.1:")
        assert "test double" in line
        base = line.split()[3]
        with openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0) as c:
            r = c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        assert r.usage.completion_tokens == 2
        assert httpx.get(f"{base}/stats").json()["calls"] == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        _, err = proc.communicate()
        assert KEY not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def test_cli_port_in_use() -> None:
    with ServerThread(make_mock_app()) as server:
        port = server.url.rsplit(":", 1)[1]
        done = subprocess.run(
            [sys.executable, "-m", "flightcache", "mock-upstream", "--port", port],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert done.returncode == 2
    assert "mock-upstream: error" in done.stderr


def test_an_idle_client_connection_outlives_httpxs_keep_alive(server_url: str) -> None:
    """``flightcache serve`` and the mock keep an idle connection past 5 s, what httpx (and
    so the openai SDK) keeps its own: a client never sends a request into the instant the
    server closes the connection (``_serve_util.KEEP_ALIVE_S``). With uvicorn's default
    (5 s) the second request finds the connection closed."""
    import socket

    host, port = server_url.removeprefix("http://").rsplit(":", 1)
    request = b"GET /stats HTTP/1.1\r\nhost: x\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for pause in (6, 0):
            sock.sendall(request)
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200")
            time.sleep(pause)  # idle for longer than uvicorn's default keep-alive
