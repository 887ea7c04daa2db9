"""``flightcache mock-upstream``: a test double of an OpenAI-compatible API, not a model.

It answers ``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings`` (stream
and non-stream, ``stream_options.include_usage``), ``POST /v1/responses`` (the Responses API)
and ``POST /v1/messages`` (Anthropic's Messages API; ``_mock_apis`` has their answers and
events) and ``GET /v1/models`` in the shapes of the official APIs, with text that is a pure
function of the request: the same request always gets the same words, whatever ``stream``,
``stream_options`` or ``max_tokens`` say (a shorter ``max_tokens`` gives a prefix,
``finish_reason: "length"``). Every choice has ``text_tokens``
tokens (words) unless ``max_tokens`` / ``max_completion_tokens`` is smaller. The first token
comes ``latency_ms`` after the request, then ``tokens_per_s`` tokens a second (``None``: no
pacing); a non-stream answer comes when its last token would have.

Like the real API it wants ``Authorization: Bearer <key>`` (401 without; ``/v1/messages``
takes ``x-api-key`` too, and answers errors in the Anthropic shape), and it never logs
or returns the key: ``/stats`` counts callers by a digest of it.

Not under ``/v1``, for the tests that drive it:

- ``GET /stats``: ``{"calls": N, "by_route": {...}, "by_status": {...}, "in_flight": k,
  "max_in_flight": m, "streams": s, "cuts": c, "hanging": h, "tenants": {digest: n},
  "settings": {...}}``; ``calls`` counts every request received under ``/v1``; a tenant is
  the first 12 hex digits of the SHA-256 of its bearer key.
- ``POST /control`` with any of ``mode``, ``status``, ``latency_ms``, ``tokens_per_s``,
  ``text_tokens``, ``retry_after``, ``times``, ``cut_after``, ``hang_s``; answers the
  settings. Modes, applied to the ``/v1`` model routes after auth and validation:

  - ``normal``;
  - ``fail``: after ``latency_ms``, status ``status`` (default 500) with an OpenAI error body
    ``{"error": {"message", "type", "param", "code"}}``;
  - ``rate_limit``: after ``latency_ms``, 429 with that body and ``retry-after``;
  - ``hang``: no answer until released (``/control`` leaving ``hang``, or
    ``/control/reset``: the request then proceeds normally), the client goes away, or
    ``hang_s`` (default 300) passes (then 504); only a ``/control`` that names a ``mode``
    releases them, so ``{"mode": "hang", "times": 1}`` holds one request until then;
  - ``cut``: the answer stops after ``cut_after`` content chunks (default: half of them; a
    non-stream body after half its bytes) and the connection is closed, without ``[DONE]``.

  ``times: N`` applies the mode to the next N requests only, then returns to ``normal``.
- ``GET /control``: the settings. ``POST /control/reset``: initial settings, counters zeroed,
  hanging requests released.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import math
import re
import struct
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal, TypeVar, cast

import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._mock_apis import Generation, MockBadRequest, count_words, digest, generation
from ._mock_apis import tokens as make_tokens
from ._wire import anthropic_error, error_response

__all__ = ["MODES", "MockSettings", "MockState", "error_response", "make_mock_app", "mock_state"]

Mode = Literal["normal", "fail", "hang", "rate_limit", "cut"]
MODES: tuple[Mode, ...] = ("normal", "fail", "hang", "rate_limit", "cut")

BANNER = "mock-upstream listening on {url} (a test double of an OpenAI-compatible API, not a model)"
DEFAULT_MODELS = ("mock-chat", "mock-instruct", "mock-embedding")
FINGERPRINT = "fp_flightcache_mock"

_NOT_IN_TEXT_SEED = frozenset(
    {"stream", "stream_options", "max_tokens", "max_completion_tokens", "n", "user", "metadata"}
    | {"store", "service_tier", "prompt"}
)
_BEARER = re.compile(r"bearer[ \t]+(\S+)[ \t]*", re.IGNORECASE)
_Ask = TypeVar("_Ask")  # what a route makes of a request's body


@dataclass(frozen=True)
class MockSettings:
    """What the mock does now; changed at run time by ``POST /control``."""

    mode: Mode = "normal"
    status: int = 500
    latency_ms: float = 0.0
    tokens_per_s: float | None = None
    text_tokens: int = 32
    retry_after: float = 1.0
    times: int | None = None
    cut_after: int | None = None
    hang_s: float = 300.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        for name in ("status", "text_tokens", "times", "cut_after"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer")
        if not 400 <= self.status <= 599:
            raise ValueError("status must be between 400 and 599")
        if self.text_tokens < 1 or (self.times is not None and self.times < 1):
            raise ValueError("text_tokens and times must be at least 1")
        if self.cut_after is not None and self.cut_after < 0:
            raise ValueError("cut_after must be at least 0")
        for name in ("latency_ms", "tokens_per_s", "retry_after", "hang_s"):
            value = getattr(self, name)
            if value is None and name == "tokens_per_s":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number")
            if not math.isfinite(value) or value < 0 or (name == "tokens_per_s" and value == 0):
                raise ValueError(f"{name} must be a finite number >= 0 (tokens_per_s > 0)")


class MockState:
    """The mock's settings and counters; one per app (``make_mock_app(state=...)``).

    Use it from the app's event loop only (or through ``/stats`` and ``/control``).
    """

    def __init__(self, settings: MockSettings | None = None) -> None:
        self.initial = settings or MockSettings()
        self.settings = self.initial
        self.in_flight = 0
        self.hanging = 0
        self._release = asyncio.Event()
        self._zero()

    def _zero(self) -> None:
        self.calls = 0
        self.max_in_flight = self.in_flight
        self.streams = 0
        self.cuts = 0
        self.by_route: Counter[str] = Counter()
        self.by_status: Counter[str] = Counter()
        self.tenants: Counter[str] = Counter()

    def snapshot(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "by_route": dict(self.by_route),
            "by_status": dict(self.by_status),
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "streams": self.streams,
            "cuts": self.cuts,
            "hanging": self.hanging,
            "tenants": dict(self.tenants),
            "settings": asdict(self.settings),
        }

    def configure(self, changes: Mapping[str, Any]) -> MockSettings:
        """Apply ``changes`` (field names of :class:`MockSettings`); ValueError if invalid."""
        known = {f.name for f in fields(MockSettings)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown setting(s): {', '.join(unknown)}")
        settings = replace(self.settings, **changes)
        if settings.mode == "normal":
            settings = replace(settings, times=None)
        self.settings = settings
        if "mode" in changes and settings.mode != "hang":
            self.release()
        return settings

    def reset(self) -> None:
        """Initial settings, counters zeroed, hanging requests released."""
        self.settings = self.initial
        self._zero()
        self.release()

    def release(self) -> None:
        """Let every hanging request proceed normally."""
        self._release.set()
        self._release = asyncio.Event()

    def take_mode(self) -> Mode:
        """The mode for one request, counting down ``times``."""
        settings = self.settings
        if settings.times is not None:
            left = settings.times - 1
            if left:
                self.settings = replace(settings, times=left)
            else:
                self.settings = replace(settings, mode="normal", times=None)
        return settings.mode


# -- helpers --------------------------------------------------------------------------------


def _json(data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status, headers, media_type="application/json")


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _Cut(Exception):
    """Raised by a body iterator to end the response without completing it."""


class _CuttableStream(StreamingResponse):
    """A streamed response whose iterator may raise :class:`_Cut`: the response is then left
    incomplete and the server closes the connection (uvicorn logs "ASGI callable returned
    without completing response")."""

    async def stream_response(self, send: Send) -> None:
        headers = self.raw_headers
        await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
        try:
            async for chunk in self.body_iterator:
                data = chunk.encode() if isinstance(chunk, str) else bytes(chunk)
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except _Cut:
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def _int_param(body: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _BadRequest(f"'{name}' must be an integer from {low} to {high}", name)
    return value


def _check_common(body: Mapping[str, Any]) -> None:
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise _BadRequest("you must provide a model parameter", "model")
    if not isinstance(body.get("stream", False), bool | None):
        raise _BadRequest("'stream' must be a boolean", "stream")
    if body.get("stream_options") is not None:
        if not body.get("stream"):
            raise _BadRequest(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                "stream_options",
            )
        if not isinstance(body["stream_options"], dict):
            raise _BadRequest("'stream_options' must be an object", "stream_options")
    temperature = body.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not 0 <= temperature <= 2
    ):
        raise _BadRequest("'temperature' must be a number from 0 to 2", "temperature")


@dataclass
class _Plan:
    """One text generation: the words of each choice and how they are delivered."""

    kind: Literal["chat", "text"]
    model: str
    choices: list[tuple[list[str], str]]  # (tokens, finish_reason)
    prompt_tokens: int
    stream: bool
    include_usage: bool
    id: str
    created: int

    def base(self) -> dict[str, Any]:
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        if self.kind == "chat" and self.stream:
            obj = "chat.completion.chunk"
        base: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created}
        base |= {"model": self.model, "system_fingerprint": FINGERPRINT}
        if self.stream and self.include_usage:
            base["usage"] = None
        return base

    def usage(self) -> dict[str, Any]:
        return _usage(self.prompt_tokens, sum(len(tokens) for tokens, _ in self.choices))

    def body(self) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for index, (tokens, finish) in enumerate(self.choices):
            text = "".join(tokens)
            choice: dict[str, Any] = {"index": index}
            if self.kind == "chat":
                choice["message"] = {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": [],
                }
            else:
                choice["text"] = text
            choice |= {"logprobs": None, "finish_reason": finish}
            choices.append(choice)
        return {**self.base(), "choices": choices, "usage": self.usage()}

    def chunk(self, index: int, content: str | None, finish: str | None = None) -> bytes:
        choice: dict[str, Any] = {"index": index}
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if content == "":
                delta = {"role": "assistant", "content": "", "refusal": None}
            elif content is not None:
                delta = {"content": content}
            choice["delta"] = delta
        else:
            choice["text"] = content or ""
        choice |= {"logprobs": None, "finish_reason": finish}
        return _sse({**self.base(), "choices": [choice]})


