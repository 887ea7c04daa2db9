"""What an SDK wrapper does with one ``create`` call, whatever the SDK: the engine behind
``flightcache.integrations.openai`` and ``flightcache.integrations.anthropic``.

A call is decided by the gateway's rules (``_rules``) from its JSON body and headers: the
client's credentials make the tenant, ``extra_headers`` may carry the gateway's request
headers (``Cache-Control``, ``X-Flightcache-TTL``, ``X-Flightcache-Coalesce``; they are not
sent upstream). A call that must not be shared goes to the SDK as it is. Every other call
is one ``fc.stream`` flight whose owner asks the SDK for a **stream** (chat and text
completions with usage), whatever the caller asked, and stores its events as JSON (after a
stamp, see ``_answers``), so a call and its streaming twin share one flight, as in the
gateway. A stream caller gets the events rebuilt as the SDK's own types, live; a non-stream
caller gets the answer they add up to, as the SDK's type. An error reaches every caller of
the flight (in another process, rebuilt as the SDK's exception from its status, body and
headers) and is never stored.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .._cache import FlightCache
from .._errors import BackendUnavailable, ConfigError, RemoteError
from .._sync import FlightCacheSync
from ._answers import (
    age_of,
    answer_of,
    ended,
    failure,
    for_client,
    is_stamp,
    mark_cached,
    stamped,
    stamped_sync,
    usage_of,
)
from ._rules import OWN_HEADERS, PATHS, Policy, Route, cache_rules, request_digest, tenant_of
from ._sdk import Sdk, Unkeyable
from ._streams import AsyncCoalescedStream, CoalescedStream

__all__ = ["AsyncCoalescedStream", "CoalescedStream", "Coalescer", "Endpoint", "Outcome"]

log = logging.getLogger("flightcache.integrations")

REQUEST_OPTIONS = frozenset({"extra_headers", "extra_query", "extra_body", "timeout"})
_KEY_HEADERS = frozenset(
    {"authorization", "api-key", "x-api-key", "openai-organization", "openai-project"}
    | {"anthropic-version", "anthropic-beta"}
)


@dataclass(frozen=True)
class Endpoint:
    """One coalesced ``create``: its route and the SDK types of its answer and events."""

    route: Route
    answer: Any  # the non-stream answer's type (ChatCompletion, Response, Message, ...)
    event: Any  # a stream event's type (ChatCompletionChunk, ResponseStreamEvent, ...)


@dataclass(frozen=True)
class Outcome:
    """How one wrapped call was answered, for ``coalesce(..., on_outcome=...)``.

    ``cache`` is the gateway's ``X-Cache``: ``HIT`` (from the cache), ``MISS`` (this call
    made the upstream call), ``COALESCED`` (it joined another call's flight, in this process
    or another) or ``BYPASS`` (sent to the SDK as it is). ``age``: seconds since a stored
    answer began (HIT only). The tokens are the upstream's usage of the answer, when it says;
    on HIT and COALESCED they were not bought again (``saved``).
    """

    route: Route
    key: str | None
    cache: str
    age: float | None = None
    model: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def saved(self) -> bool:
        return self.cache in ("HIT", "COALESCED")


OnOutcome = Callable[[Outcome], None]


@dataclass(frozen=True)
class _Call:
    """One call, decided: its key, rules, and the keyword arguments for each way to the SDK."""

    key: str
    stream: bool
    include_usage: bool
    bypass: str | None
    refresh: bool
    max_age: float | None
    ttl: float
    store: bool
    direct: dict[str, Any]  # the call as the caller made it (our own headers removed)
    upstream: dict[str, Any]  # what a flight's owner asks the SDK for: a stream


def _lower_headers(sdk: Sdk, headers: Any) -> dict[str, str]:
    if not isinstance(headers, Mapping):
        return {}
    return {str(k).lower(): str(v) for k, v in headers.items() if sdk.is_given(v) and v is not None}


class Coalescer:
    """The settings of one wrapped client and the way its calls go through the cache."""

    def __init__(
        self,
        client: Any,
        fc: FlightCache | FlightCacheSync,
        sdk: Sdk,
        *,
        policy: Policy,
        lease: float | None,
        timeout: float | None,
        on_outcome: OnOutcome | None,
    ) -> None:
        self.client = client
        self.fc = fc
        self.sdk = sdk
        self.policy = policy
        self.lease = lease
        self.timeout = timeout
        self.on_outcome = on_outcome

    # -- deciding a call ------------------------------------------------------------------

    def _headers(self, given: Any) -> dict[str, str]:
        """The headers that make the tenant and the key's variant (lower-case names)."""
        client = self.client
        headers: dict[str, str] = {}
        try:
            headers |= _lower_headers(self.sdk, client.default_headers)
            headers |= _lower_headers(self.sdk, client.auth_headers)
        except Exception:  # an SDK whose credentials cannot be read here: no tenant then
            log.debug("the client's headers could not be read", exc_info=True)
        headers = {k: v for k, v in headers.items() if k in _KEY_HEADERS}
        return headers | _lower_headers(self.sdk, given)

    def decide(self, endpoint: Endpoint, kwargs: Mapping[str, Any]) -> _Call:
        route = endpoint.route
        sdk = self.sdk
        options = {name: value for name, value in kwargs.items() if name in REQUEST_OPTIONS}
        try:
            params = {
                name: sdk.jsonable(value)
                for name, value in kwargs.items()
                if name not in REQUEST_OPTIONS and sdk.is_given(value)
            }
            extra_body = options.get("extra_body")
            extra = sdk.jsonable(extra_body) if isinstance(extra_body, Mapping) else {}
        except Unkeyable:  # an argument with no JSON form: no key, the SDK's call as it is
            return _Call("", False, False, "unkeyable", False, None, 0.0, False, dict(kwargs), {})
        given_headers = options.get("extra_headers")
        headers = self._headers(given_headers)
        if isinstance(given_headers, Mapping):
            kept = {k: v for k, v in given_headers.items() if str(k).lower() not in OWN_HEADERS}
            options["extra_headers"] = kept
        body = {**params, **extra}
        rules = cache_rules(route, body, headers, self.policy)
        stream = route != "embeddings" and bool(body.get("stream"))
        stream_options = body.get("stream_options")
        include_usage = (
            stream
            and isinstance(stream_options, dict)
            and bool(stream_options.get("include_usage"))
        )
        upstream = {**params, **options}
        if route == "chat" or route == "completions":
            upstream |= {"stream": True, "stream_options": {"include_usage": True}}
        elif route != "embeddings":
            upstream["stream"] = True
        direct = {**{k: v for k, v in kwargs.items() if k not in options}, **options}
        return _Call(
            key=request_digest(PATHS[route], body, tenant_of(headers, self.policy), headers),
            stream=stream,
            include_usage=include_usage,
            bypass=rules.bypass,
            refresh=rules.refresh,
            max_age=rules.max_age,
            ttl=rules.ttl,
            store=rules.store,
            direct=direct,
            upstream=upstream,
        )

    # -- the owner's upstream call ------------------------------------------------------------

    def _event(self, endpoint: Endpoint, event: Any, seen_end: bool) -> tuple[Any, bool]:
        data = self.sdk.dump(event)
        if isinstance(data, dict):
            data.pop("obfuscation", None)  # random padding, different in every run
        failed = failure(endpoint.route, data)
        if failed is not None:  # an error event in the middle of the stream: never stored
            raise self.sdk.status_error(self.client, *failed)
        return data, seen_end or _ends(endpoint.route, data)

    def _unfinished(self) -> Exception:
        body = {"error": {"message": "the upstream's stream ended before its end", "code": "cut"}}
        return self.sdk.status_error(self.client, 502, body)

    def async_producer(
        self, endpoint: Endpoint, create: Callable[..., Any], call: _Call
    ) -> Callable[[], AsyncIterator[Any]]:
        async def events() -> AsyncIterator[Any]:
            try:
                result = await create(**call.upstream)
                if endpoint.route == "embeddings":
                    yield self.sdk.dump(result)
                    return
                seen_end = False
                async for event in result:
                    data, seen_end = self._event(endpoint, event, seen_end)
                    yield data
                if not seen_end:
                    raise self._unfinished()
            except Exception as exc:
                self.sdk.mark(exc)
                raise

        return lambda: stamped(events())

    def sync_producer(
        self, endpoint: Endpoint, create: Callable[..., Any], call: _Call
    ) -> Callable[[], Iterator[Any]]:
        def events() -> Iterator[Any]:
            try:
                result = create(**call.upstream)
                if endpoint.route == "embeddings":
                    yield self.sdk.dump(result)
                    return
                seen_end = False
                for event in result:
                    data, seen_end = self._event(endpoint, event, seen_end)
                    yield data
                if not seen_end:
                    raise self._unfinished()
            except Exception as exc:
                self.sdk.mark(exc)
                raise

        return lambda: stamped_sync(events())

    # -- answers ------------------------------------------------------------------------------

    def error(self, exc: BaseException) -> BaseException:
        """What a caller gets for a flight's error: the SDK's own exception."""
        if isinstance(exc, RemoteError):
            return self.sdk.rebuild(self.client, exc) or exc
        return exc

    def report(self, endpoint: Endpoint, key: str | None, cache: str, **fields: Any) -> None:
        if self.on_outcome is None:
            return
        try:
            self.on_outcome(Outcome(endpoint.route, key, cache, **fields))
        except Exception:
            log.exception("on_outcome raised; the call's answer is not affected")

    def finish(
        self, endpoint: Endpoint, call: _Call, source: str, age: float | None, chunks: list[Any]
    ) -> None:
        usage = usage_of(endpoint.route, chunks)
        tokens: dict[str, Any] = {}
        if usage is not None:
            tokens = {
                "model": usage.model,
                "prompt_tokens": usage.prompt,
                "completion_tokens": usage.completion,
            }
        self.report(endpoint, call.key, source, age=age if source == "HIT" else None, **tokens)

    def answer(self, endpoint: Endpoint, source: str, chunks: list[Any]) -> Any:
        answer = answer_of(endpoint.route, chunks)
        if source == "HIT":
            answer = mark_cached(endpoint.route, answer)
        return self.sdk.build(endpoint.answer, answer)

    def convert(self, endpoint: Endpoint, call: _Call, hit: bool) -> Callable[[Any], Any]:
        event_type = endpoint.event

        def convert(chunk: Any) -> Any:
            out = for_client(endpoint.route, chunk, call.include_usage, hit)
            return None if out is None else self.sdk.build(event_type, out)

        return convert

    def _stale(self, call: _Call, source: str, age: float | None, refresh: bool) -> bool:
        return (
            source == "HIT" and call.max_age is not None and (age or 0.0) > call.max_age
        ) and not refresh

    # -- the two doors --------------------------------------------------------------------

    async def acall(self, endpoint: Endpoint, create: Callable[..., Any], kwargs: Any) -> Any:
        fc = self.fc
        if not isinstance(fc, FlightCache):
            raise ConfigError("an async client needs a FlightCache (FlightCacheSync blocks)")
        call = self.decide(endpoint, kwargs)
        if call.bypass is not None:
            self.report(endpoint, None, "BYPASS")
            return await create(**call.direct)
        refresh = call.refresh
        while True:
            flight = fc.stream(
                call.key,
                self.async_producer(endpoint, create, call),
                ttl=call.ttl,
                lease=self.lease,
                timeout=self.timeout,
                refresh=refresh,
                store=call.store,
            )
            chunks: list[Any] = []
            age: float | None = None
            try:
                source = await flight.opened()
                async for chunk in flight:
                    chunks.append(chunk)
                    if is_stamp(chunk):
                        age = age_of(chunk)
                    elif call.stream:
                        break  # the rest comes as the caller iterates
            except BackendUnavailable as exc:
                await flight.aclose()
                log.warning("cache server unavailable (%s); calling the SDK directly", exc)
                self.report(endpoint, call.key, "BYPASS")
                return await create(**call.direct)
            except Exception as exc:
                await flight.aclose()
                raise self.error(exc) from None
            if self._stale(call, source, age, refresh):
                await flight.aclose()
                refresh = True
                continue
            break
        if call.stream:
            return AsyncCoalescedStream(self, endpoint, call, flight, source, age, chunks)
        await flight.aclose()
        self.finish(endpoint, call, source, age, chunks)
        return self.answer(endpoint, source, chunks)

    def call(self, endpoint: Endpoint, create: Callable[..., Any], kwargs: Any) -> Any:
        fc = self.fc
        if not isinstance(fc, FlightCacheSync):
            raise ConfigError("a sync client needs a FlightCacheSync (a FlightCache is async)")
        call = self.decide(endpoint, kwargs)
        if call.bypass is not None:
            self.report(endpoint, None, "BYPASS")
            return create(**call.direct)
        refresh = call.refresh
        while True:
            flight = fc.stream(
                call.key,
                self.sync_producer(endpoint, create, call),
                ttl=call.ttl,
                lease=self.lease,
                timeout=self.timeout,
                refresh=refresh,
                store=call.store,
            )
            chunks: list[Any] = []
            age: float | None = None
            try:
                source = flight.opened()
                for chunk in flight:
                    chunks.append(chunk)
                    if is_stamp(chunk):
                        age = age_of(chunk)
                    elif call.stream:
                        break
            except BackendUnavailable as exc:
                flight.close()
                log.warning("cache server unavailable (%s); calling the SDK directly", exc)
                self.report(endpoint, call.key, "BYPASS")
                return create(**call.direct)
            except Exception as exc:
                flight.close()
                raise self.error(exc) from None
            if self._stale(call, source, age, refresh):
                flight.close()
                refresh = True
                continue
            break
        if call.stream:
            return CoalescedStream(self, endpoint, call, flight, source, age, chunks)
        flight.close()
        self.finish(endpoint, call, source, age, chunks)
        return self.answer(endpoint, source, chunks)


def _ends(route: Route, data: Any) -> bool:
    """Whether ``data`` shows a complete stream: the terminal event of the Responses and
    Messages APIs; on the completion routes a finish reason or the usage chunk."""
    if route in ("responses", "messages"):
        return ended(route, data)
    if not isinstance(data, dict):
        return False
    if data.get("usage") is not None:
        return True
    choices = data.get("choices") or []
    return any(isinstance(c, dict) and c.get("finish_reason") for c in choices)
