"""The gateway's upstream client (``gateway/_http.py``, ``gateway/_upstream.py``) on its own:
how a streamed body is cut into lines, what the shared session keeps between calls, and the
bounds on every wait for an upstream that misbehaves. The upstreams here are real servers
on loopback ports: an aiohttp server, or a raw TCP one that writes exactly the bytes a test
wants (or reads nothing)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("starlette")
aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from flightcache.gateway._http import env_proxy, upstream_session  # noqa: E402
from flightcache.gateway._upstream import Upstream, UpstreamError, _lines, _sse_data  # noqa: E402

# Bodies of a few short lines, each ended by any of the three line endings (or none).
_LINE = st.text(alphabet=st.sampled_from("ab: é"), max_size=4)
_END = st.sampled_from(["\n", "\r\n", "\r", ""])
_BODIES = st.lists(st.tuples(_LINE, _END), max_size=8).map(
    lambda parts: "".join(line + end for line, end in parts).encode()
)


def _expected(body: bytes) -> list[str]:
    text = body.decode().replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    return lines[:-1] if lines[-1] == "" else lines


async def _pieces(body: bytes, cuts: list[int]) -> AsyncIterator[bytes]:
    at = 0
    for cut in sorted({min(c, len(body)) for c in cuts}):
        yield body[at:cut]
        at = cut
    yield body[at:]


@settings(max_examples=300, deadline=None)
@given(body=_BODIES, cuts=st.lists(st.integers(min_value=0, max_value=64), max_size=6))
def test_a_body_cut_anywhere_gives_the_same_lines(body: bytes, cuts: list[int]) -> None:
    """Wherever the body is cut into pieces (inside a "\\r\\n", inside a character), the
    lines are those of the whole body."""

    async def lines() -> list[str]:
        return [line async for line in _lines(_pieces(body, cuts))]

    assert asyncio.run(lines()) == _expected(body)


@settings(max_examples=300, deadline=None)
@given(
    texts=st.lists(st.text(alphabet="ab é:", max_size=5), min_size=1, max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=80), max_size=8),
)
def test_each_event_is_handed_on_before_the_next_piece_is_read(
    texts: list[str], cuts: list[int]
) -> None:
    """A stream's events go to the clients as they come: the upstream's reader hands on each
    event before it asks for the piece after the one that ended it (its "\\n\\n" split across
    two pieces included), never holding it until more of the body arrives."""
    events = [b"data: " + t.encode() + b"\n\n" for t in texts]
    body = b"".join(events)
    ends = [sum(map(len, events[: i + 1])) for i in range(len(events))]
    got: list[str] = []

    async def pieces() -> AsyncIterator[bytes]:
        read = 0
        async for piece in _pieces(body, cuts):
            # asked for more: every event that ended in what was read is out already
            assert len(got) >= sum(end <= read for end in ends), (read, got)
            read += len(piece)
            yield piece

    async def run() -> None:
        async for event in _sse_data(_lines(pieces())):
            got.append(event)

    asyncio.run(run())
    assert got == texts


async def test_a_cookie_an_upstream_sets_is_not_sent_on_later_calls() -> None:
    """One session serves every client of a gateway: a cookie the upstream sets for one
    call must not ride on the next (another client's)."""
    seen: list[str | None] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.headers.get("cookie"))
        response = web.json_response({"data": []})
        response.set_cookie("session", "secret-of-the-first-caller", path="/")
        return response

    app = web.Application()
    app.router.add_post("/v1/embeddings", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        # A host name, not an address: a default cookie jar ignores cookies set by addresses.
        url = f"http://localhost:{port}"
        async with upstream_session(
            url, max_connections=4, upstream_timeout=10, connect_timeout=5
        ) as session:
            upstream = Upstream(url, session, client_error_ttl=0)
            for _ in range(2):
                assert await upstream.fetch_json("embeddings", "/v1/embeddings", {}, {}) == {
                    "data": []
                }
    finally:
        await runner.cleanup()
    assert seen == [None, None]


def test_the_environment_names_the_upstreams_proxy_unless_no_proxy_spares_its_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("http_proxy", "https_proxy", "no_proxy", "all_proxy"):
        for variant in (name, name.upper()):
            monkeypatch.delenv(variant, raising=False)
    assert env_proxy("https://127.0.0.5:8443/v1") is None
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:3128")
    assert env_proxy("https://127.0.0.5:8443/v1") == "http://127.0.0.1:3128"
    assert env_proxy("http://127.0.0.5:8000/v1") is None  # no HTTP_PROXY nor ALL_PROXY
    monkeypatch.setenv("ALL_PROXY", "127.0.0.1:3129")  # no scheme: http://
    assert env_proxy("http://127.0.0.5:8000/v1") == "http://127.0.0.1:3129"
    monkeypatch.setenv("NO_PROXY", "127.0.0.5")
    assert env_proxy("https://127.0.0.5:8443/v1") is None


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_upstream(handler: Handler, read_timeout: float = 0.5) -> AsyncIterator[Upstream]:
    """An ``Upstream`` (``read_timeout`` 0.5 s unless given) on a raw TCP server whose
    every connection ``handler`` serves."""
    connections: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        with contextlib.suppress(ConnectionError):
            await handler(reader, writer)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with upstream_session(
            url, max_connections=4, upstream_timeout=read_timeout, connect_timeout=2
        ) as session:
            yield Upstream(url, session, client_error_ttl=0, read_timeout=read_timeout)
    finally:
        for writer in connections:
            writer.close()
        server.close()


async def _request_head(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


async def test_a_malformed_chunk_fails_the_call_within_the_read_timeout() -> None:
    """aiohttp's C parser, on a bad chunk size, stops feeding the body without failing it
    (and stops its read timer): without ``body_of``'s bound this call waits forever."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_head(reader)
        event = b'data: {"choices": []}\n\n'
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        writer.write(b"transfer-encoding: chunked\r\n\r\n")
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        await asyncio.sleep(0.1)  # read apart from the first chunk
        writer.write(b"zz\r\n garbage\r\n")
        await writer.drain()
        await asyncio.sleep(30)

    async with raw_upstream(answer) as upstream:
        started = time.monotonic()
        with pytest.raises(UpstreamError) as caught:
            await asyncio.wait_for(_all_chunks(upstream), 10)
    assert caught.value.status in (502, 504)
    assert time.monotonic() - started < 5


async def _all_chunks(upstream: Upstream) -> list[dict[str, object]]:
    body = {"model": "m", "stream": True, "messages": []}
    return [c async for c in upstream.stream_chunks("chat", "/v1/chat/completions", body, {})]


async def test_an_upstream_that_reads_no_upload_fails_the_call_within_the_read_timeout() -> None:
    """aiohttp bounds no write: a request body the upstream never reads would wait forever
    without the bound on the whole request."""

    async def never_read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    big = {"input": "x" * (48 << 20)}  # more than the loopback buffers take
    async with raw_upstream(never_read) as upstream:
        started = time.monotonic()
        with pytest.raises(UpstreamError) as caught:
            await asyncio.wait_for(upstream.fetch_json("embeddings", "/v1/embeddings", big, {}), 10)
    assert caught.value.status == 504
    assert time.monotonic() - started < 5


async def test_a_passthrough_keeps_its_path_drops_expect_and_relays_header_bytes() -> None:
    """The path goes out as the caller wrote it (no dot segment undone), a caller's ``Expect:
    100-continue`` is not relayed (the upstream here never sends 100, so the call would wait
    for it), and the answer's header bytes come back as they were, not UTF-8 or not."""
    seen: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await _request_head(reader)
        seen.append(head)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n")
        writer.write(b'content-disposition: attachment; filename="caf\xe9.jsonl"\r\n\r\nok')
        await writer.drain()

    async with raw_upstream(answer) as upstream:
        response = await asyncio.wait_for(
            upstream.proxy(
                "POST",
                "/v1/files/%2E%2E/%2e%2e/admin",
                "filter[s]=1",
                [("expect", "100-continue"), ("content-type", "text/plain")],
                b"body",
            ),
            5,
        )
        body = b"".join([bytes(c) async for c in response.body_iterator])  # type: ignore[attr-defined]
    assert body == b"ok" and response.status_code == 200
    request_line, *header_lines = seen[0].split(b"\r\n")
    assert request_line == b"POST /v1/files/%2E%2E/%2e%2e/admin?filter[s]=1 HTTP/1.1"
    assert not any(line.lower().startswith(b"expect:") for line in header_lines)
    assert (b"content-disposition", b'attachment; filename="caf\xe9.jsonl"') in response.raw_headers


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await _request_head(reader)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head + await reader.readexactly(length)


def _json_answer(writer: asyncio.StreamWriter, body: bytes = b'{"ok": 1}') -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
    writer.write(b"content-length: %d\r\n\r\n%s" % (len(body), body))


def _embeddings(upstream: Upstream) -> Awaitable[object]:
    return asyncio.wait_for(upstream.fetch_json("embeddings", "/v1/embeddings", {}, {}), 10)


async def test_a_post_whose_kept_alive_connection_was_closed_under_it_is_sent_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The upstream answers the first request of a connection and drops the connection at
    the second, as a server that ends idle connections does when a request crosses its
    close: the call that met the closed connection is sent again on a new one and succeeds
    (aiohttp itself retries only idempotent methods). Without the retry it is a 502."""
    requests: list[int] = []  # the connection's number, per request read

    async def first_only(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = len({*requests}) + 1
        await _read_request(reader)
        requests.append(number)
        _json_answer(writer)
        await writer.drain()
        await _read_request(reader)
        requests.append(number)
        writer.close()  # no answer, not a byte: the connection ends under the request

    caplog.set_level("INFO", logger="flightcache.gateway")
    async with raw_upstream(first_only, read_timeout=5) as upstream:
        assert await _embeddings(upstream) == {"ok": 1}
        assert await _embeddings(upstream) == {"ok": 1}  # met the close, then a new one
    assert requests == [1, 1, 2]
    assert "sending it again" in caplog.text  # an operator sees it happen


async def test_a_new_connection_cut_before_its_answer_is_not_sent_again() -> None:
    """A connection opened for the call and cut before any answer may mean the upstream
    took the request and then failed: it is a 502, and the request went out once."""
    requests = 0

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        await _read_request(reader)
        requests += 1
        writer.close()

    async with raw_upstream(cut, read_timeout=5) as upstream:
        with pytest.raises(UpstreamError) as caught:
            await _embeddings(upstream)
    assert caught.value.status == 502
    assert requests == 1


async def test_sending_again_after_closed_kept_alive_connections_is_bounded() -> None:
    """Four kept-alive connections, each dropped by the upstream at its next request: a call
    that meets one closed connection after another gives up after ``STALE_RETRIES`` more
    sends with a 502, rather than trying every pooled connection or forever."""
    from flightcache.gateway._http import STALE_RETRIES

    served = 0
    dropped = 0
    all_four = asyncio.Event()

    async def first_only(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served, dropped
        await _read_request(reader)
        served += 1
        if served == 4:
            all_four.set()
        await all_four.wait()  # the four first calls are answered together: four connections
        _json_answer(writer)
        await writer.drain()
        await _read_request(reader)
        dropped += 1
        writer.close()

    async with raw_upstream(first_only, read_timeout=5) as upstream:
        assert await asyncio.gather(*(_embeddings(upstream) for _ in range(4))) == [{"ok": 1}] * 4
        with pytest.raises(UpstreamError) as caught:
            await _embeddings(upstream)
    assert caught.value.status == 502
    assert dropped == 1 + STALE_RETRIES
