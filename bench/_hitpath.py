"""Phase 2: the hit path, in one process: what a cached read costs next to a raw GET.

The caches here have no near cache (``near_cache=False``): every hit is served by the
server, which is the path this phase is about (the near cache has a phase of its own).

Variants, all reading values already stored on the same server:

- ``raw``: ``redis.asyncio.Redis.from_url(url).get(key)``, the baseline;
- ``raw-fcpool``: the same GET through a client built with the pool settings flightcache
  uses (a diagnostic: it separates the driver's cost of those settings from the library's);
- ``get``: ``await fc.get(key)``;
- ``do``: ``await fc.do(key, loader)`` on a cached key (the loader must never run).

Each is measured sequentially (one coroutine) and with ``concurrency`` coroutines, each on a
key of its own. Rounds alternate the variants (rotated order), so drift and noise on a small
machine hit every variant alike; the ratio to raw GET is taken within each round. The
CPU time this process spends per operation (``time.process_time``) is reported too: it is
what the client side costs, and it is far less disturbed by other load on the machine than
wall-clock throughput.
"""

from __future__ import annotations

from typing import Any

from flightcache import FlightCache
from flightcache._backends.redis import RedisConnection
from flightcache._types import Stats

from ._rounds import MODES, PAYLOAD, Op, Reads, figures

VARIANTS = ("raw", "raw-fcpool", "get", "do")
LABELS = {
    "raw": "raw GET (redis.asyncio, from_url)",
    "raw-fcpool": "raw GET, flightcache's pool settings",
    "get": "fc.get(key)",
    "do": "fc.do(key, loader), cached",
}
NAMESPACE = "bench-hit"


def fc_pool_client(url: str) -> RedisConnection:
    """flightcache's own Redis connection (_redis.py), pool and all, for a plain GET."""
    return RedisConnection(url, stats=Stats(), client_name="bench-raw-fcpool")


async def run(
    url: str, *, rounds: int = 3, ops: int = 20_000, seconds: float = 1.2, concurrency: int = 64
) -> dict[str, Any]:
    raw_fc = fc_pool_client(url)
    fc = FlightCache(
        url, namespace=NAMESPACE, max_connections=max(64, concurrency), near_cache=False
    )
    async with Reads(url, "bench-raw", concurrency) as reads:
        try:
            await reads.store(fc)
            ops_by_variant: dict[str, Op] = {
                "raw": reads.raw_get,
                "raw-fcpool": lambda i: raw_fc.client.get(reads.raw_keys[i]),
                **reads.through(fc),
            }
            await reads.check_and_warm("hit path", ops_by_variant)
            stats_before = fc.stats
            rate, cpu_us = await reads.alternate(
                ops_by_variant, VARIANTS, rounds=rounds, budget=lambda name: (ops, seconds)
            )
            stats_after = fc.stats
        finally:
            await fc.aclose()
            await raw_fc.aclose()

    result: dict[str, Any] = {
        "config": {
            "rounds": rounds,
            "ops_per_measurement": ops,
            "seconds_per_measurement": seconds,
            "concurrency": concurrency,
            "value_bytes": len(PAYLOAD),
        },
        "fc_stats_delta": {
            k: stats_after[k] - stats_before.get(k, 0)
            for k in stats_after
            if stats_after[k] != stats_before.get(k, 0)
        },
    }
    for mode in MODES:
        result[mode] = {name: figures(rate, cpu_us, mode, name) for name in VARIANTS}
    return result
