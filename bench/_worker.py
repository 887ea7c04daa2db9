"""One stampede worker process: ``python -m bench._worker URL``.

It keeps one ``FlightCache`` for its whole life and takes orders as JSON lines on stdin,
answering each with one JSON line on stdout:

- ``{"op": "warm"}``: run one flight and a few reads, so the scripts are loaded on the
  server and the connection pool holds open connections before anything is measured.
- ``{"op": "stampede", "key", "callers", "start_at", "loader_s", "timeout"}``: at
  ``start_at`` (``time.monotonic()``, which is CLOCK_MONOTONIC and so one clock for every
  process on a Linux machine) start ``callers`` concurrent ``fc.do(key, loader)`` calls.
- ``{"op": "quit"}`` (or end of input): close the cache and exit.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

from flightcache import FlightCache

from ._orders import serve

NAMESPACE = "bench"


async def warm(fc: FlightCache, msg: dict[str, Any]) -> dict[str, Any]:
    pid = os.getpid()

    async def loader() -> dict[str, Any]:
        return {"warm": pid}

    await fc.do(f"warm:{pid}:{time.monotonic_ns()}", loader, ttl=5)
    connections = int(msg.get("connections", 4))
    await asyncio.gather(*(fc.get(f"warm:{pid}:{i}") for i in range(connections)))
    return {"pid": pid}


async def stampede(fc: FlightCache, msg: dict[str, Any]) -> dict[str, Any]:
    key = str(msg["key"])
    callers = int(msg["callers"])
    loader_s = float(msg["loader_s"])
    start_at = float(msg["start_at"])
    pid = os.getpid()
    loader_ends: list[float] = []

    async def loader() -> dict[str, Any]:
        await asyncio.sleep(loader_s)
        end = time.monotonic()
        loader_ends.append(end)
        return {"pid": pid, "end": end}

    async def caller() -> list[Any]:
        t0 = time.monotonic()
        try:
            value = await fc.do(key, loader, ttl=60)
        except Exception as exc:  # reported, not raised: the parent decides
            return [t0, time.monotonic(), None, None, f"{type(exc).__name__}: {exc}"]
        t1 = time.monotonic()
        return [t0, t1, value["pid"], value["end"], None]

    before = fc.stats
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    results = await asyncio.wait_for(
        asyncio.gather(*(caller() for _ in range(callers))), timeout=float(msg["timeout"])
    )
    after = fc.stats
    return {
        "pid": pid,
        "loader_ends": loader_ends,
        "callers": results,
        "stats": {name: after[name] - before.get(name, 0) for name in after},
    }


def _cache() -> FlightCache:
    # node_ttl=60: the liveness heartbeat (one script call every node_ttl / 3 per process,
    # not per flight) stays out of the rounds, whose commands are counted per process.
    return FlightCache(sys.argv[1], namespace=NAMESPACE, lease=3.0, node_ttl=60.0)


if __name__ == "__main__":
    serve(_cache, {"warm": warm, "stampede": stampede})
