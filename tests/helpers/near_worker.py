"""A node that holds values in its near cache and answers probes on stdin.

argv[1] is a JSON config: url, namespace, near_lease, node_ttl, skew_margin.
Commands, one per line on stdin: ``read KEY`` prints the value this process serves for KEY
(its loader answers ``"loaded-<pid>"``, so a value from elsewhere is told apart), as JSON
with the server round trips it took; ``quit`` ends it. Prints ``ready <node id>`` first.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

from flightcache import FlightCache, FlightError


async def main(cfg: dict[str, Any]) -> None:
    fc = FlightCache(
        cfg["url"],
        namespace=cfg["namespace"],
        near_lease=cfg.get("near_lease", 5.0),
        node_ttl=cfg.get("node_ttl", 6.0),
        skew_margin=cfg.get("skew_margin", 0.25),
        socket_timeout=cfg.get("socket_timeout", 2.0),
    )

    async def loader() -> str:
        return f"loaded-{os.getpid()}"

    await fc.get("warm-up")
    print(f"ready {fc.node_id}", flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line or line.strip() == "quit":
            break
        _, key = line.split(maxsplit=1)
        before = fc.stats["commands"]
        try:
            value: Any = await fc.do(key.strip(), loader)
            out = {"value": value}
        except FlightError as exc:
            out = {"error": type(exc).__name__}
        out.update(commands=fc.stats["commands"] - before, t=time.monotonic())
        print(json.dumps(out), flush=True)
    await fc.aclose()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
