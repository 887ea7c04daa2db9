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
  "connections": k, "settings": {...}}``; ``calls`` counts every request received under
  ``/v1``, ``connections`` the distinct client connections they came on (a client that
  keeps its connections alive reuses them); a tenant is the first 12 hex digits of the
  SHA-256 of its bearer key.
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
import re
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any, Literal, cast

import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ._mock_apis import Generation, MockBadRequest, generation
from ._mock_parts import (
    _BEARER,
    DEFAULT_MODELS,
    MODES,
    MockSettings,
    MockState,
    Mode,
    _Accounting,
    _Ask,
    _BadRequest,
    _Cut,
    _CuttableStream,
    _embedding,
    _embeddings_ask,
    _input_tokens,
    _json,
    _named,
    _plan,
    _sse,
    _until,
)
from ._wire import anthropic_error, error_response

__all__ = ["MODES", "MockSettings", "MockState", "error_response", "make_mock_app", "mock_state"]


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
