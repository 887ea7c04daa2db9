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

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import redis.asyncio as aioredis

from flightcache import FlightCache
from flightcache._backends.redis import RedisConnection
from flightcache._types import Stats

from ._util import median

VARIANTS = ("raw", "raw-fcpool", "get", "do")
LABELS = {
    "raw": "raw GET (redis.asyncio, from_url)",
    "raw-fcpool": "raw GET, flightcache's pool settings",
    "get": "fc.get(key)",
    "do": "fc.do(key, loader), cached",
}
VALUE = {"role": "assistant", "content": "A cached completion of about a hundred bytes." * 2}
NAMESPACE = "bench-hit"

Op = Callable[[int], Awaitable[Any]]


def fc_pool_client(url: str) -> RedisConnection:
    """flightcache's own Redis connection (_redis.py), pool and all, for a plain GET."""
    return RedisConnection(url, stats=Stats(), client_name="bench-raw-fcpool")


async def _sequential(op: Op, ops: int, seconds: float) -> tuple[int, float, float]:
    done = 0
    cpu = time.process_time()
    start = time.perf_counter()
    deadline = start + seconds
    while done < ops:
        await op(0)
        done += 1
        if done % 64 == 0 and time.perf_counter() >= deadline:
            break
    return done, time.perf_counter() - start, time.process_time() - cpu


async def _concurrent(
    op: Op, ops: int, seconds: float, concurrency: int
) -> tuple[int, float, float]:
    done = 0
    cpu = time.process_time()
    start = time.perf_counter()
    deadline = start + seconds

    async def one(i: int) -> None:
        nonlocal done
        while done < ops and time.perf_counter() < deadline:
            done += 1
            await op(i)

    await asyncio.gather(*(one(i) for i in range(concurrency)))
    return done, time.perf_counter() - start, time.process_time() - cpu


async def run(
    url: str, *, rounds: int = 3, ops: int = 20_000, seconds: float = 1.2, concurrency: int = 64
) -> dict[str, Any]:
    payload = b"j" + orjson.dumps(VALUE)  # the same bytes flightcache stores for VALUE
    raw = aioredis.Redis.from_url(url)
    raw_fc = fc_pool_client(url)
    fc = FlightCache(
        url, namespace=NAMESPACE, max_connections=max(64, concurrency), near_cache=False
    )
    loader_calls = 0

    async def loader() -> dict[str, Any]:
        nonlocal loader_calls
        loader_calls += 1
        return VALUE

    keys = [f"hit:{i}" for i in range(concurrency)]
    raw_keys = [f"bench-raw:{i}" for i in range(concurrency)]
    try:
        await raw.mset(dict.fromkeys(raw_keys, payload))
        for key in keys:
            await fc.do(key, loader, ttl=3600)
        ops_by_variant: dict[str, Op] = {
            "raw": lambda i: raw.get(raw_keys[i]),
            "raw-fcpool": lambda i: raw_fc.client.get(raw_keys[i]),
            "get": lambda i: fc.get(keys[i]),
            "do": lambda i: fc.do(keys[i], loader, ttl=3600),
        }
        # Check every variant reads what it should, and open every connection needed.
        for name, op in ops_by_variant.items():
            got = await op(0)
            want = payload if name.startswith("raw") else VALUE
            if got != want:
                raise RuntimeError(f"hit path {name}: read {got!r}, expected {want!r}")
            await _concurrent(op, concurrency * 4, 5.0, concurrency)
        loader_calls = 0
        stats_before = fc.stats

        samples: dict[str, dict[str, list[float]]] = {
            mode: {v: [] for v in VARIANTS} for mode in ("sequential", "concurrent")
        }
        cpu_us: dict[str, dict[str, list[float]]] = {
            mode: {v: [] for v in VARIANTS} for mode in ("sequential", "concurrent")
        }
        for r in range(rounds):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            for mode in ("sequential", "concurrent"):
                for name in order:
                    op = ops_by_variant[name]
                    await _sequential(op, 200, 0.5)  # warm this variant's path again
                    if mode == "sequential":
                        n, dt, cpu = await _sequential(op, ops, seconds)
                    else:
                        n, dt, cpu = await _concurrent(op, ops, seconds, concurrency)
                    samples[mode][name].append(n / dt)
                    cpu_us[mode][name].append(cpu / n * 1e6)
        if loader_calls:
            raise RuntimeError(f"fc.do on cached keys ran the loader {loader_calls} times")
        stats_after = fc.stats
    finally:
        await fc.aclose()
        await raw.aclose()
        await raw_fc.aclose()

    result: dict[str, Any] = {
        "config": {
            "rounds": rounds,
            "ops_per_measurement": ops,
            "seconds_per_measurement": seconds,
            "concurrency": concurrency,
            "value_bytes": len(payload),
        },
        "fc_stats_delta": {
            k: stats_after[k] - stats_before.get(k, 0)
            for k in stats_after
            if stats_after[k] != stats_before.get(k, 0)
        },
    }
    for mode, by_name in samples.items():
        base = by_name["raw"]
        result[mode] = {
            name: {
                "ops_per_s": median(vals),
                "best_ops_per_s": max(vals),
                "ratio_to_raw": median([v / b for v, b in zip(vals, base, strict=True)]),
                "cpu_us_per_op": median(cpu_us[mode][name]),
                "samples": vals,
            }
            for name, vals in by_name.items()
        }
    return result
