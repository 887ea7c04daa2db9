"""The stored form of an answer, for every route: what a flight stores and what callers get.

A flight stores the events of a streamed answer as JSON objects (a chat chunk, a Responses
or Messages event; an embeddings answer is one object), after a **stamp**,
``{"flightcache.stamp": <unix time>}``, written by the owner when the upstream's first
event arrived: the answer's ``Age`` and ``Cache-Control: max-age`` are measured from it.
A caller never sees the stamp. Route by route, this module says what a stream client gets
of each event, what a non-stream client gets (the answer the events add up to), which
event ends a stream or reports a failure in the middle of it, and what the answer cost in
tokens.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from . import _chat, _events
from ._rules import Route

__all__ = [
    "STAMP",
    "Usage",
    "age_of",
    "answer_of",
    "failure",
    "for_client",
    "is_stamp",
    "mark_cached",
    "stamped",
    "stamped_sync",
    "usage_of",
]

STAMP = "flightcache.stamp"

# The HTTP status of each error type of the Messages API.
ANTHROPIC_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}


def is_stamp(chunk: Any) -> bool:
    return isinstance(chunk, dict) and STAMP in chunk


def age_of(chunk: Any, now: float | None = None) -> float | None:
    """Seconds since the stamped answer began (None: not a stamp). Clocks of two machines
    may differ a little: an age is never negative."""
    if not is_stamp(chunk):
        return None
    at = chunk[STAMP]
    if isinstance(at, bool) or not isinstance(at, (int, float)):
        return None
    return max(0.0, (time.time() if now is None else now) - at)


def _stamp() -> dict[str, float]:
    return {STAMP: round(time.time(), 3)}


async def stamped(chunks: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``chunks`` with a stamp before the first (none if there is none)."""
    first = True
    async for chunk in chunks:
        if first:
            first = False
            yield _stamp()
        yield chunk


def stamped_sync(chunks: Iterator[Any]) -> Iterator[Any]:
    """:func:`stamped` for a plain iterator."""
    first = True
    for chunk in chunks:
        if first:
            first = False
            yield _stamp()
        yield chunk


def answer_of(route: Route, chunks: list[Any]) -> dict[str, Any]:
    """The non-stream answer the stored chunks stand for; ValueError if they cannot."""
    chunks = [c for c in chunks if not is_stamp(c)]
    if route == "chat" or route == "completions":
        return _chat.assemble(route, chunks)
    if route == "responses":
        return _events.response_of(chunks)
    if route == "messages":
        return _events.message_of(chunks)
    if len(chunks) != 1 or not isinstance(chunks[0], dict):
        raise ValueError("not one embeddings answer")
    return dict(chunks[0])


def _usage_cached(holder: dict[str, Any], name: str) -> dict[str, Any]:
    usage = holder.get(name)
    if isinstance(usage, dict):
        return {**holder, name: {**usage, "cached": True}}
    return holder


def mark_cached(route: Route, answer: Any) -> Any:
    """A non-stream answer served from the cache, with ``usage.cached: true`` (a new object;
    the token counts are the upstream's, as billed for the original call)."""
    if not isinstance(answer, dict):
        return answer
    return _usage_cached(answer, "usage")


def for_client(route: Route, chunk: Any, include_usage: bool, hit: bool) -> Any:
    """A stored chunk as a stream client gets it, or None when it is not for this client
    (the stamp; on chat and text completions the usage chunk unless asked for)."""
    if is_stamp(chunk):
        return None
    if route == "chat" or route == "completions":
        return _chat.for_client(chunk, include_usage, hit)
    if not hit or not isinstance(chunk, dict):
        return chunk
    kind = chunk.get("type")
    if route == "responses" and kind in _events.RESPONSE_ENDS:
        response = chunk.get("response")
        if isinstance(response, dict):
            return {**chunk, "response": _usage_cached(response, "usage")}
    if route == "messages" and kind == "message_delta":
        return _usage_cached(chunk, "usage")
    return chunk


def ended(route: Route, chunk: Any) -> bool:
    """Whether ``chunk`` is the last event of a complete Responses or Messages stream."""
    if not isinstance(chunk, dict):
        return False
    if route == "responses":
        return chunk.get("type") in _events.RESPONSE_ENDS
    return route == "messages" and chunk.get("type") == _events.MESSAGE_END


def _openai_error(message: str, kind: str, code: Any, param: Any = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def failure(route: Route, chunk: Any) -> tuple[int, dict[str, Any]] | None:
    """The status and error body of an event that reports a failure mid-stream, or None.

    Chat: a chunk with ``error``. Responses: an ``error`` event, or ``response.failed``.
    Messages: an ``error`` event (its status from the error's type).
    """
    if not isinstance(chunk, dict):
        return None
    kind = chunk.get("type")
    if route == "responses" and kind == "error":
        message = str(chunk.get("message") or "the upstream reported an error mid-stream")
        code = chunk.get("code")
        status = 429 if code == "rate_limit_exceeded" else 500
        return status, _openai_error(message, "server_error", code, chunk.get("param"))
    if route == "responses" and kind == "response.failed":
        response = chunk.get("response")
        error = response.get("error") if isinstance(response, dict) else None
        error = error if isinstance(error, dict) else {}
        message = str(error.get("message") or "the response failed")
        return 500, _openai_error(message, "server_error", error.get("code") or "server_error")
    if route == "messages":
        if kind != "error":
            return None
        error = chunk.get("error")
        kind = error.get("type") if isinstance(error, dict) else None
        status = ANTHROPIC_STATUS.get(str(kind), 500)
        return status, chunk
    if route == "chat" or route == "completions":
        error = chunk.get("error")
        if error is None:
            return None
        code = error.get("code") if isinstance(error, dict) else None
        status = code if isinstance(code, int) and 400 <= code <= 599 else 502
        if isinstance(error, dict):
            return status, {"error": error}
        return status, _openai_error(str(error)[:500], "server_error", None)
    return None


@dataclass(frozen=True)
class Usage:
    """What one answer cost upstream: its model, prompt (input) and completion tokens."""

    model: str
    prompt: int
    completion: int


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def usage_of(route: Route, chunks: list[Any]) -> Usage | None:
    """The tokens the upstream billed for the answer, when the chunks say."""
    model = ""
    prompt = completion = 0
    seen = False
    for chunk in chunks:
        if not isinstance(chunk, dict) or is_stamp(chunk):
            continue
        holder: Any = chunk
        if route == "responses":
            if chunk.get("type") not in _events.RESPONSE_ENDS:
                continue
            holder = chunk.get("response")
        elif route == "messages":
            kind = chunk.get("type")
            if kind == "message_start":
                holder = chunk.get("message")
            elif kind != "message_delta":
                continue
        if not isinstance(holder, dict):
            continue
        if isinstance(holder.get("model"), str):
            model = holder["model"]
        usage = holder.get("usage")
        if not isinstance(usage, dict):
            continue
        seen = True
        if route == "responses":
            prompt, completion = (
                _count(usage.get("input_tokens")),
                _count(usage.get("output_tokens")),
            )
        elif route == "messages":
            inputs = sum(
                _count(usage.get(name))
                for name in (
                    "input_tokens",
                    "cache_creation_input_tokens",
                    "cache_read_input_tokens",
                )
            )
            prompt = max(prompt, inputs)
            completion = max(completion, _count(usage.get("output_tokens")))
        else:
            prompt = _count(usage.get("prompt_tokens"))
            completion = _count(usage.get("completion_tokens"))
    return Usage(model, prompt, completion) if seen else None
