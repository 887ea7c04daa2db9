"""Phase 4: the near cache: hits served without a round trip, invalidation, memory.

- Hits/s: ``fc.get`` and ``fc.do`` on cached keys through a cache with a near cache (its
  default lease) next to the same calls through a cache without one (``near_cache=False``:
  every hit is a round trip) and next to a raw redis-py GET, in alternating rounds as in the
  hit-path phase, sequentially and with ``concurrency`` coroutines on as many keys. The ratio
  to each baseline is taken within a round; the median over rounds is reported.
- Invalidation: ``nodes`` worker processes (``python -m bench._near_worker``), each a live
  node holding the key in its near cache; this process is one more node and replaces
  (``fc.set``) and then deletes (``fc.invalidate``) the key, over and over. After each call
  returns, every worker reads the key once: a worker that still sees the old value is a
  stale read. Baseline, same run: ``invalidate`` in a namespace where no other node lives.
- Memory: ``entries`` keys with a value of about 100 bytes read into a near cache through
  ``fc.get``; the Python memory they hold is what ``tracemalloc`` sees released when the
  near cache is cleared, divided by the entries; ``sys.getsizeof`` of one entry's objects
  splits it into the value, the digest, the lease tuple and the rest (the ordered dict).
"""

from __future__ import annotations

import asyncio
import gc
import math
import sys
import time
import tracemalloc
import uuid
from collections import Counter
from typing import Any

import redis.asyncio as aioredis

from flightcache import FlightCache

from . import _orders
from ._rounds import MODES, PAYLOAD, Reads, figures, ratio
from ._util import median, summary

VARIANTS = ("raw", "get", "do", "get-near", "do-near")
LABELS = {
    "raw": "raw GET (redis.asyncio, from_url)",
    "get": "fc.get, near_cache=False (Redis-served)",
    "do": "fc.do, near_cache=False (Redis-served)",
    "get-near": "fc.get, near cache",
    "do-near": "fc.do, near cache",
}
NEAR_OF = {"get-near": "get", "do-near": "do"}
ASK_TIMEOUT_S = 10.0


async def _hits(
    url: str,
    run_id: str,
    *,
    rounds: int,
    redis_budget: tuple[int, float],
    near_budget: tuple[int, float],
    concurrency: int = 64,
) -> dict[str, Any]:
    namespace = f"bench-near-hit-{run_id}"
    far = FlightCache(url, namespace=namespace, near_cache=False, max_connections=concurrency)
    near = FlightCache(url, namespace=namespace, max_connections=concurrency)
    async with Reads(url, f"bench-near-raw:{run_id}", concurrency) as reads:
        try:
            await reads.store(far)
            ops = {"raw": reads.raw_get, **reads.through(far), **reads.through(near, "-near")}
            await reads.check_and_warm("near-cache hits", ops)
            near_l1 = near._near  # the bench looks inside: near-cache hits and misses
            assert near_l1 is not None
            l1_before = (near_l1.hits, near_l1.misses)
            rate, cpu_us = await reads.alternate(
                ops,
                VARIANTS,
                rounds=rounds,
                budget=lambda name: near_budget if name in NEAR_OF else redis_budget,
            )
            l1_hits, l1_misses = near_l1.hits - l1_before[0], near_l1.misses - l1_before[1]
        finally:
            await near.aclose()
            await far.aclose()

    result: dict[str, Any] = {
        "config": {
            "rounds": rounds,
            "redis_ops_per_measurement": redis_budget[0],
            "redis_seconds_per_measurement": redis_budget[1],
            "near_ops_per_measurement": near_budget[0],
            "near_seconds_per_measurement": near_budget[1],
            "concurrency": concurrency,
            "value_bytes": len(PAYLOAD),
            "near_lease_s": near.near_lease,
        },
        "near_hit_ratio": l1_hits / (l1_hits + l1_misses) if l1_hits + l1_misses else math.nan,
        "near_misses": l1_misses,
    }
    for mode in MODES:
        rows: dict[str, Any] = {}
        for name in VARIANTS:
            rows[name] = figures(rate, cpu_us, mode, name)
            far_name = NEAR_OF.get(name)
            rows[name]["ratio_to_redis_served"] = (
                ratio(rate[mode][name], rate[mode][far_name]) if far_name else math.nan
            )
        result[mode] = rows
    return result


def _value(i: int, kind: str) -> dict[str, Any]:
    return {"round": i, "kind": kind, "text": "an answer held in four near caches"}


