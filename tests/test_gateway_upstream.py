"""The gateway's upstream client (``gateway/_http.py``, ``gateway/_upstream.py``) on its own:
how a streamed body is cut into lines, and what the shared session keeps between calls. The
upstream here is a real aiohttp server on a loopback port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("starlette")
aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from flightcache.gateway._http import env_proxy, upstream_session  # noqa: E402
from flightcache.gateway._upstream import Upstream, _lines  # noqa: E402

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
    assert env_proxy("http://127.0.0.5:8000/v1") is None  # no HTTP_PROXY
    monkeypatch.setenv("NO_PROXY", "127.0.0.5")
    assert env_proxy("https://127.0.0.5:8443/v1") is None
