"""The Responses and Messages APIs: between the stored events of an answer and its answers.

A flight stores the events of a streamed answer (the ``data`` of each server-sent event,
whose ``type`` is also its event name). A stream client gets them as they are; a
non-stream client gets what they add up to:

- **Responses** (OpenAI): the ``response`` of the terminal event (``response.completed``,
  or ``response.incomplete`` when a limit cut it short) is the whole answer already.
- **Messages** (Anthropic): ``message_start`` carries the message without content, each
  content block is opened, grown by deltas (text, tool input JSON, thinking, signature,
  citations) and closed, ``message_delta`` sets the stop reason and the final usage.

An upstream that answers a stream request with plain JSON gets its answer turned into the
events a stream would have had (:func:`events_from_response`, :func:`events_from_message`).
Events are shared by every caller of a flight in a process: nothing here mutates them.
"""

from __future__ import annotations

import copy
from typing import Any

import orjson

__all__ = [
    "MESSAGE_END",
    "RESPONSE_ENDS",
    "events_from_message",
    "events_from_response",
    "message_of",
    "response_of",
]

RESPONSE_ENDS = frozenset({"response.completed", "response.incomplete"})
MESSAGE_END = "message_stop"


def response_of(events: list[Any]) -> dict[str, Any]:
    """The Responses answer the events of one stream stand for (its terminal event's)."""
    for event in reversed(events):
        if isinstance(event, dict) and event.get("type") in RESPONSE_ENDS:
            response = event.get("response")
            if isinstance(response, dict):
                return response
    raise ValueError("the stream has no response.completed event")


class _Blocks:
    """The content blocks of one message as its deltas arrive."""

    def __init__(self) -> None:
        self.blocks: dict[int, dict[str, Any]] = {}
        self.json: dict[int, list[str]] = {}

    def start(self, index: int, block: Any) -> None:
        self.blocks[index] = copy.deepcopy(block) if isinstance(block, dict) else {}

    def delta(self, index: int, delta: dict[str, Any]) -> None:
        block = self.blocks.setdefault(index, {})
        kind = delta.get("type")
        if kind == "text_delta":
            block["text"] = str(block.get("text") or "") + str(delta.get("text") or "")
        elif kind == "input_json_delta":
            self.json.setdefault(index, []).append(str(delta.get("partial_json") or ""))
        elif kind == "thinking_delta":
            block["thinking"] = str(block.get("thinking") or "") + str(delta.get("thinking") or "")
        elif kind == "signature_delta":
            block["signature"] = delta.get("signature")
        elif kind == "citations_delta":
            block["citations"] = [*(block.get("citations") or []), delta.get("citation")]

    def stop(self, index: int) -> None:
        parts = self.json.pop(index, None)
        if parts is None:
            return
        text = "".join(parts)
        try:
            self.blocks.setdefault(index, {})["input"] = orjson.loads(text) if text else {}
        except orjson.JSONDecodeError:
            self.blocks[index]["input"] = {}

    def content(self) -> list[dict[str, Any]]:
        for index in list(self.json):
            self.stop(index)
        return [self.blocks[i] for i in sorted(self.blocks)]


def message_of(events: list[Any]) -> dict[str, Any]:
    """The Messages answer the events of one stream add up to."""
    message: dict[str, Any] | None = None
    blocks = _Blocks()
    for event in events:
        if not isinstance(event, dict):
            continue
        kind = event.get("type")
        index = event.get("index")
        index = index if isinstance(index, int) else 0
        if kind == "message_start" and isinstance(event.get("message"), dict):
            message = copy.deepcopy(event["message"])
        elif kind == "content_block_start":
            blocks.start(index, event.get("content_block"))
        elif kind == "content_block_delta" and isinstance(event.get("delta"), dict):
            blocks.delta(index, event["delta"])
        elif kind == "content_block_stop":
            blocks.stop(index)
        elif kind == "message_delta" and message is not None:
            if isinstance(event.get("delta"), dict):
                message.update(event["delta"])
            if isinstance(event.get("usage"), dict):
                usage = message.setdefault("usage", {})
                usage.update({k: v for k, v in event["usage"].items() if v is not None})
    if message is None:
        raise ValueError("the stream has no message_start event")
    message["content"] = blocks.content()
    return message


def events_from_response(answer: Any) -> list[dict[str, Any]]:
    """The events a streamed Responses answer would have had (for an upstream that
    answered with plain JSON): created, each output item with its text, completed."""
    if not isinstance(answer, dict) or answer.get("object") != "response":
        raise ValueError("not a response")
    events: list[dict[str, Any]] = []

    def add(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    started = {**answer, "status": "in_progress", "output": [], "usage": None}
    add("response.created", response=started)
    for position, item in enumerate(answer.get("output") or []):
        if not isinstance(item, dict):
            continue
        add("response.output_item.added", output_index=position, item=item)
        if item.get("type") == "message":
            for part_index, part in enumerate(item.get("content") or []):
                where = {"item_id": item.get("id"), "output_index": position}
                where["content_index"] = part_index
                if isinstance(part, dict) and part.get("type") == "output_text":
                    text = part.get("text") or ""
                    add("response.output_text.delta", **where, delta=text, logprobs=[])
                    add("response.output_text.done", **where, text=text, logprobs=[])
                add("response.content_part.done", **where, part=part)
        add("response.output_item.done", output_index=position, item=item)
    ending = "response.incomplete" if answer.get("status") == "incomplete" else "response.completed"
    add(ending, response=answer)
    return events


def events_from_message(answer: Any) -> list[dict[str, Any]]:
    """The events a streamed Messages answer would have had (for an upstream that answered
    with plain JSON)."""
    if not isinstance(answer, dict) or answer.get("type") != "message":
        raise ValueError("not a message")
    given = answer.get("usage")
    usage: dict[str, Any] = given if isinstance(given, dict) else {}
    start = {**answer, "content": [], "stop_reason": None, "stop_sequence": None}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    for index, block in enumerate(answer.get("content") or []):
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text":
            empty = {**block, "text": ""}
            delta: dict[str, Any] | None = {"type": "text_delta", "text": block.get("text", "")}
        elif kind == "tool_use":
            empty = {**block, "input": {}}
            raw = orjson.dumps(block.get("input") or {}).decode()
            delta = {"type": "input_json_delta", "partial_json": raw}
        else:
            empty, delta = block, None
        events.append({"type": "content_block_start", "index": index, "content_block": empty})
        if delta is not None:
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
        events.append({"type": "content_block_stop", "index": index})
    stop = {"stop_reason": answer.get("stop_reason"), "stop_sequence": answer.get("stop_sequence")}
    final = {"output_tokens": usage.get("output_tokens", 0)}
    events.append({"type": "message_delta", "delta": stop, "usage": final})
    events.append({"type": "message_stop"})
    return events
