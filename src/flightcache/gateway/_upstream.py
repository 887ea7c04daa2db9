"""Calls to the upstream API over one shared ``aiohttp.ClientSession`` (``_http.py``), and what
their errors mean.

- :meth:`Upstream.stream_chunks`: an answer, always streamed (``stream: true``), as the
  parsed SSE ``data`` objects (chat and text completion chunks, Responses and Messages
  events); a complete stream ends with ``[DONE]`` (completions) or its terminal event
  (``response.completed``, ``message_stop``), else :class:`UpstreamError`, as for an error
  event in the middle of it.
- :meth:`Upstream.fetch_json`: a plain JSON answer (embeddings).
- :meth:`Upstream.proxy`: anything else, relayed untouched (hop-by-hop headers dropped).

:class:`UpstreamError` carries the upstream's status, OpenAI-shaped error body and the
headers a client needs (``retry-after``...) in ``flightcache_data``, so coalesced callers in
other processes get them through :class:`flightcache.RemoteError`; its
``flightcache_error_ttl`` keeps rate limits, server errors, auth errors, timeouts and cut
streams out of the negative cache (other 4xx are kept ``client_error_ttl`` seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import aiohttp
import orjson
import yarl
from starlette.responses import Response
from starlette.types import Send

from .._errors import (
    BackendUnavailable,
    FlightTimeout,
    RemoteError,
    StreamRestarted,
    ValueTooLarge,
)
from ..integrations._answers import ended, failure
from ..integrations._chat import chunks_from_completion
from ..integrations._events import events_from_message, events_from_response
from ..integrations._rules import Route
from ._http import TRANSPORT_ERRORS, body_of, bounded, is_timeout, send
from ._response import StreamedBody

__all__ = [
    "HOP_BY_HOP",
    "Upstream",
    "UpstreamError",
    "describe_error",
    "openai_error",
]

log = logging.getLogger("flightcache.gateway")

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
    }
)
# Request headers a flight's upstream call carries (the owner's): credentials and scope.
FORWARDED = (
    *("authorization", "api-key", "x-api-key", "openai-organization", "openai-project"),
    "anthropic-version",
)
FORWARDED_PREFIXES = ("openai-beta", "anthropic-beta")
# Upstream error headers a client needs to see (retry hints, the upstream's request id).
KEPT_ERROR_HEADERS = ("retry-after", "retry-after-ms", "x-request-id")
KEPT_ERROR_PREFIXES = ("x-ratelimit-",)
MAX_ERROR_BODY = 64 * 1024
REST_S = 1.0  # how long a stream's body is read past its end marker (see _rest_of)
NEVER_CACHED = frozenset({401, 403, 408, 409, 429})
# What sending a request (or reading on, bounded) raises: a transport error or its bound.
SEND_ERRORS = (*TRANSPORT_ERRORS, asyncio.TimeoutError)

OnCall = Callable[[str, str], None]  # (route, status or failure kind)


def openai_error(
    message: str, *, status: int, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """An OpenAI-shaped error body: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = "invalid_request_error"
    if status == 429:
        kind = "requests"
    elif status >= 500:
        kind = "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class UpstreamError(Exception):
    """The upstream failed this request: its status, error body and retry headers."""

    def __init__(
        self,
        status: int,
        body: dict[str, Any],
        headers: Mapping[str, str] | None = None,
        *,
        error_ttl: float = 0.0,
    ) -> None:
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else None
        super().__init__(f"upstream status {status}: {message or 'error'}"[:500])
        self.status = status
        self.body = body
        self.headers = dict(headers or {})
        self.flightcache_data = {"status": status, "body": body, "headers": self.headers}
        self.flightcache_error_ttl = error_ttl


