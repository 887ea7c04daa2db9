"""The HTTP client the gateway calls its upstream with: one ``aiohttp.ClientSession``.

aiohttp reads a response through an asyncio protocol and a C parser. Measured on the
mock's streams of 32 events (``/tmp`` probe, 1,000 streams, 100 at a time, uvloop): 0.43
ms of CPU a stream, against 1.45 ms through httpx2 (its httpcore2, h11 and anyio layers
cost tens of microseconds a read). The official ``openai`` SDK offers aiohttp as its
transport for the same reason (``openai[aiohttp]``).

What the session does, and why:

- ``limit``: at most ``max_connections`` upstream connections; a call waits for a free one
  (``connect``, bounded by ``upstream_timeout``). Idle connections are kept alive.
- ``sock_connect``: ``connect_timeout`` to open a connection; ``sock_read``:
  ``upstream_timeout`` without a byte from the upstream, the headers' wait included. aiohttp
  bounds no write, so ``_upstream.py`` also bounds each request, until its headers come
  back, by ``upstream_timeout`` (``bounded``), and each read of a body (``body_of``).
- No cookie jar: cookies an upstream sets would otherwise ride on every later client's call.
- No decompression: answers are asked for uncompressed, and a passthrough relays its bytes
  as they come, with their ``content-encoding``.
- A request that finds its kept-alive connection closed under it (the upstream ended the
  idle connection as the request went out: no answer, not a byte) is sent again on another
  connection, at most ``STALE_RETRIES`` times (``send``). aiohttp does that for idempotent
  methods only, and every completion is a POST; an upstream that closes idle connections
  (uvicorn after 5 s, most servers after a minute) would otherwise fail a call now and then
  with a 502. Only a reused connection is retried (a trace marks it), so a new connection
  that fails, which may mean the upstream took the request and died, is never sent twice.
- ``HTTP_PROXY``/``HTTPS_PROXY``/``NO_PROXY`` are read once, for the upstream's URL (the
  session calls nothing else). aiohttp's ``trust_env`` would read them, and ``~/.netrc``,
  on every request, in a thread: about 6 % of a replica's CPU in the 1,000-stream bench
  phase; and a ``.netrc`` entry for the upstream's host would clash with the callers'
  ``Authorization``.
"""

from __future__ import annotations

import asyncio
import io
import logging
import sys
import urllib.request
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import aiohttp

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # aiohttp depends on async-timeout there, whose timeout() has the same API
    from async_timeout import timeout as _timeout

__all__ = [
    "STALE_RETRIES",
    "TRANSPORT_ERRORS",
    "body_of",
    "bounded",
    "env_proxy",
    "is_timeout",
    "payload",
    "send",
    "upstream_session",
]

LARGE_BODY = 1 << 20
# What a call that failed in transport raises (a refused or cut connection, a timeout).
TRANSPORT_ERRORS = (aiohttp.ClientError,)


log = logging.getLogger("flightcache.gateway")

STALE_RETRIES = 2  # sends again after a kept-alive connection was found closed


class _Attempt:
    """One send of a request: whether aiohttp gave it a kept-alive connection."""

    __slots__ = ("reused",)

    def __init__(self) -> None:
        self.reused = False


async def _on_reuse(session: Any, context: Any, params: Any) -> None:
    attempt = context.trace_request_ctx
    if isinstance(attempt, _Attempt):
        attempt.reused = True


def _stale(exc: BaseException, attempt: _Attempt) -> bool:
    """Whether a send failed because its kept-alive connection had been closed: nothing came
    back on a reused connection (a refused or timed-out connect is not this)."""
    closed = isinstance(exc, aiohttp.ServerDisconnectedError) or (
        isinstance(exc, aiohttp.ClientOSError) and not isinstance(exc, aiohttp.ClientConnectorError)
    )
    return closed and attempt.reused


