"""``coalesce(client, fc)``: an OpenAI SDK client whose answers are shared across processes.

::

    from openai import AsyncOpenAI
    from flightcache import FlightCache
    from flightcache.integrations.openai import coalesce

    client = coalesce(AsyncOpenAI(), FlightCache("redis://127.0.0.1:6379/0", namespace="ai"))
    answer = await client.chat.completions.create(model="gpt-4o-mini", messages=[...])

The wrapped client is used exactly like the client. ``chat.completions.create``,
``completions.create``, ``embeddings.create`` and ``responses.create``, stream and not, are
coalesced and cached with the gateway's rules (docs/integrations.md): identical calls in
every process sharing the server make one upstream call, and get the SDK's own types back
(``ChatCompletion``, ``ChatCompletionChunk`` events, ``Completion``,
``CreateEmbeddingResponse``, ``Response`` and its ``ResponseStreamEvent`` events).
Everything else (``models``, ``files``, ``with_raw_response``, the ``.parse()`` and
``.stream()`` helpers, ...) is the client's own, uncached. ``openai.OpenAI`` takes a
:class:`flightcache.FlightCacheSync`, ``openai.AsyncOpenAI`` a :class:`flightcache.FlightCache`.

Needs the ``openai`` extra: ``pip install 'flightcache[openai]'``.
"""

from __future__ import annotations

from typing import Any, overload

import openai
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from .._cache import FlightCache
from .._sync import FlightCacheSync
from ._core import AsyncCoalescedStream, CoalescedStream, Coalescer, Endpoint, OnOutcome, Outcome
from ._proxy import coalesce_client
from ._rules import Policy
from ._sdk import Sdk

__all__ = ["ENDPOINTS", "AsyncCoalescedStream", "CoalescedStream", "Outcome", "coalesce"]

ENDPOINTS: dict[tuple[str, ...], Endpoint] = {
    ("chat", "completions"): Endpoint("chat", ChatCompletion, ChatCompletionChunk),
    ("completions",): Endpoint("completions", Completion, Completion),
    ("embeddings",): Endpoint("embeddings", CreateEmbeddingResponse, None),
    ("responses",): Endpoint("responses", Response, ResponseStreamEvent),
}
SDK = Sdk(openai)


@overload
def coalesce(
    client: openai.AsyncOpenAI,
    fc: FlightCache,
    *,
    ttl: float | None = ...,
    lease: float | None = ...,
    timeout: float | None = ...,
    cache_sampled: bool = ...,
    share_across_keys: bool = ...,
    on_outcome: OnOutcome | None = ...,
) -> openai.AsyncOpenAI: ...


@overload
def coalesce(
    client: openai.OpenAI,
    fc: FlightCacheSync,
    *,
    ttl: float | None = ...,
    lease: float | None = ...,
    timeout: float | None = ...,
    cache_sampled: bool = ...,
    share_across_keys: bool = ...,
    on_outcome: OnOutcome | None = ...,
) -> openai.OpenAI: ...


def coalesce(
    client: openai.OpenAI | openai.AsyncOpenAI,
    fc: FlightCache | FlightCacheSync,
    *,
    ttl: float | None = None,
    lease: float | None = None,
    timeout: float | None = None,
    cache_sampled: bool = False,
    share_across_keys: bool = False,
    on_outcome: OnOutcome | None = None,
) -> Any:
    """``client``, with its model calls coalesced and cached through ``fc``.

    ``ttl``: seconds an answer is stored (default: ``fc``'s). ``lease`` / ``timeout``: the
    flight's owner lease and the bound on one whole upstream answer (default: ``fc``'s).
    ``cache_sampled``: also store sampled answers (no ``seed``, ``temperature`` omitted or
    above 0); they are coalesced while in flight either way. ``share_across_keys``: one
    answer for every API key (else the key's digest is part of the cache key).
    ``on_outcome``: called with an :class:`Outcome` once each call is answered (HIT, MISS,
    COALESCED or BYPASS, the answer's age and tokens).
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

    is_async = isinstance(client, openai.AsyncOpenAI)
    return coalesce_client(client, fc, coalescer, ENDPOINTS, is_async=is_async)