async def _invalidation(
    url: str, run_id: str, *, nodes: int, rounds: int, seconds: float
) -> dict[str, Any]:
    namespace = f"bench-inval-{run_id}"
    fc = FlightCache(url, namespace=namespace)  # one more node: the one that writes
    alone = FlightCache(url, namespace=f"{namespace}-alone")  # baseline: no other node
    key = "inval:key"
    timings: dict[str, list[float]] = {"set": [], "invalidate": [], "alone": []}
    how: dict[str, Counter[str]] = {name: Counter() for name in timings}
    waited_for: dict[str, Counter[int]] = {"set": Counter(), "invalidate": Counter()}
    held: dict[str, list[int]] = {"set": [], "invalidate": []}
    stale = probes = near_served_after = 0
    try:
        async with _orders.started(nodes, url, namespace, module="bench._near_worker") as workers:
            live = await fc.nodes()

            async def read_all() -> list[dict[str, Any]]:
                return list(
                    await asyncio.gather(
                        *(w.ask({"op": "read", "key": key}, ASK_TIMEOUT_S) for w in workers)
                    )
                )

            async def timed(name: str, call: Any) -> None:
                t0 = time.perf_counter()
                outcome = await call
                timings[name].append((time.perf_counter() - t0) * 1000)
                how[name][outcome.how] += 1
                if name in waited_for:
                    waited_for[name][outcome.nodes] += 1

            deadline = time.perf_counter() + seconds
            done = 0
            while done < rounds and time.perf_counter() < deadline:
                first, second = _value(done, "first"), _value(done, "second")
                await fc.set(key, first)  # not timed: what the workers hold before the set
                reads = await read_all()
                stale += sum(r["value"] != first for r in reads)
                held["set"].append(sum(r["held"] for r in reads))
                await timed("set", fc.set(key, second))
                reads = await read_all()
                stale += sum(r["value"] != second for r in reads)
                near_served_after += sum(r["near"] for r in reads)
                held["invalidate"].append(sum(r["held"] for r in reads))
                await timed("invalidate", fc.invalidate(key))
                reads = await read_all()
                stale += sum(r["value"] is not None for r in reads)
                near_served_after += sum(r["near"] for r in reads)
                probes += 3 * len(reads)
                await alone.set(key, first)
                await timed("alone", alone.invalidate(key))
                done += 1
    finally:
        await fc.aclose()
        await alone.aclose()
    return {
        "config": {
            "nodes": nodes,
            "rounds": done,
            "near_lease_s": fc.near_lease,
            "skew_margin_s": fc.skew_margin,
            "lease_bound_s": fc.near_lease + fc.skew_margin,
        },
        "live_nodes_seen": len(live),
        "latency_ms": {name: summary(vals) for name, vals in timings.items()},
        "how": {name: dict(c) for name, c in how.items()},
        "nodes_waited_for": {name: dict(c) for name, c in waited_for.items()},
        "holders_before": {name: summary([float(v) for v in vals]) for name, vals in held.items()},
        "stale_reads": stale,
        "probes": probes,
        "near_served_after_return": near_served_after,
    }


async def _memory(url: str, run_id: str, *, entries: int) -> dict[str, Any]:
    namespace = f"bench-near-mem-{run_id}"
    fc = FlightCache(url, namespace=namespace, near_max_entries=entries)
    raw = aioredis.Redis.from_url(url)
    keys = [f"mem:{i}" for i in range(entries)]
    try:
        await fc.get("warm")  # connected, registered, listening, scripts loaded
        pipe: Any = raw.pipeline(transaction=False)
        sizes = []
        for i, key in enumerate(keys):
            value = {"role": "assistant", "content": f"near-cache entry {i:06d} " + "x" * 48}
            data = fc.envelope.encode(value, key=key)
            sizes.append(len(data))
            pipe.set(fc.keyspace.flight(key).result, data, px=3_600_000)
        await pipe.execute()
        near = fc._near  # the bench looks inside: entries and the bytes it accounts
        assert near is not None

        async def fill() -> int:
            for start in range(0, entries, 64):
                await asyncio.gather(*(fc.get(k) for k in keys[start : start + 64]))
            return len(near)

        tracemalloc.start()
        try:
            filled = await fill()
            accounted = near.bytes
            digest, (lease_end, data) = next(iter(near._entries.items()))
            parts = {
                "value (bytes object)": sys.getsizeof(data),
                "digest (str)": sys.getsizeof(digest),
                "entry tuple and lease float": sys.getsizeof((lease_end, data))
                + sys.getsizeof(lease_end),
            }
            gc.collect()
            held_bytes = tracemalloc.get_traced_memory()[0]
            near.clear()
            gc.collect()
            released = held_bytes - tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
    finally:
        await fc.aclose()
        await raw.aclose()
    return {
        "entries": filled,
        "value_bytes": median([float(s) for s in sizes]),
        "accounted_bytes_per_entry": accounted / filled if filled else math.nan,
        "bytes_per_entry": released / filled if filled else math.nan,
        "parts": parts,
    }


async def run(
    url: str,
    *,
    rounds: int = 3,
    redis_budget: tuple[int, float] = (20_000, 0.5),
    near_budget: tuple[int, float] = (300_000, 0.3),
    nodes: int = 4,
    invalidations: int = 100,
    invalidation_s: float = 6.0,
    entries: int = 10_000,
) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:8]
    hits = await _hits(
        url, run_id, rounds=rounds, redis_budget=redis_budget, near_budget=near_budget
    )
    invalidation = await _invalidation(
        url, run_id, nodes=nodes, rounds=invalidations, seconds=invalidation_s
    )
    memory = await _memory(url, run_id, entries=entries)
    return {"hits": hits, "invalidation": invalidation, "memory": memory}
