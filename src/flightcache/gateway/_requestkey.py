"""What the gateway does with one request: validation, then the key and the policy.

The key and policy rules are the ones the SDK wrappers use too, and live with them
(``flightcache.integrations._rules``, which documents them): a digest of the route, the
tenant and the canonical body; sampled answers coalesced and stored only when
``cache_sampled``; requests that must not be shared go upstream as they are. This module
checks a request's shape first (an OpenAI- or Anthropic-shaped 400 naming the ``param``,
before any upstream call) and says how the request goes upstream: always as a stream, so a
request and its streaming twin share one flight.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from ..integrations._rules import (
    COALESCE_HEADER,
    DROPPED_FIELDS,
    ROUTES,
    TTL_HEADER,
    BadHeader,
    Policy,
    Route,
    cache_rules,
    request_digest,
    tenant_label,
    tenant_of,
)

__all__ = [
    "COALESCE_HEADER",
    "DROPPED_FIELDS",
    "ROUTES",
    "TTL_HEADER",
    "BadRequest",
    "Plan",
    "Policy",
    "plan_request",
    "request_digest",
    "tenant_of",
]

# Field shapes the gateway checks before it computes a key; the upstream checks the rest.
_SHAPES: dict[str, tuple[str, tuple[type, ...]]] = {
    "model": ("a string", (str,)),
    "temperature": ("a number", (int, float)),
    "top_p": ("a number", (int, float)),
    "presence_penalty": ("a number", (int, float)),
    "frequency_penalty": ("a number", (int, float)),
    "n": ("an integer", (int,)),
    "seed": ("an integer", (int,)),
    "max_tokens": ("an integer", (int,)),
    "max_completion_tokens": ("an integer", (int,)),
    "top_logprobs": ("an integer", (int,)),
    "best_of": ("an integer", (int,)),
    "dimensions": ("an integer", (int,)),
    "stream": ("a boolean", (bool,)),
    "echo": ("a boolean", (bool,)),
    "parallel_tool_calls": ("a boolean", (bool,)),
    "store": ("a boolean", (bool,)),
    "user": ("a string", (str,)),
    "encoding_format": ("a string", (str,)),
    "reasoning_effort": ("a string", (str,)),
    "service_tier": ("a string", (str,)),
    "suffix": ("a string", (str,)),
    "stream_options": ("an object", (dict,)),
    "response_format": ("an object", (dict,)),
    "logit_bias": ("an object", (dict,)),
    "metadata": ("an object", (dict,)),
    "audio": ("an object", (dict,)),
    "reasoning": ("an object", (dict,)),
    "prediction": ("an object", (dict,)),
    "tools": ("an array", (list,)),
    "functions": ("an array", (list,)),
    "modalities": ("an array", (list,)),
    "stop": ("a string or an array of strings", (str, list)),
    "tool_choice": ("a string or an object", (str, dict)),
    "function_call": ("a string or an object", (str, dict)),
    "prompt": ("a string or an array", (str, list)),
    "input": ("a string or an array", (str, list)),
}


# Fields whose shape differs on one route (the Responses and Messages APIs).
_ROUTE_SHAPES: dict[str, dict[str, tuple[str, tuple[type, ...]]]] = {
    "responses": {
        "prompt": ("an object", (dict,)),
        "instructions": ("a string or an array", (str, list)),
        "max_output_tokens": ("an integer", (int,)),
        "previous_response_id": ("a string", (str,)),
        "background": ("a boolean", (bool,)),
        "include": ("an array", (list,)),
        "text": ("an object", (dict,)),
        "truncation": ("a string", (str,)),
        "conversation": ("a string or an object", (str, dict)),
    },
    "messages": {
        "max_tokens": ("an integer", (int,)),
        "system": ("a string or an array", (str, list)),
        "stop_sequences": ("an array of strings", (list,)),
        "top_k": ("an integer", (int,)),
        "tool_choice": ("an object", (dict,)),
        "thinking": ("an object", (dict,)),
        "container": ("a string or an object", (str, dict)),
    },
}


class BadRequest(Exception):
    """A request the gateway refuses with a 400 (or ``status``) before any flight."""

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400
    ) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status


@dataclass(frozen=True)
class Plan:
    """One request, decided: how it goes upstream, its key, and whether it is stored."""

    route: Route
    path: str
    body: dict[str, Any]  # as the client sent it
    upstream_body: dict[str, Any]  # what the owner sends upstream
    stream: bool  # the client wants SSE
    include_usage: bool  # ... with the usage chunk (chat and text completions)
    sampled: bool
    bypass: bool  # plain proxying: no flight at all
    bypass_reason: str | None  # why (opted_out, best_of, background, ...)
    refresh: bool  # a stored answer does not count
    max_age: float | None  # a stored answer older than this does not count
    ttl: float  # seconds the answer is stored
    store: bool  # False: coalesced while in flight, never stored
    key: str  # the digest: X-Flightcache-Key, and the flight's key
    tenant: str  # the caller's own tenant digest, short (metric labels)


def _parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest(
            "We could not parse the JSON body of your request. (HINT: This likely means you "
            "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload.)"
        ) from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    return body


def _check_shapes(route: Route, body: Mapping[str, Any]) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        if not (
            route == "responses" and "model" not in body and isinstance(body.get("prompt"), dict)
        ):
            raise BadRequest("you must provide a model parameter", param="model")
    shapes = _ROUTE_SHAPES.get(route, {})
    for name, value in body.items():
        if value is None:
            continue
        shape = shapes.get(name) or _SHAPES.get(name)
        if name == "logprobs":  # chat: a boolean; completions: an integer
            shape = ("a boolean", (bool,)) if route == "chat" else ("an integer", (int,))
        if shape is None:
            continue
        what, types = shape
        if isinstance(value, bool) and bool not in types:
            ok = False  # JSON true is not a number here
        else:
            ok = isinstance(value, types)
        if ok and isinstance(value, float) and not math.isfinite(value):
            ok = False
        if not ok:
            raise BadRequest(f"Invalid type for '{name}': expected {what}.", param=name)
    if isinstance(body.get("stop"), list) and not all(isinstance(s, str) for s in body["stop"]):
        raise BadRequest("Invalid type for 'stop': expected an array of strings.", param="stop")
    if route == "chat" or route == "messages":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array.", param="messages")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise BadRequest(
                "Each item of 'messages' must be an object with a string 'role'.",
                param="messages",
            )
    if route == "messages" and not isinstance(body.get("max_tokens"), int):
        raise BadRequest("max_tokens: Field required", param="max_tokens")
    elif route == "completions":
        if "prompt" in body and not isinstance(body["prompt"], (str, list)):
            raise BadRequest("'prompt' must be a string or an array.", param="prompt")
    elif route == "embeddings" and not isinstance(body.get("input"), (str, list)):
        raise BadRequest("'input' must be a string or an array.", param="input")
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n < 1:
        raise BadRequest("'n' must be at least 1.", param="n")


def plan_request(path: str, raw: bytes, headers: Mapping[str, str], policy: Policy) -> Plan:
    """Decide one request to a cached route; raises :class:`BadRequest`."""
    route = ROUTES[path]
    body = _parse_body(raw)
    _check_shapes(route, body)
    try:
        rules = cache_rules(route, body, headers, policy)
    except BadHeader as exc:
        raise BadRequest(str(exc), code=exc.code) from None
    stream = route != "embeddings" and bool(body.get("stream"))
    options = body.get("stream_options")
    include_usage = stream and isinstance(options, dict) and bool(options.get("include_usage"))
    upstream_body = dict(body)
    if route == "chat" or route == "completions":
        upstream_body["stream"] = True
        upstream_body["stream_options"] = {"include_usage": True}
    elif route != "embeddings":
        upstream_body["stream"] = True
        upstream_body.pop("stream_options", None)  # only allowed with stream: true
    return Plan(
        route=route,
        path=path,
        body=body,
        upstream_body=upstream_body,
        stream=stream,
        include_usage=include_usage,
        sampled=rules.sampled,
        bypass=rules.bypass is not None,
        bypass_reason=rules.bypass,
        refresh=rules.refresh,
        max_age=rules.max_age,
        ttl=rules.ttl,
        store=rules.store,
        key=request_digest(path, body, tenant_of(headers, policy), headers),
        tenant=tenant_label(headers),
    )
