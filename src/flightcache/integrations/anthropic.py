"""``coalesce(client, fc)``: an Anthropic SDK client whose answers are shared across processes.

::

    from anthropic import AsyncAnthropic
    from flightcache import FlightCache
    from flightcache.integrations.anthropic import coalesce

    client = coalesce(AsyncAnthropic(), FlightCache("redis://127.0.0.1:6379/0", namespace="ai"))
    message = await client.messages.create(model=..., max_tokens=1024, messages=[...])

The wrapped client is used exactly like the client. ``messages.create``, stream and not, is
coalesced and cached with the gateway's rules (docs/integrations.md): identical calls in
every process sharing the server make one upstream call and get the SDK's own types back
(``Message``, and ``RawMessageStreamEvent`` events). The ``anthropic-version`` and
``anthropic-beta`` headers are part of the key. Everything else (``messages.stream()``,
``messages.count_tokens``, ``beta``, ``with_raw_response``, ...) is the client's own,
uncached. ``anthropic.Anthropic`` takes a :class:`flightcache.FlightCacheSync`,
``anthropic.AsyncAnthropic`` a :class:`flightcache.FlightCache`.

Needs the ``anthropic`` extra: ``pip install 'flightcache[anthropic]'``.
"""

from __future__ import annotations

from typing import Any, overload

import anthropic
from anthropic.types import Message, RawMessageStreamEvent

from .._cache import FlightCache
from .._sync import FlightCacheSync
from ._core import AsyncCoalescedStream, CoalescedStream, Coalescer, Endpoint, OnOutcome, Outcome
from ._proxy import coalesce_client
from ._rules import Policy
from ._sdk import Sdk

__all__ = ["ENDPOINTS", "AsyncCoalescedStream", "CoalescedStream", "Outcome", "coalesce"]

ENDPOINTS: dict[tuple[str, ...], Endpoint] = {
    ("messages",): Endpoint("messages", Message, RawMessageStreamEvent),
}
SDK = Sdk(anthropic)


@overload
def coalesce(
    client: anthropic.AsyncAnthropic,
    fc: FlightCache,
    *,
    ttl: float | None = ...,
    lease: float | None = ...,
    timeout: float | None = ...,
    cache_sampled: bool = ...,
    share_across_keys: bool = ...,
    on_outcome: OnOutcome | None = ...,
) -> anthropic.AsyncAnthropic: ...


@overload
def coalesce(
    client: anthropic.Anthropic,
    fc: FlightCacheSync,
    *,
    ttl: float | None = ...,
    lease: float | None = ...,
    timeout: float | None = ...,
    cache_sampled: bool = ...,
    share_across_keys: bool = ...,
    on_outcome: OnOutcome | None = ...,
) -> anthropic.Anthropic: ...


def coalesce(
    client: anthropic.Anthropic | anthropic.AsyncAnthropic,
    fc: FlightCache | FlightCacheSync,
    *,
    ttl: float | None = None,
    lease: float | None = None,
    timeout: float | None = None,
    cache_sampled: bool = False,
    share_across_keys: bool = False,
    on_outcome: OnOutcome | None = None,
) -> Any:
    """``client``, with ``messages.create`` coalesced and cached through ``fc``.

    The arguments are those of :func:`flightcache.integrations.openai.coalesce`. The
    Messages API samples unless ``temperature`` is 0, so its answers are coalesced while in
    flight and stored only with ``cache_sampled=True`` (or a ``temperature: 0`` request).
    """

    def coalescer(target: Any) -> Coalescer:
        policy = Policy(
            share_across_keys=share_across_keys,
            cache_sampled=cache_sampled,
            ttl=fc.ttl if ttl is None else ttl,
        )
        return Coalescer(
            target, fc, SDK, policy=policy, lease=lease, timeout=timeout, on_outcome=on_outcome
        )

    is_async = isinstance(client, anthropic.AsyncAnthropic)
    return coalesce_client(client, fc, coalescer, ENDPOINTS, is_async=is_async)
