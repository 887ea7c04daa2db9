"""The mock upstream's Responses API and Messages API answers: deterministic made-up words.

The same request always gets the same words, whatever ``stream`` says: the words are a
pure function of the request without the fields that cannot change an answer; a smaller
``max_output_tokens`` / ``max_tokens`` gives a prefix (``status: "incomplete"``,
``stop_reason: "max_tokens"``). A stream is the event sequence of the real API:

- Responses: ``response.created``, ``response.in_progress``, ``response.output_item.added``,
  ``response.content_part.added``, one ``response.output_text.delta`` per word,
  ``response.output_text.done``, ``response.content_part.done``,
  ``response.output_item.done``, ``response.completed`` (or ``response.incomplete``), each
  with its ``sequence_number``.
- Messages: ``message_start``, ``content_block_start``, ``ping``, one
  ``content_block_delta`` per word, ``content_block_stop``, ``message_delta`` (stop reason,
  usage), ``message_stop``.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

__all__ = ["Generation", "MockBadRequest", "count_words", "digest", "generation", "tokens"]

Api = Literal["responses", "messages"]

_WORDS = (
    "amber basil cedar delta ember fable garnet harbor indigo juniper kestrel lantern meadow "
    "nimbus orchard pepper quartz raven saffron timber umber velvet willow xenon yarrow zephyr "
    "anchor breeze canyon dune echo fjord glacier heron island jasper kelp lagoon mesa nectar "
    "onyx prairie quill reef summit tundra upland valley wharf yonder zenith atlas beacon "
    "comet drift falcon grove haven ivory"
).split()
_NOT_IN_SEED = frozenset(
    {"stream", "stream_options", "max_output_tokens", "max_tokens", "user", "metadata"}
    | {"store", "service_tier", "background", "safety_identifier", "prompt_cache_key"}
)


class MockBadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def digest(data: Any) -> bytes:
    return hashlib.blake2b(orjson.dumps(data, option=orjson.OPT_SORT_KEYS), digest_size=16).digest()


def tokens(seed: bytes, count: int) -> list[str]:
    """``count`` words, a pure function of ``seed``; the first without a leading space."""
    words: list[str] = []
    block = 0
    while len(words) < count:
        raw = hashlib.blake2b(seed + block.to_bytes(4, "big"), digest_size=32).digest()
        words.extend(_WORDS[b % len(_WORDS)] for b in raw)
        block += 1
    return [w if i == 0 else " " + w for i, w in enumerate(words[:count])]


def count_words(value: Any) -> int:
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(count_words(v) for v in value)
    if isinstance(value, dict):
        return sum(count_words(v) for k, v in value.items() if k in ("content", "text"))
    return 0


@dataclass
class Generation:
    """One answer of the Responses or Messages API, and its stream's events."""

    api: Api
    model: str
    words: list[str]
    limited: bool  # cut short by the request's token limit
    prompt_tokens: int
    request: dict[str, Any]
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def text(self) -> str:
        return "".join(self.words)

    # -- Responses --------------------------------------------------------------------------

    def _item(self, done: bool) -> dict[str, Any]:
        content = [{"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}]
        status = ("incomplete" if self.limited else "completed") if done else "in_progress"
        return {
            "id": "msg_" + self.id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content if done else [],
        }

    def response(self, done: bool = True) -> dict[str, Any]:
        body = self.request
        status = ("incomplete" if self.limited else "completed") if done else "in_progress"
        output = len(self.words)
        usage = {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + output,
        }
        return {
            "id": "resp_" + self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if done and self.limited
            else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": self.model,
            "output": [self._item(True)] if done else [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": body.get("store", True),
            "temperature": body.get("temperature", 1.0),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0),
            "truncation": body.get("truncation", "disabled"),
            "usage": usage if done else None,
            "user": body.get("user"),
            "metadata": body.get("metadata") or {},
        }

    def _response_events(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[Any]]:
        where = {"item_id": "msg_" + self.id, "output_index": 0, "content_index": 0}
        empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        full = {**empty, "text": self.text}
        head: list[dict[str, Any]] = [
            {"type": "response.created", "response": self.response(False)},
            {"type": "response.in_progress", "response": self.response(False)},
            {"type": "response.output_item.added", "output_index": 0, "item": self._item(False)},
            {"type": "response.content_part.added", **where, "part": empty},
        ]
        deltas = [
            {"type": "response.output_text.delta", **where, "delta": word, "logprobs": []}
            for word in self.words
        ]
        ending = "response.incomplete" if self.limited else "response.completed"
        tail: list[dict[str, Any]] = [
            {"type": "response.output_text.done", **where, "text": self.text, "logprobs": []},
            {"type": "response.content_part.done", **where, "part": full},
            {"type": "response.output_item.done", "output_index": 0, "item": self._item(True)},
            {"type": ending, "response": self.response(True)},
        ]
        number = 0
        for event in (*head, *deltas, *tail):
            event["sequence_number"] = number
            number += 1
        return head, deltas, tail

    # -- Messages ---------------------------------------------------------------------------

    def _usage(self, output: int) -> dict[str, Any]:
        return {
            "input_tokens": self.prompt_tokens,
            "output_tokens": output,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "service_tier": "standard",
        }

    def message(self, done: bool = True) -> dict[str, Any]:
        stop = ("max_tokens" if self.limited else "end_turn") if done else None
        return {
            "id": "msg_" + self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [{"type": "text", "text": self.text}] if done else [],
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": self._usage(len(self.words) if done else 1),
        }

    def _message_events(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[Any]]:
        head: list[dict[str, Any]] = [
            {"type": "message_start", "message": self.message(False)},
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
            {"type": "ping"},
        ]
        deltas = [
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": w}}
            for w in self.words
        ]
        stop = "max_tokens" if self.limited else "end_turn"
        tail: list[dict[str, Any]] = [
            {"type": "content_block_stop", "index": 0},
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": len(self.words)},
            },
            {"type": "message_stop"},
        ]
        return head, deltas, tail

    # -- both ---------------------------------------------------------------------------------

    def body(self) -> dict[str, Any]:
        return self.response() if self.api == "responses" else self.message()

    def events(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[Any]]:
        """The stream's events: those before the first word, one per word, and the rest."""
        return self._response_events() if self.api == "responses" else self._message_events()


def _limit(body: dict[str, Any], name: str, required: bool) -> int | None:
    value = body.get(name)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MockBadRequest(f"{name}: expected an integer of at least 1", name)
    return value


def generation(api: Api, body: dict[str, Any], text_tokens: int) -> Generation:
    """Check one Responses or Messages request (MockBadRequest) and make its answer."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise MockBadRequest("model: Field required", "model")
    if not isinstance(body.get("stream", False), bool | None):
        raise MockBadRequest("stream: expected a boolean", "stream")
    temperature = body.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not 0 <= temperature <= 2
    ):
        raise MockBadRequest("temperature: expected a number from 0 to 2", "temperature")
    if api == "responses":
        limit = _limit(body, "max_output_tokens", False)
        given = body.get("input")
        if not isinstance(given, (str, list)) or not given:
            raise MockBadRequest("input: expected a string or a non-empty array", "input")
        prompt_tokens = count_words(given) + count_words(body.get("instructions") or "")
    else:
        limit = _limit(body, "max_tokens", True)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise MockBadRequest("messages: expected a non-empty array", "messages")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise MockBadRequest("messages: each message needs a role", "messages")
        prompt_tokens = 3 + sum(3 + count_words(m) for m in messages)
        prompt_tokens += count_words(body.get("system") or "")
    seed = digest({"api": api, **{k: v for k, v in body.items() if k not in _NOT_IN_SEED}})
    count = text_tokens if limit is None else min(limit, text_tokens)
    return Generation(
        api=api,
        model=model,
        words=tokens(seed, count),
        limited=count < text_tokens,
        prompt_tokens=prompt_tokens,
        request=body,
    )