def _sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def _named(event: dict[str, Any]) -> bytes:
    """A server-sent event named after its ``type`` (the Responses and Messages APIs)."""
    return b"event: " + str(event["type"]).encode() + b"\n" + _sse(event)


async def _until(moment: float) -> None:
    """Sleep until ``moment`` on ``time.monotonic()``."""
    delay = moment - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


def _inputs(value: Any, name: str) -> list[Any]:
    """A prompt or embedding input as a list of inputs (a string or one token array is one)."""
    if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
        return [value]
    if isinstance(value, list) and value:
        return value
    raise _BadRequest(f"'{name}' must be a string, an array of strings or tokens", name)


def _input_tokens(inputs: list[Any]) -> int:
    return sum(len(i) if isinstance(i, list) else count_words(i) for i in inputs)


def _plan(kind: Literal["chat", "text"], body: dict[str, Any], text_tokens: int) -> _Plan:
    _check_common(body)
    n = _int_param(body, "n", 1, 128) or 1
    limit = _int_param(body, "max_completion_tokens", 1, 1 << 20)
    limit = _int_param(body, "max_tokens", 1, 1 << 20) if limit is None else limit
    seed_fields = {k: v for k, v in body.items() if k not in _NOT_IN_TEXT_SEED}
    prompts: list[Any]
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _BadRequest("'messages' must be a non-empty array", "messages")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise _BadRequest("each message must be an object with a 'role'", "messages")
        prompts = [None]
        prompt_tokens = 3 + sum(3 + count_words(m) for m in messages)
    else:
        prompts = _inputs(body.get("prompt", ""), "prompt")
        prompt_tokens = _input_tokens(prompts)
    choices: list[tuple[list[str], str]] = []
    for prompt in prompts:
        seed = digest({**seed_fields, "prompt": prompt})
        for j in range(n):
            count = text_tokens if limit is None else min(limit, text_tokens)
            finish = "length" if count < text_tokens else "stop"
            choices.append((make_tokens(seed + j.to_bytes(4, "big"), count), finish))
    stream = bool(body.get("stream"))
    options = body.get("stream_options") or {}
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    return _Plan(
        kind=kind,
        model=body["model"],
        choices=choices,
        prompt_tokens=prompt_tokens,
        stream=stream,
        include_usage=stream and bool(options.get("include_usage")),
        id=prefix + uuid.uuid4().hex,
        created=int(time.time()),
    )


