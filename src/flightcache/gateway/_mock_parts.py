"""The mock upstream's parts (``_mock.py`` has the app): its settings and state, how it plans
an answer from a request (words, pacing, usage), embeddings, and the stream a test can cut."""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import struct
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal, TypeVar

import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._mock_apis import count_words, digest
from ._mock_apis import tokens as make_tokens

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
        self.peers: set[Any] = set()  # (host, port) of each connection a request came on

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
            "connections": len(self.peers),
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
        state.peers.add(tuple(scope.get("client") or ()))
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
