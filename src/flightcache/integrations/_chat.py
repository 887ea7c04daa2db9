"""Chat and text completions: between the stored chunks of an answer and what a client gets.

A flight always stores the chunks of a streamed completion, the richer form: a stream client
gets them as they are (without the usage chunk unless it asked for it), a non-stream client
gets one ``chat.completion`` / ``text_completion`` assembled from them, as the API would
have answered: content, refusal, tool calls merged by index (arguments concatenated), audio,
annotations, logprobs, finish reason, one choice per ``index``, usage, and the id, created,
model, system fingerprint and service tier of the chunks.

Chunks are shared by every caller of a flight in a process: nothing here mutates them.
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["assemble", "chunks_from_completion", "for_client", "mark_cached"]

Kind = Literal["chat", "completions"]
_TOP_FIELDS = ("system_fingerprint", "service_tier")
_CONCATENATED = frozenset({"arguments", "input", "data", "transcript"})


def mark_cached(answer: Any) -> Any:
    """The answer with ``usage.cached: true`` (served from the cache), as a new object."""
    if isinstance(answer, dict) and isinstance(answer.get("usage"), dict):
        return {**answer, "usage": {**answer["usage"], "cached": True}}
    return answer


def for_client(chunk: Any, include_usage: bool, hit: bool) -> Any:
    """A stored chunk as a stream client gets it, or None when it is not for this client.

    A client that did not ask for ``stream_options.include_usage`` gets no usage chunk and
    no ``usage`` keys (the gateway always asks the upstream for them).
    """
    if not isinstance(chunk, dict):
        return chunk
    if include_usage:
        return mark_cached(chunk) if hit else chunk
    if "usage" not in chunk:
        return chunk
    if not chunk.get("choices") and chunk["usage"] is not None:
        return None  # the usage-only last chunk
    return {k: v for k, v in chunk.items() if k != "usage"}


def _merge_into(target: dict[str, Any], delta: dict[str, Any]) -> None:
    """Merge one delta object (tool call function, audio): text parts concatenate."""
    for name, value in delta.items():
        if value is None:
            continue
        if name in _CONCATENATED and isinstance(value, str):
            target[name] = (target.get(name) or "") + value
        elif isinstance(value, dict):
            if not isinstance(target.get(name), dict):
                target[name] = {}
            _merge_into(target[name], value)  # copied field by field: chunks stay untouched
        elif target.get(name) in (None, ""):
            target[name] = value


def _merge_logprobs(target: dict[str, Any] | None, part: Any) -> dict[str, Any] | None:
    if not isinstance(part, dict):
        return target
    target = {} if target is None else target
    for name, value in part.items():
        if isinstance(value, list):
            target[name] = [*(target.get(name) or []), *value]
        elif name not in target:
            target[name] = value
    return target


class _Choice:
    """What the chunks of one choice index add up to."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.role: str | None = None
        self.content: list[str] | None = None
        self.refusal: list[str] | None = None
        self.text: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.function_call: dict[str, Any] | None = None
        self.audio: dict[str, Any] | None = None
        self.annotations: list[Any] = []
        self.logprobs: dict[str, Any] | None = None
        self.finish_reason: str | None = None

    def add(self, choice: dict[str, Any]) -> None:
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        self.logprobs = _merge_logprobs(self.logprobs, choice.get("logprobs"))
        if isinstance(choice.get("text"), str):
            self.text.append(choice["text"])
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return
        if isinstance(delta.get("role"), str):
            self.role = delta["role"]
        if isinstance(delta.get("content"), str):
            self.content = [*(self.content or []), delta["content"]]
        if isinstance(delta.get("refusal"), str):
            self.refusal = [*(self.refusal or []), delta["refusal"]]
        for call in delta.get("tool_calls") or []:
            if isinstance(call, dict):
                position = call.get("index", len(self.tool_calls))
                merged = self.tool_calls.setdefault(position, {})
                _merge_into(merged, {k: v for k, v in call.items() if k != "index"})
        if isinstance(delta.get("function_call"), dict):
            self.function_call = self.function_call or {}
            _merge_into(self.function_call, delta["function_call"])
        if isinstance(delta.get("audio"), dict):
            self.audio = self.audio or {}
            _merge_into(self.audio, delta["audio"])
        if isinstance(delta.get("annotations"), list):
            self.annotations.extend(delta["annotations"])

    def chat(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": self.role or "assistant",
            "content": None if self.content is None else "".join(self.content),
            "refusal": None if self.refusal is None else "".join(self.refusal),
            "annotations": self.annotations,
        }
        if self.tool_calls:
            calls = [self.tool_calls[k] for k in sorted(self.tool_calls)]
            message["tool_calls"] = [{"type": "function", **call} for call in calls]
        if self.function_call is not None:
            message["function_call"] = self.function_call
        if self.audio is not None:
            message["audio"] = self.audio
        return {
            "index": self.index,
            "message": message,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
        }

    def completion(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "text": "".join(self.text),
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
        }


def assemble(kind: Kind, chunks: list[Any]) -> dict[str, Any]:
    """The non-stream answer the chunks of one streamed completion stand for."""
    head: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    usage: Any = None
    choices: dict[int, _Choice] = {}
    for chunk in chunks:
        if not isinstance(chunk, dict):
            continue
        for name in ("id", "created", "model"):
            if name not in head and chunk.get(name) is not None:
                head[name] = chunk[name]
        for name in _TOP_FIELDS:
            if chunk.get(name) is not None:
                extra[name] = chunk[name]
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if isinstance(choice, dict):
                index = choice.get("index", 0)
                index = index if isinstance(index, int) else 0
                choices.setdefault(index, _Choice(index)).add(choice)
    answer: dict[str, Any] = {
        "id": head.get("id", ""),
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": head.get("created", 0),
        "model": head.get("model", ""),
        "choices": [
            choices[i].chat() if kind == "chat" else choices[i].completion()
            for i in sorted(choices)
        ],
    }
    if usage is not None:
        answer["usage"] = usage
    answer.update(extra)
    return answer


def chunks_from_completion(answer: Any) -> list[dict[str, Any]]:
    """The chunks a non-stream answer stands for (an upstream that does not stream)."""
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
        raise ValueError("not a completion")
    base = {k: v for k, v in answer.items() if k not in ("choices", "usage")}
    if answer.get("object") == "chat.completion":
        base["object"] = "chat.completion.chunk"
    choices = []
    for choice in answer["choices"]:
        if not isinstance(choice, dict):
            continue
        part = {k: v for k, v in choice.items() if k != "message"}
        if isinstance(choice.get("message"), dict):
            delta = dict(choice["message"])
            calls = delta.get("tool_calls")
            if isinstance(calls, list):
                delta["tool_calls"] = [
                    {"index": i, **c} for i, c in enumerate(calls) if isinstance(c, dict)
                ]
            part["delta"] = delta
        choices.append(part)
    chunks = [{**base, "choices": choices}]
    if answer.get("usage") is not None:
        chunks.append({**base, "choices": [], "usage": answer["usage"]})
    return chunks
