"""One process of the overlapping-batches test: ``do_many`` over a list of keys.

argv[1] is a JSON config: url, namespace, keys (a list), markers (a directory), loader_s,
start_at (a time.monotonic() instant shared by the processes on Linux), lease. The loader
appends one line per key it loads to ``<markers>/loaded-<pid>``, sleeps loader_s, and
returns ``{"key": k, "pid": pid}`` for each key. Prints one JSON line: the values and the
loader calls.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from flightcache import FlightCache


async def main(cfg: dict[str, Any]) -> dict[str, Any]:
    pid = os.getpid()
    log = Path(cfg["markers"]) / f"loaded-{pid}"
    calls: list[list[str]] = []

    async def loader(keys: list[str]) -> dict[str, Any]:
        calls.append(list(keys))
        with log.open("a") as f:
            f.write("".join(f"{k}\n" for k in keys))
        await asyncio.sleep(cfg["loader_s"])
        return {k: {"key": k, "pid": pid} for k in keys}

    async with FlightCache(
        cfg["url"], namespace=cfg["namespace"], lease=cfg.get("lease", 1.0)
    ) as fc:
        await fc.get("warm-up")
        await asyncio.sleep(max(0.0, cfg["start_at"] - time.monotonic()))
        values = await fc.do_many(cfg["keys"], loader, ttl=60)
        return {"pid": pid, "values": values, "calls": calls, "stats": fc.stats}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))), flush=True)