def describe_error(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str], str]:
    """What a client gets for an error: status, OpenAI-shaped body, headers, metric kind."""
    if isinstance(exc, UpstreamError):
        return exc.status, exc.body, exc.headers, "upstream"
    if isinstance(exc, RemoteError):
        data = exc.data
        if (
            isinstance(data, dict)
            and isinstance(data.get("status"), int)
            and isinstance(data.get("body"), dict)
        ):
            raw = data.get("headers")
            headers = {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}
            return data["status"], data["body"], headers, "upstream"
    too_large = isinstance(exc, ValueTooLarge) or (
        isinstance(exc, RemoteError) and exc.type_name == "ValueTooLarge"
    )
    if too_large:
        message = "flightcache gateway: the answer is larger than the cache's value limit"
        return 502, openai_error(message, status=502, code="too_large"), {}, "internal"
    if isinstance(exc, RemoteError):
        message = f"flightcache gateway: the flight failed in another gateway ({exc.type_name})"
        return 502, openai_error(message, status=502), {}, "internal"
    if isinstance(exc, StreamRestarted):
        message = (
            "flightcache gateway: the gateway that was streaming this answer stopped and a new "
            "upstream call started it again; retry the request"
        )
        return 503, openai_error(message, status=503, code="stream_restarted"), {}, "restarted"
    if isinstance(exc, FlightTimeout):
        message = "flightcache gateway: no answer within the gateway's timeout"
        return 504, openai_error(message, status=504, code="timeout"), {}, "timeout"
    if isinstance(exc, BackendUnavailable):
        message = "flightcache gateway: the cache server is unavailable"
        return 503, openai_error(message, status=503, code="backend_unavailable"), {}, "backend"
    message = f"flightcache gateway: internal error ({type(exc).__name__})"
    return 500, openai_error(message, status=500), {}, "internal"


def _kept_error_headers(headers: Mapping[str, str]) -> dict[str, str]:
    kept = {}
    for name, value in headers.items():
        name = name.lower()
        if name in KEPT_ERROR_HEADERS or name.startswith(KEPT_ERROR_PREFIXES):
            kept[name] = value
    return kept


