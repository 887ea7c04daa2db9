"""The key and policy rules of a model request, shared by the gateway and the SDK wrappers.

One request to a model API (chat, text completions, embeddings, the Responses API, the
Messages API) is decided here, from its JSON body and its headers, whoever sends it: an
HTTP client of ``flightcache serve`` or a wrapped SDK client. Nothing here imports an SDK
or an HTTP stack.

**The key** is a digest of the route, the tenant and the canonical body: every field except
those that cannot change the output (``DROPPED_FIELDS``), with top-level ``null`` fields
dropped (the APIs treat them as absent) and integral floats of the numeric sampling
parameters written as integers (``temperature: 0.0`` is ``temperature: 0``). Key order and
whitespace do not matter. On the Messages API the ``anthropic-version`` and
``anthropic-beta`` headers count too (they change the answer's shape). The tenant is a
digest of the caller's credentials (``Authorization``, else ``api-key`` / ``x-api-key``,
with ``OpenAI-Organization`` and ``OpenAI-Project``), or ``*`` when answers are shared
across keys. Credentials are never stored nor logged.

**The policy**: a request whose output is sampled (no ``seed`` and ``temperature`` omitted
or above 0) is coalesced while in flight and stored only when ``Policy.cache_sampled``.
Some requests must not be shared at all and go upstream as they are (``unshareable``): a
Responses request in background mode, one that continues stored state
(``previous_response_id`` while ``store`` is not false, a ``conversation``), or whose input
refers to items held by the server (``item_reference``, a tool output whose call is not in
the request); a Messages request naming a ``container``; a completion with ``best_of > 1``.
Request headers adjust one request: ``Cache-Control: no-cache`` (skip the stored answer),
``no-store`` (do not store), ``max-age=N`` (a stored answer older than N seconds does not
count), ``X-Flightcache-TTL: <seconds>``, ``X-Flightcache-Coalesce: off`` (no flight).
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
    "OWN_HEADERS",
    "ROUTES",
    "TTL_HEADER",
    "BadHeader",
    "CacheRules",
    "Policy",
    "Route",
    "cache_rules",
    "is_sampled",
    "request_digest",
    "tenant_label",
    "tenant_of",
    "unshareable",
]

Route = Literal["chat", "completions", "embeddings", "responses", "messages"]
ROUTES: dict[str, Route] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}
PATHS: dict[Route, str] = {route: path for path, route in ROUTES.items()}

COALESCE_HEADER = "x-flightcache-coalesce"
TTL_HEADER = "x-flightcache-ttl"
OWN_HEADERS = frozenset({COALESCE_HEADER, TTL_HEADER, "cache-control"})
MAX_TTL = 365 * 24 * 3600.0
KEY_VERSION = 1

DROPPED_FIELDS = frozenset(
    {"stream", "stream_options", "user", "store", "metadata", "service_tier"}
    | {"safety_identifier", "prompt_cache_key", "prompt_cache_retention", "background"}
)
_NUMERIC = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty")
# Headers of the Messages API that change the answer (its version and beta features).
_VARIANT_HEADERS = ("anthropic-version", "anthropic-beta")
# Responses input items that answer a call; one whose call is not in the input refers to
# state held by the server (the call lives in a stored response).
_CALL_OUTPUTS = {
    "function_call_output": "function_call",
    "custom_tool_call_output": "custom_tool_call",
    "computer_call_output": "computer_call",
    "local_shell_call_output": "local_shell_call",
    "shell_call_output": "shell_call",
    "apply_patch_call_output": "apply_patch_call",
}


class BadHeader(ValueError):
    """A flightcache request header with a value it cannot take."""

    code = "invalid_header"


@dataclass(frozen=True)
class Policy:
    """The settings that decide keys and storage (a gateway's, or a wrapper's)."""

    share_across_keys: bool = False
    cache_sampled: bool = True
    ttl: float = 3600.0


@dataclass(frozen=True)
class CacheRules:
    """What one request's headers and body decide about its flight."""

    bypass: str | None  # why it goes upstream as it is, or None
    refresh: bool  # a stored answer does not count
    max_age: float | None  # a stored answer older than this does not count
    ttl: float  # seconds the answer is stored
    store: bool  # False: coalesced while in flight, never stored
    sampled: bool


def tenant_of(headers: Mapping[str, str], policy: Policy) -> str:
    """A digest of the caller's credentials (never the credentials), or ``*`` when shared.

    ``headers`` must have lower-case names (Starlette's do).
    """
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


def tenant_label(headers: Mapping[str, str]) -> str:
    """The caller's own tenant digest, short, for metric labels (even when answers are
    shared across keys, the savings are the caller's)."""
    tenant = tenant_of(headers, Policy())
    return tenant if tenant == "anonymous" else tenant[:12]


