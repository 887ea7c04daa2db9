"""A process that owns a stream flight: it produces chunks slowly until it is killed.

argv[1] is a JSON config: url, namespace, key, chunks, interval_s, lease, markers.
Drops ``chunk-<n>`` marker files as it produces.
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

    async with FlightCache(cfg["url"], namespace=cfg["namespace"], lease=cfg["lease"]) as fc:
        async for _chunk in fc.stream(cfg["key"], producer):
            pass


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
