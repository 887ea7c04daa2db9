"""One process of a many-keys test: owns or follows ``keys`` distinct flights at once.

argv[1] is a JSON config: url, namespace, keys (how many), role ("owner" or "follower"),
loader_s, lease, markers (a directory), max_connections, warm_s (an owner first owns one
flight that long, so that its session is usable before the burst). The owner drops ``owning`` in
markers once every one of its loaders runs; the follower starts when that file exists and
its loader must never run. Prints one JSON line: right values, errors, loader runs, stats.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from flightcache import FlightCache, FlightError


async def main(cfg: dict[str, Any]) -> dict[str, Any]:
    marks = Path(cfg["markers"])
    owner = cfg["role"] == "owner"
    n = cfg["keys"]
    started = 0
    all_started = asyncio.Event()
    runs = 0

    fc = FlightCache(
        cfg["url"],
        namespace=cfg["namespace"],
        lease=cfg.get("lease", 3.0),
        timeout=cfg.get("timeout", 60.0),
        near_cache=False,
        max_connections=cfg.get("max_connections", 64),
    )
    await fc.get("warm-up")
    if owner and cfg.get("warm_s"):

        async def warm() -> str:
            await asyncio.sleep(cfg["warm_s"])
            return "warm"

        await fc.do("session-warm", warm, ttl=1)
    if not owner:
        while not (marks / "owning").exists():  # noqa: ASYNC110 (waiting for another process)
            await asyncio.sleep(0.02)

    async def call(i: int) -> tuple[bool, str | None]:
        nonlocal started, runs

        async def loader() -> str:
            nonlocal started, runs
            runs += 1
            if not owner:
                return "wrong: the follower ran a loader"
            started += 1
            if started == n:
                all_started.set()
            await asyncio.sleep(cfg["loader_s"])
            return f"value-{i}"

        try:
            value = await fc.do(f"key-{i}", loader, ttl=60)
        except FlightError as exc:
            return False, f"{type(exc).__name__}: {exc}"
        return value == f"value-{i}", None

    t0 = time.monotonic()
    calls = asyncio.gather(*(call(i) for i in range(n)))
    if owner:
        await all_started.wait()
        (marks / "owning").write_text(str(os.getpid()))
    outcomes = await calls
    report = {
        "pid": os.getpid(),
        "node": fc.node_id,
        "right": sum(1 for ok, _ in outcomes if ok),
        "errors": [e for _, e in outcomes if e][:5],
        "error_count": sum(1 for _, e in outcomes if e),
        "loader_runs": runs,
        "seconds": time.monotonic() - t0,
        "stats": fc.stats,
    }
    await fc.aclose()
    return report


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))), flush=True)