def _canonical_body(body: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in body.items():
        if name in DROPPED_FIELDS or value is None:
            continue
        if name in _NUMERIC and isinstance(value, float) and value.is_integer():
            value = int(value)
        out[name] = value
    return out


def request_digest(
    path: str, body: Mapping[str, Any], tenant: str, headers: Mapping[str, str] | None = None
) -> str:
    """The cache key of a request: 32 hex digits of SHA-256 over route, tenant and body
    (and, on the Messages API, the headers that select its version and beta features)."""
    material: dict[str, Any] = {
        "v": KEY_VERSION,
        "route": path,
        "tenant": tenant,
        "body": _canonical_body(body),
    }
    if ROUTES.get(path) == "messages" and headers:
        variant = {name: headers[name] for name in _VARIANT_HEADERS if headers.get(name)}
        if variant:
            material["variant"] = variant
    return hashlib.sha256(orjson.dumps(material, option=orjson.OPT_SORT_KEYS)).hexdigest()[:32]


def is_sampled(route: Route, body: Mapping[str, Any]) -> bool:
    """Asked twice, would the upstream answer differently? (no seed, temperature not 0)"""
    if route == "embeddings" or body.get("seed") is not None:
        return False
    temperature = body.get("temperature")
    if temperature is None:
        return True  # every one of these APIs then samples at 1
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        return True
    return bool(temperature > 0)


def _refers_to_stored_items(items: Any) -> bool:
    if not isinstance(items, list):
        return False
    calls = {
        (item.get("type"), item.get("call_id"))
        for item in items
        if isinstance(item, dict) and item.get("call_id") is not None
    }
    for item in items:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "item_reference":
            return True
        call = _CALL_OUTPUTS.get(str(kind))
        if call is not None and (call, item.get("call_id")) not in calls:
            return True
    return False


def unshareable(route: Route, body: Mapping[str, Any]) -> str | None:
    """Why this request must go upstream as it is (no flight, no storage), or None."""
    if route == "completions":
        best_of = body.get("best_of")
        if isinstance(best_of, int) and best_of > 1:
            return "best_of"  # the API cannot stream it
    elif route == "responses":
        if body.get("background"):
            return "background"
        if body.get("conversation") is not None:
            return "conversation"
        if body.get("previous_response_id") is not None and body.get("store") is not False:
            return "previous_response_id"
        if _refers_to_stored_items(body.get("input")):
            return "stored_items"
    elif route == "messages" and body.get("container") is not None:
        return "container"
    return None


def _cache_control(headers: Mapping[str, str]) -> dict[str, str]:
    value = headers.get("cache-control") or ""
    directives: dict[str, str] = {}
    for part in value.split(","):
        name, _, argument = part.strip().partition("=")
        if name:
            directives[name.strip().lower()] = argument.strip().strip('"')
    return directives


def _max_age(directives: Mapping[str, str]) -> float | None:
    if "max-age" not in directives:
        return None
    text = directives["max-age"]
    if not text.isdigit():
        raise BadHeader(
            f"Invalid Cache-Control max-age {text[:40]!r}: expected a whole number of seconds."
        )
    return float(text)


def _ttl_header(headers: Mapping[str, str]) -> float | None:
    text = headers.get(TTL_HEADER)
    if text is None:
        return None
    try:
        ttl = float(text.strip())
    except ValueError:
        ttl = math.nan
    if not math.isfinite(ttl) or not 0 <= ttl <= MAX_TTL:
        raise BadHeader(
            f"Invalid X-Flightcache-TTL header {text[:40]!r}: expected a number of seconds "
            f"from 0 to {MAX_TTL:g} (0: do not store)."
        )
    return ttl


def _coalesce_header(headers: Mapping[str, str]) -> bool:
    text = (headers.get(COALESCE_HEADER) or "on").strip().lower()
    if text in ("on", "true", "1", "yes"):
        return True
    if text in ("off", "false", "0", "no"):
        return False
    raise BadHeader(f"Invalid X-Flightcache-Coalesce header {text[:40]!r}: expected 'on' or 'off'.")


def cache_rules(
    route: Route, body: Mapping[str, Any], headers: Mapping[str, str], policy: Policy
) -> CacheRules:
    """Decide one request's flight from its body and headers (lower-case names); raises
    :class:`BadHeader`."""
    coalesce = _coalesce_header(headers)
    header_ttl = _ttl_header(headers)
    directives = _cache_control(headers)
    max_age = _max_age(directives)
    sampled = is_sampled(route, body)
    bypass = "opted_out" if not coalesce else unshareable(route, body)
    refresh = "no-cache" in directives or max_age == 0
    ttl = policy.ttl if header_ttl is None else header_ttl
    store = True
    if sampled and not policy.cache_sampled:
        store, refresh = False, True  # coalesced while in flight, never from storage
    if "no-store" in directives or ttl == 0:
        store = False
        ttl = ttl or policy.ttl
    return CacheRules(
        bypass=bypass,
        refresh=refresh,
        max_age=None if refresh else max_age,
        ttl=ttl,
        store=store,
        sampled=sampled,
    )
