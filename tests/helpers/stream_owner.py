"""A process that owns a stream flight: it produces chunks slowly until it is killed.

argv[1] is a JSON config: url, namespace, key, chunks, interval_s, lease, markers.
Drops ``chunk-<n>`` marker files as it produces, and when its stream ends (it was not
killed) an ``outcome`` file: JSON with the chunks its reader got, the exception that ended
the reading (its class name, or null), and the cache's stats.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from flightcache import FlightCache


async def main(cfg: dict[str, Any]) -> None:
    marks = Path(cfg["markers"])

    async def producer() -> Any:
        for n in range(cfg["chunks"]):
            yield {"n": n, "by": "first-owner"}
            (marks / f"chunk-{n}").write_text("")
            await asyncio.sleep(cfg["interval_s"])

    got: list[Any] = []
    error = None
    async with FlightCache(cfg["url"], namespace=cfg["namespace"], lease=cfg["lease"]) as fc:
        try:
            async for chunk in fc.stream(cfg["key"], producer):
                got.append(chunk)
        except Exception as exc:  # reported, for the test to judge
            error = type(exc).__name__
        outcome = {"chunks": got, "error": error, "stats": fc.stats}
    (marks / "outcome").write_text(json.dumps(outcome))


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