async def send(
    session: aiohttp.ClientSession, method: str, url: Any, body: bytes, **kw: Any
) -> aiohttp.ClientResponse:
    """``session.request`` with ``body`` (none if empty), sent again (at most
    ``STALE_RETRIES`` times) when it failed on a kept-alive connection the upstream had
    closed."""
    retries = 0
    while True:
        attempt = _Attempt()
        try:
            return await session.request(
                method, url, data=payload(body) if body else None, trace_request_ctx=attempt, **kw
            )
        except aiohttp.ClientError as exc:
            if retries == STALE_RETRIES or not _stale(exc, attempt):
                raise
            retries += 1
            log.info(
                "upstream closed a kept-alive connection under a request (%s); sending it again",
                type(exc).__name__,
            )


def is_timeout(exc: BaseException) -> bool:
    """Whether a transport error is a timeout (connecting, waiting for a connection or for
    the upstream's next byte)."""
    return isinstance(exc, asyncio.TimeoutError)


def env_proxy(url: str) -> str | None:
    """The proxy the environment names for ``url`` (``HTTPS_PROXY``... unless ``NO_PROXY``
    spares its host), if any."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or not parts.hostname or urllib.request.proxy_bypass(parts.hostname):
        return None
    return proxy if "://" in proxy else f"http://{proxy}"  # "host:port" means http://


def payload(body: bytes) -> bytes | io.BytesIO:
    """A request body for aiohttp: over 1 MiB, a file object, written in pieces (aiohttp
    warns of bytes that large, whose one write may hold the loop)."""
    return io.BytesIO(body) if len(body) > LARGE_BODY else body


def bounded(seconds: float) -> Any:
    """A timeout scope (``async with``): TimeoutError once ``seconds`` have passed."""
    return _timeout(seconds)


async def body_of(response: aiohttp.ClientResponse, idle_s: float) -> AsyncIterator[bytes]:
    """A response's body as it comes; a read that waits ``idle_s`` for its next piece fails
    with ``aiohttp.ServerTimeoutError``. Not left to ``sock_read`` alone: aiohttp's C parser,
    on a malformed chunk size, stops feeding the body without failing it and stops the read
    timer with it, and the read would wait forever.

    One watchdog timer a body, not one a read (a timer a read cost about 4 % of a gateway
    replica's CPU on the mock's streams): a read notes when it started waiting; the watchdog
    wakes when the oldest wait could have run out, fails the reader if it has, and else
    sleeps until it could. Only time spent waiting counts, not the caller's between reads.
    """
    loop = asyncio.get_running_loop()
    reader = response.content
    waiting_since: float | None = None
    handle: asyncio.TimerHandle | None = None

    def watch() -> None:
        nonlocal handle
        now = loop.time()
        if waiting_since is not None and now - waiting_since >= idle_s:
            message = f"no byte from the upstream for {idle_s:g} s"
            reader.set_exception(aiohttp.ServerTimeoutError(message))
            return
        handle = loop.call_at((waiting_since or now) + idle_s, watch)

    handle = loop.call_at(loop.time() + idle_s, watch)
    try:
        while True:
            waiting_since = loop.time()
            data = await reader.readany()
            waiting_since = None
            if not data:
                return
            yield data
    finally:
        if handle is not None:
            handle.cancel()


def upstream_session(
    base_url: str, *, max_connections: int, upstream_timeout: float, connect_timeout: float
) -> aiohttp.ClientSession:
    """The session of one gateway, which calls ``base_url`` only; create it inside the
    running loop, close it on the way out (``async with``)."""
    timeout = aiohttp.ClientTimeout(
        total=None,
        connect=upstream_timeout,
        sock_connect=connect_timeout,
        sock_read=upstream_timeout,
    )
    reuse = aiohttp.TraceConfig()
    reuse.on_connection_reuseconn.append(_on_reuse)
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections, limit_per_host=0),
        trace_configs=[reuse],
        timeout=timeout,
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
        proxy=env_proxy(base_url),
        skip_auto_headers=("content-type",),  # a relayed request keeps the caller's, or none
    )