@dataclass(frozen=True)
class _EmbeddingsAsk:
    model: str
    inputs: list[Any]
    dimensions: int
    encoding: str  # "float" or "base64"


def _embeddings_ask(body: dict[str, Any], default_dimensions: int) -> _EmbeddingsAsk:
    _check_common(body)
    dimensions = _int_param(body, "dimensions", 1, 8192) or default_dimensions
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise _BadRequest("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    inputs = _inputs(body.get("input"), "input")
    if any(item in ("", []) for item in inputs):
        raise _BadRequest("'input' cannot contain an empty string", "input")
    return _EmbeddingsAsk(body["model"], inputs, dimensions, encoding)


def _embedding(text: Any, dimensions: int, model: str) -> list[float]:
    seed = digest({"model": model, "input": text})
    values: list[float] = []
    block = 0
    while len(values) < dimensions:
        raw = hashlib.blake2b(seed + block.to_bytes(4, "big"), digest_size=64).digest()
        values.extend(v / 2**31 - 1.0 for v in struct.unpack("<16I", raw))
        block += 1
    del values[dimensions:]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


# -- the app --------------------------------------------------------------------------------


class _Accounting:
    """Counts every ``/v1`` request: calls, route, status, in flight, tenant digest."""

    def __init__(self, app: ASGIApp, state: MockState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        state = self.state
        state.calls += 1
        state.by_route[path] += 1
        headers = dict(scope["headers"])
        match = _BEARER.fullmatch(headers.get(b"authorization", b"").decode("latin-1"))
        key = match[1] if match else headers.get(b"x-api-key", b"").decode("latin-1").strip()
        if key:
            state.tenants[hashlib.sha256(key.encode()).hexdigest()[:12]] += 1
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        status = 0

        async def send_counting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            state.in_flight -= 1
            state.by_status[str(status) if status else "none"] += 1


def make_mock_app(
    *,
    latency_ms: float = 0.0,
    tokens_per_s: float | None = None,
    text_tokens: int = 32,
    embedding_dimensions: int = 1536,
    models: tuple[str, ...] = DEFAULT_MODELS,
    api_keys: frozenset[str] | None = None,
    state: MockState | None = None,
) -> Starlette:
    """The mock upstream as a Starlette app; its :class:`MockState` is ``app.state.mock``.

    ``api_keys``: if given, only these keys are accepted (else any non-empty bearer key).
    ``state``: a state to use (its settings win over the keyword arguments).
    """
    if state is None:
        settings = MockSettings(
            latency_ms=latency_ms, tokens_per_s=tokens_per_s, text_tokens=text_tokens
        )
        state = MockState(settings)
    mock = state

    def unauthorized(request: Request) -> Response | None:
        match = _BEARER.fullmatch(request.headers.get("authorization", ""))
        if match is None and request.url.path == "/v1/messages":
            key = request.headers.get("x-api-key", "")
            match = re.fullmatch(r"(\S+)", key)
        if match is None:
            return error_response(
                401,
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            )
        if api_keys is not None and match[1] not in api_keys:
            return error_response(401, "Incorrect API key provided.", code="invalid_api_key")
        return None

    async def read_body(request: Request) -> dict[str, Any]:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            raise _BadRequest("We could not parse the JSON body of your request.") from None
        if not isinstance(body, dict):
            raise _BadRequest("The request body must be a JSON object.")
        return body

    async def hang(request: Request, hang_s: float) -> bool:
        """Wait until released (True), or the client left or ``hang_s`` passed (False)."""

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        mock.hanging += 1
        waiters = [
            asyncio.ensure_future(mock._release.wait()),
            asyncio.ensure_future(disconnected()),
        ]
        try:
            await asyncio.wait(waiters, timeout=hang_s, return_when=asyncio.FIRST_COMPLETED)
            return waiters[0].done()
        finally:
            mock.hanging -= 1
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)

    async def gate(request: Request, started: float) -> tuple[Mode, MockSettings, float] | Response:
        """The mode for this request, its settings and the moment its latency counts from;
        an error response for fail, rate_limit and a hang that was not released."""
        mode = mock.take_mode()
        if mode == "hang":
            if not await hang(request, mock.settings.hang_s):
                message = f"mock-upstream: no answer after hanging {mock.settings.hang_s:g} s"
                return error_response(504, message, code="timeout")
            mode, started = "normal", time.monotonic()
        settings = mock.settings
        if mode in ("fail", "rate_limit"):
            await asyncio.sleep(settings.latency_ms / 1000)
        if mode == "fail":
            message = f"mock-upstream: failing on purpose with status {settings.status}"
            return error_response(settings.status, message)
        if mode == "rate_limit":
            retry = f"{settings.retry_after:g}"
            message = f"Rate limit reached for requests (mock-upstream). Try again in {retry}s."
            return error_response(
                429, message, code="rate_limit_exceeded", headers={"retry-after": retry}
            )
        return mode, settings, started

    async def admit(
        request: Request, parse: Callable[[dict[str, Any]], _Ask]
    ) -> tuple[_Ask, Mode, MockSettings, float] | Response:
        """Auth, then the body (``parse`` makes it what the route needs, or raises
        _BadRequest), then :func:`gate`; an error response at the first that fails."""
        started = time.monotonic()
        denied = unauthorized(request)
        if denied is not None:
            return denied
        try:
            ask = parse(await read_body(request))
        except _BadRequest as exc:
            return error_response(400, str(exc), param=exc.param)
        gated = await gate(request, started)
        if isinstance(gated, Response):
            return gated
        mode, settings, started = gated
        return ask, mode, settings, started

    def cut_after(settings: MockSettings, total: int) -> int | None:
        if settings.cut_after is not None:
            return settings.cut_after
        return total // 2

    def cut_body(data: bytes) -> Response:
        async def half() -> AsyncIterator[bytes]:
            yield data[: len(data) // 2]
            mock.cuts += 1
            raise _Cut

        return _CuttableStream(half(), media_type="application/json")

    async def completion(request: Request, kind: Literal["chat", "text"]) -> Response:
        admitted = await admit(request, lambda body: _plan(kind, body, mock.settings.text_tokens))
        if isinstance(admitted, Response):
            return admitted
        plan, mode, settings, started = admitted
        tps = settings.tokens_per_s
        first_at = started + settings.latency_ms / 1000
        longest = max(len(tokens) for tokens, _ in plan.choices)
        headers = {"x-request-id": "req_" + uuid.uuid4().hex}

        if not plan.stream:
            await _until(first_at + (longest - 1) / tps if tps else first_at)
            data = orjson.dumps(plan.body())
            if mode == "cut":
                return cut_body(data)
            return Response(data, 200, headers, media_type="application/json")

        stop_at = cut_after(settings, longest) if mode == "cut" else None
        mock.streams += 1

        async def events() -> AsyncIterator[bytes]:
            await _until(first_at)
            if plan.kind == "chat":
                yield b"".join(plan.chunk(i, "") for i in range(len(plan.choices)))
            for position in range(longest):
                if position == stop_at:
                    mock.cuts += 1
                    raise _Cut
                if position and tps:
                    await _until(first_at + position / tps)
                yield b"".join(
                    plan.chunk(i, tokens[position])
                    for i, (tokens, _) in enumerate(plan.choices)
                    if position < len(tokens)
                )
            yield b"".join(
                plan.chunk(i, None, finish) for i, (_, finish) in enumerate(plan.choices)
            )
            if plan.include_usage:
                yield _sse({**plan.base(), "choices": [], "usage": plan.usage()})
            yield b"data: [DONE]\n\n"

        headers["cache-control"] = "no-cache"
        return _CuttableStream(events(), headers=headers, media_type="text/event-stream")

    def as_anthropic(response: Response) -> Response:
        """An error response of the Messages route, in the Anthropic shape."""
        body = orjson.loads(bytes(response.body))
        kept = {k: v for k, v in response.headers.items() if k == "retry-after"}
        return anthropic_error(response.status_code, str(body["error"]["message"]), headers=kept)

    def parse_generation(
        api: Literal["responses", "messages"],
    ) -> Callable[[dict[str, Any]], Generation]:
        def parse(body: dict[str, Any]) -> Generation:
            try:
                return generation(api, body, mock.settings.text_tokens)
            except MockBadRequest as exc:
                raise _BadRequest(str(exc), exc.param) from None

        return parse

    async def generate(request: Request, api: Literal["responses", "messages"]) -> Response:
        admitted = await admit(request, parse_generation(api))
        if isinstance(admitted, Response):
            return as_anthropic(admitted) if api == "messages" else admitted
        answer, mode, settings, started = admitted
        tps = settings.tokens_per_s
        first_at = started + settings.latency_ms / 1000
        count = len(answer.words)
        headers = {"x-request-id": "req_" + uuid.uuid4().hex}
        if not answer.request.get("stream"):
            await _until(first_at + (count - 1) / tps if tps else first_at)
            data = orjson.dumps(answer.body())
            if mode == "cut":
                return cut_body(data)
            return Response(data, 200, headers, media_type="application/json")
        stop_at = cut_after(settings, count) if mode == "cut" else None
        mock.streams += 1
        head, deltas, tail = answer.events()

        async def events() -> AsyncIterator[bytes]:
            await _until(first_at)
            yield b"".join(_named(event) for event in head)
            for position, event in enumerate(deltas):
                if position == stop_at:
                    mock.cuts += 1
                    raise _Cut
                if position and tps:
                    await _until(first_at + position / tps)
                yield _named(event)
            yield b"".join(_named(event) for event in tail)

        headers["cache-control"] = "no-cache"
        return _CuttableStream(events(), headers=headers, media_type="text/event-stream")

    async def responses(request: Request) -> Response:
        return await generate(request, "responses")

    async def messages(request: Request) -> Response:
        return await generate(request, "messages")

    async def chat_completions(request: Request) -> Response:
        return await completion(request, "chat")

    async def text_completions(request: Request) -> Response:
        return await completion(request, "text")

    async def embeddings(request: Request) -> Response:
        admitted = await admit(request, lambda body: _embeddings_ask(body, embedding_dimensions))
        if isinstance(admitted, Response):
            return admitted
        ask, mode, settings, started = admitted
        data = []
        for index, item in enumerate(ask.inputs):
            vector = _embedding(item, ask.dimensions, ask.model)
            encoded: Any = vector
            if ask.encoding == "base64":
                encoded = base64.b64encode(struct.pack(f"<{ask.dimensions}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        prompt_tokens = _input_tokens(ask.inputs)
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
        answer = orjson.dumps({"object": "list", "data": data, "model": ask.model, "usage": usage})
        await _until(started + settings.latency_ms / 1000)
        if mode == "cut":
            return cut_body(answer)
        return Response(answer, 200, media_type="application/json")

    def model_object(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 1700000000, "owned_by": "flightcache"}

    async def list_models(request: Request) -> Response:
        denied = unauthorized(request)
        if denied is not None:
            return denied
        return _json({"object": "list", "data": [model_object(m) for m in models]})

    async def get_model(request: Request) -> Response:
        denied = unauthorized(request)
        if denied is not None:
            return denied
        name = request.path_params["model"]
        if name not in models:
            message = f"The model '{name}' does not exist or you do not have access to it."
            return error_response(404, message, code="model_not_found")
        return _json(model_object(name))

    async def not_found(request: Request) -> Response:
        return error_response(404, f"Invalid URL ({request.method} {request.url.path})")

    async def stats(request: Request) -> Response:
        return _json(mock.snapshot())

    async def control(request: Request) -> Response:
        if request.method == "POST":
            try:
                changes = orjson.loads(await request.body() or b"{}")
                if not isinstance(changes, dict):
                    raise ValueError("the body must be a JSON object")
                mock.configure(changes)
            except (ValueError, TypeError) as exc:
                return error_response(400, f"mock-upstream: bad /control request: {exc}")
        return _json(asdict(mock.settings))

    async def control_reset(request: Request) -> Response:
        mock.reset()
        return _json(asdict(mock.settings))

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", text_completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/{rest:path}", not_found, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
        Route("/stats", stats, methods=["GET"]),
        Route("/control", control, methods=["GET", "POST"]),
        Route("/control/reset", control_reset, methods=["POST"]),
    ]
    app = Starlette(routes=routes, middleware=[Middleware(_Accounting, state=mock)])
    app.state.mock = mock
    return app


def mock_state(app: Starlette) -> MockState:
    """The :class:`MockState` of an app made by :func:`make_mock_app`."""
    return cast(MockState, app.state.mock)
