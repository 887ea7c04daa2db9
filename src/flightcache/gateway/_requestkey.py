"""What the gateway does with one request: validation, the cache key, and the policy.

The cache key of a completion or embedding request is a digest of the route, the tenant and
the canonical body: every field except the ones that cannot change the output (``stream``,
``stream_options``, ``user``, ``store``, ``metadata``, ``service_tier``), with top-level
``null`` fields dropped (the API treats them as absent) and integral floats of the numeric
sampling parameters written as integers (``temperature: 0.0`` is ``temperature: 0``). Key
order and whitespace do not matter. The tenant is a digest of the caller's credentials (the
``Authorization`` header, else ``api-key`` / ``x-api-key``, plus ``OpenAI-Organization`` and
``OpenAI-Project``), or ``*`` when the gateway shares answers across keys. The key itself is
never stored nor logged.

The policy (see ``docs/gateway.md``): a chat or text completion without ``seed`` whose
``temperature`` is omitted or above 0 is *sampled*: coalesced while in flight, stored only
when ``cache_sampled``. Request headers adjust one request: ``Cache-Control: no-cache``
(skip the stored answer; still coalesce and store), ``no-store`` (do not store),
``X-Flightcache-TTL: <seconds>``, ``X-Flightcache-Coalesce: off`` (plain proxying).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

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

Route = Literal["chat", "completions", "embeddings"]
ROUTES: dict[str, Route] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}

COALESCE_HEADER = "x-flightcache-coalesce"
TTL_HEADER = "x-flightcache-ttl"
MAX_TTL = 365 * 24 * 3600.0
KEY_VERSION = 1

DROPPED_FIELDS = frozenset(
    {"stream", "stream_options", "user", "store", "metadata", "service_tier"}
)
_NUMERIC = ("temperature", "top_p", "presence_penalty", "frequency_penalty")

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
class Policy:
    """The gateway's settings that decide keys and storage."""

    share_across_keys: bool = False
    cache_sampled: bool = True
    ttl: float = 3600.0


@dataclass(frozen=True)
class Plan:
    """One request, decided: how it goes upstream, its key, and whether it is stored."""

    route: Route
    path: str
    body: dict[str, Any]  # as the client sent it
    upstream_body: dict[str, Any]  # what the owner sends upstream
    stream: bool  # the client wants SSE
    include_usage: bool  # ... with the usage chunk
    sampled: bool
    bypass: bool  # plain proxying: no flight at all
    refresh: bool  # a stored answer does not count
    ttl: float  # seconds the answer is stored
    store: bool  # False: coalesced while in flight, never stored
    key: str  # the digest: X-Flightcache-Key, and the flight's key


def tenant_of(headers: Mapping[str, str], policy: Policy) -> str:
    """A digest of the caller's credentials (never the credentials), or ``*`` when shared."""
    if policy.share_across_keys:
        return "*"
    credential = (
        headers.get("authorization") or headers.get("api-key") or headers.get("x-api-key") or ""
    )
    scope = (headers.get("openai-organization") or "", headers.get("openai-project") or "")
    if not credential and not any(scope):
        return "anonymous"
    material = "\x00".join(("flightcache-tenant", credential, *scope)).encode("utf-8", "replace")
    return hashlib.sha256(material).hexdigest()[:24]


def _canonical_body(body: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in body.items():
        if name in DROPPED_FIELDS or value is None:
            continue
        if name in _NUMERIC and isinstance(value, float) and value.is_integer():
            value = int(value)
        out[name] = value
    return out


def request_digest(path: str, body: Mapping[str, Any], tenant: str) -> str:
    """The cache key of a request: 32 hex digits of SHA-256 over route, tenant and body."""
    material = {"v": KEY_VERSION, "route": path, "tenant": tenant, "body": _canonical_body(body)}
    return hashlib.sha256(orjson.dumps(material, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


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
        raise BadRequest("you must provide a model parameter", param="model")
    for name, value in body.items():
        if value is None:
            continue
        shape = _SHAPES.get(name)
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
    if route == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array.", param="messages")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise BadRequest(
                "Each item of 'messages' must be an object with a string 'role'.",
                param="messages",
            )
    elif route == "completions":
        if "prompt" in body and not isinstance(body["prompt"], (str, list)):
            raise BadRequest("'prompt' must be a string or an array.", param="prompt")
    elif not isinstance(body.get("input"), (str, list)):
        raise BadRequest("'input' must be a string or an array.", param="input")
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n < 1:
        raise BadRequest("'n' must be at least 1.", param="n")


def _cache_control(headers: Mapping[str, str]) -> set[str]:
    value = headers.get("cache-control") or ""
    return {part.strip().lower().split("=", 1)[0] for part in value.split(",") if part.strip()}


def _ttl_header(headers: Mapping[str, str]) -> float | None:
    text = headers.get(TTL_HEADER)
    if text is None:
        return None
    try:
        ttl = float(text.strip())
    except ValueError:
        ttl = math.nan
    if not math.isfinite(ttl) or not 0 <= ttl <= MAX_TTL:
        raise BadRequest(
            f"Invalid X-Flightcache-TTL header {text[:40]!r}: expected a number of seconds "
            f"from 0 to {MAX_TTL:g} (0: do not store).",
            code="invalid_header",
        )
    return ttl


def _coalesce_header(headers: Mapping[str, str]) -> bool:
    text = (headers.get(COALESCE_HEADER) or "on").strip().lower()
    if text in ("on", "true", "1", "yes"):
        return True
    if text in ("off", "false", "0", "no"):
        return False
    raise BadRequest(
        f"Invalid X-Flightcache-Coalesce header {text[:40]!r}: expected 'on' or 'off'.",
        code="invalid_header",
    )


def plan_request(path: str, raw: bytes, headers: Mapping[str, str], policy: Policy) -> Plan:
    """Decide one request to a cached route; raises :class:`BadRequest`."""
    route = ROUTES[path]
    body = _parse_body(raw)
    _check_shapes(route, body)
    coalesce = _coalesce_header(headers)
    header_ttl = _ttl_header(headers)
    directives = _cache_control(headers)
    stream = route != "embeddings" and bool(body.get("stream"))
    options = body.get("stream_options")
    include_usage = stream and isinstance(options, dict) and bool(options.get("include_usage"))
    temperature = body.get("temperature")
    sampled = (
        route != "embeddings"
        and body.get("seed") is None
        and (temperature is None or temperature > 0)
    )
    best_of = body.get("best_of")
    # best_of > 1 cannot be streamed by the API: such requests are proxied as they are.
    bypass = not coalesce or (route == "completions" and isinstance(best_of, int) and best_of > 1)
    refresh = "no-cache" in directives
    ttl = policy.ttl if header_ttl is None else header_ttl
    store = True
    if sampled and not policy.cache_sampled:
        store, refresh = False, True  # coalesced while in flight, never from storage
    if "no-store" in directives or ttl == 0:
        store = False
        ttl = ttl or policy.ttl
    upstream_body = dict(body)
    if route != "embeddings":
        upstream_body["stream"] = True
        upstream_body["stream_options"] = {"include_usage": True}
    return Plan(
        route=route,
        path=path,
        body=body,
        upstream_body=upstream_body,
        stream=stream,
        include_usage=include_usage,
        sampled=sampled,
        bypass=bypass,
        refresh=refresh,
        ttl=ttl,
        store=store,
        key=request_digest(path, body, tenant_of(headers, policy)),
    )