def _without_hop_by_hop(items: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Header pairs minus hop-by-hop ones, including those the Connection header names."""
    pairs = [(k.lower(), v) for k, v in items]
    named = {token.strip().lower() for k, v in pairs if k == "connection" for token in v.split(",")}
    return [(k, v) for k, v in pairs if k not in HOP_BY_HOP and k not in named]


class _Relay(StreamedBody):
    """A relayed body: if the upstream breaks off, the client's response is left incomplete
    (the connection is closed) instead of looking finished."""

    async def stream_response(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        try:
            async for chunk in self.body_iterator:
                data = chunk.encode() if isinstance(chunk, str) else bytes(chunk)
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except TRANSPORT_ERRORS as exc:
            log.warning("passthrough: the upstream broke off its answer (%s)", type(exc).__name__)
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class Upstream:
    """The upstream API at ``base_url``; request paths (``/v1/...``) are appended to it."""

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession,
        *,
        client_error_ttl: float,
        read_timeout: float = 300.0,
        on_call: OnCall | None = None,
    ) -> None:
        base = base_url.rstrip("/")
        if base.endswith("/v1"):
            base = base[: -len("/v1")]  # "https://api.openai.com/v1" works as well
        self.base = base
        self.session = session
        self.client_error_ttl = client_error_ttl
        self.read_timeout = read_timeout  # for the headers (upload included), then a byte
        self._on_call = on_call or (lambda route, status: None)

    def url(self, path: str) -> str:
        return self.base + path

    @staticmethod
    def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
        """The caller's headers a flight's upstream call carries."""
        out = {name: headers[name] for name in FORWARDED if name in headers}
        for name, value in headers.items():
            if name.lower().startswith(FORWARDED_PREFIXES):
                out[name.lower()] = value
        return out

    def error_ttl(self, status: int) -> float:
        return 0.0 if status in NEVER_CACHED or status >= 500 else self.client_error_ttl

    def _failure(self, route: str, exc: Exception, started: bool) -> UpstreamError:
        """The error for a request that failed in transport (no status, or a cut body)."""
        what = "the upstream's answer was cut off" if started else "the upstream is unreachable"
        if is_timeout(exc):
            status, kind = 504, "timeout"
            what = "the upstream timed out" + (" mid-answer" if started else "")
        else:
            status, kind = 502, "cut" if started else "connect_error"
        if not started:
            self._on_call(route, kind)
        message = f"flightcache gateway: {what} ({type(exc).__name__})"
        return UpstreamError(status, openai_error(message, status=status, code=kind))

    async def _error_from(self, response: aiohttp.ClientResponse) -> UpstreamError:
        raw = b""
        async for data in body_of(response, self.read_timeout):
            raw += data
            if len(raw) > MAX_ERROR_BODY:
                break
        status = response.status
        body: Any = None
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
        if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
            text = raw[:500].decode("utf-8", "replace").strip()
            message = f"upstream returned HTTP {status}" + (f": {text}" if text else "")
            body = openai_error(message, status=status)
        headers = _kept_error_headers(response.headers)
        return UpstreamError(status, body, headers, error_ttl=self.error_ttl(status))

    async def _send(
        self, method: str, url: str | yarl.URL, headers: Any, body: bytes
    ) -> aiohttp.ClientResponse:
        """One request, until its headers come back, within ``read_timeout`` (aiohttp bounds
        no write); one of ``SEND_ERRORS`` if it fails. Sent again if a kept-alive connection
        turned out closed under it (``_http.send``), within the same bound."""
        async with bounded(self.read_timeout):
            return await send(
                self.session, method, url, body, headers=headers, allow_redirects=False
            )

    @contextlib.asynccontextmanager
    async def _post(
        self, route: str, path: str, body: Any, headers: Mapping[str, str]
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """One JSON POST to the upstream, counted by ``on_call``: its 200 response, streamed
        and closed on the way out, or UpstreamError (a transport error while the caller
        reads the body becomes one too)."""
        sent = {**headers, "content-type": "application/json", "accept-encoding": "identity"}
        try:
            response = await self._send("POST", self.url(path), sent, orjson.dumps(body))
        except SEND_ERRORS as exc:
            raise self._failure(route, exc, started=False) from exc
        try:
            self._on_call(route, str(response.status))
            if response.status != 200:
                raise await self._error_from(response)
            yield response
        except TRANSPORT_ERRORS as exc:
            raise self._failure(route, exc, started=True) from exc
        finally:
            response.release()  # back to the pool if its body was read to the end

    async def stream_chunks(
        self, route: Route, path: str, body: dict[str, Any], headers: Mapping[str, str]
    ) -> AsyncIterator[dict[str, Any]]:
        """The events of one streamed answer, complete, or UpstreamError."""
        sse = {**headers, "accept": "text/event-stream"}
        async with self._post(route, path, body, sse) as response:
            try:
                if "text/event-stream" not in response.headers.get("content-type", ""):
                    # An upstream that ignores stream: true; its whole answer becomes the chunks.
                    answer = orjson.loads(await self._read(response))
                    for chunk in _events_of(route, answer):
                        yield chunk
                    return
                done = False
                lines = _lines(body_of(response, self.read_timeout))
                async for data in _sse_data(lines):
                    if data.strip() == "[DONE]":
                        done = done or route in ("chat", "completions")
                        await _rest_of(lines)
                        break
                    chunk = self._chunk(route, data)
                    done = done or ended(route, chunk)
                    yield chunk
                if not done:
                    message = "flightcache gateway: the upstream's stream ended before its end"
                    raise UpstreamError(502, openai_error(message, status=502, code="cut"))
            except ValueError as exc:  # orjson.JSONDecodeError, or not an answer at all
                message = "flightcache gateway: the upstream sent an answer of the wrong shape"
                raise UpstreamError(502, openai_error(message, status=502)) from exc

    def _chunk(self, route: Route, data: str) -> dict[str, Any]:
        chunk = orjson.loads(data)
        if not isinstance(chunk, dict):
            message = "flightcache gateway: the upstream sent a stream event that is not an object"
            raise UpstreamError(502, openai_error(message, status=502))
        failed = failure(route, chunk)
        if failed is not None:  # an error event in the middle of the stream: never stored
            raise UpstreamError(*failed)
        chunk.pop("obfuscation", None)  # random padding, different in every run
        return chunk

    async def _read(self, response: aiohttp.ClientResponse) -> bytes:
        return b"".join([data async for data in body_of(response, self.read_timeout)])

    async def fetch_json(
        self, route: str, path: str, body: dict[str, Any], headers: Mapping[str, str]
    ) -> Any:
        """A non-streamed JSON answer (embeddings), or UpstreamError."""
        async with self._post(route, path, body, {**headers, "accept": "application/json"}) as r:
            try:
                return orjson.loads(await self._read(r))
            except orjson.JSONDecodeError as exc:
                message = "flightcache gateway: the upstream sent an answer that is not JSON"
                raise UpstreamError(502, openai_error(message, status=502)) from exc

    async def proxy(
        self,
        method: str,
        path: str,
        query: str,
        headers: Iterable[tuple[str, str]],
        body: bytes,
        *,
        route: str = "other",
        extra_headers: Mapping[str, str] | None = None,
    ) -> Response:
        """Relay one request untouched and stream the answer back."""
        pairs = _without_hop_by_hop(headers)
        # The body is read whole already; "expect: 100-continue" would wait on the upstream.
        sent = [(k, v) for k, v in pairs if k not in ("content-length", "expect")]
        if not any(k == "accept-encoding" for k, _ in sent):
            sent.append(("accept-encoding", "identity"))  # not aiohttp's default: relay as is
        # As the caller wrote it: yarl would decode "%2E" and then drop the dot segments.
        url = yarl.URL(self.url(path) + (f"?{query}" if query else ""), encoded=True)
        try:
            response = await self._send(method, url, sent, body)
        except SEND_ERRORS as exc:
            error = self._failure(route, exc, started=False)
            return Response(orjson.dumps(error.body), error.status, media_type="application/json")
        self._on_call(route, str(response.status))

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for data in body_of(response, self.read_timeout):
                    yield data
            finally:
                response.release()

        extra = [(k.lower(), v) for k, v in (extra_headers or {}).items()]
        replaced = {k for k, _ in extra}
        # The upstream's header bytes as they came (latin-1 maps every byte to a character).
        raw = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in response.raw_headers]
        back = [p for p in _without_hop_by_hop(raw) if p[0] not in replaced]
        relayed = _Relay(relay(), status_code=response.status)
        relayed.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in back + extra]
        return relayed


def _events_of(route: Route, answer: Any) -> list[dict[str, Any]]:
    """The stream events a non-stream answer stands for; ValueError if it is none."""
    if route == "responses":
        return events_from_response(answer)
    if route == "messages":
        return events_from_message(answer)
    return chunks_from_completion(answer)


async def _rest_of(lines: AsyncIterator[str]) -> None:
    """Read the body past its last event, for at most ``REST_S``: a connection whose body
    was read to its end goes back to the pool; one closed early is dropped, and the next
    call pays a new connection (and TLS handshake) to the upstream."""

    async def read_all() -> None:
        async for _ in lines:
            pass

    with contextlib.suppress(*SEND_ERRORS):
        async with bounded(REST_S):  # in the caller's task: no extra task per stream
            await read_all()


async def _lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of a body (ended by ``\\n``, ``\\r\\n`` or ``\\r``, without their ending), as
    text; a last line without its ending too. A piece without a line ending is only kept
    (a long line costs its length, not its length times its pieces)."""
    pending = bytearray()
    async for data in chunks:
        pending += data
        if b"\n" not in data and b"\r" not in data:
            continue
        # A "\r" at the end may be the first half of "\r\n": kept for the next piece.
        cut = len(pending) - 1 if pending.endswith(b"\r") else len(pending)
        *lines, rest = _split(bytes(pending[:cut]))
        pending = bytearray(rest) + pending[cut:]
        for line in lines:
            yield line.decode("utf-8", "replace")
    *lines, rest = _split(bytes(pending))
    for line in [*lines, rest] if rest else lines:
        yield line.decode("utf-8", "replace")


def _split(raw: bytes) -> list[bytes]:
    """``raw`` cut at every line ending; the last piece is what follows the last ending."""
    return raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")


async def _sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event (multi-line data joined by newlines)."""
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue  # a comment (keep-alive)
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data == ["[DONE]"]:  # the end marker without its blank line
        yield "[DONE]"
    # Any other event without its blank line was cut off inside it: dropped.
