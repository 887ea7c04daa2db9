"""One worker process of a multi-process test.

argv[1] is a JSON config: url, namespace, key, callers, loader_s, lease, timeout, markers
(a directory), near_cache, near_lease, node_ttl, value_bytes, ttl, start_at (a
time.monotonic() instant, shared by all processes on Linux), hold (keep running after the
report until stdin closes), clock_jump (patch time.time), gate (a file path: the loader,
after loader_s, waits up to 60 s for it to exist), blocking (the loader sleeps loader_s
with time.sleep, blocking the event loop, and takes no gate), warm_s (before start_at, own
a flight of its own this long: the owner's session starts, and the claims after it bind to
it: docs/protocol.md, "Sessions").
The loader drops marker files ``start-<pid>``, ``end-<pid>``, ``cancelled-<pid>``.
Prints one JSON line: per-caller results, stats, node id.
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


def touch(directory: Path, name: str, text: str = "") -> None:
    (directory / f"{name}-{os.getpid()}").write_text(text or repr(time.monotonic()))


async def main(cfg: dict[str, Any]) -> dict[str, Any]:
    marks = Path(cfg["markers"])
    pid = os.getpid()

    async def loader() -> dict[str, Any]:
        touch(marks, "start")
        if cfg.get("blocking"):  # a loader that blocks the event loop (synchronous work)
            time.sleep(cfg["loader_s"])  # noqa: ASYNC251 (the point of this loader)
            touch(marks, "end")
            return {"pid": pid, "blob": "x" * cfg.get("value_bytes", 16)}
        try:
            steps = max(1, int(cfg["loader_s"] / 0.05))
            for _ in range(steps):
                await asyncio.sleep(cfg["loader_s"] / steps)
            gate = cfg.get("gate")  # a file the test creates to let the loader finish
            for _ in range(1200):
                if not gate or os.path.exists(gate):  # noqa: ASYNC240 (a test double)
                    break
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            touch(marks, "cancelled")
            raise
        touch(marks, "end")
        return {"pid": pid, "blob": "x" * cfg.get("value_bytes", 16)}

    fc = FlightCache(
        cfg["url"],
        namespace=cfg["namespace"],
        lease=cfg.get("lease", 1.0),
        timeout=cfg.get("timeout", 30.0),
        near_cache=cfg.get("near_cache", True),
        near_lease=cfg.get("near_lease", 5.0),
        node_ttl=cfg.get("node_ttl", 6.0),
    )
    await fc.get("warm-up")  # connect before the burst, so it is not part of the timing
    if cfg.get("warm_s"):

        async def warm() -> int:
            await asyncio.sleep(cfg["warm_s"])
            return pid

        await fc.do(f"session-warm-{pid}", warm, ttl=1)
    if "start_at" in cfg:
        await asyncio.sleep(max(0.0, cfg["start_at"] - time.monotonic()))
    if cfg.get("clock_jump"):
        real = time.time
        offsets = [3600.0, -3600.0]
        state = {"i": 0}
        time.time = lambda: real() + offsets[state["i"] % 2]  # type: ignore[assignment]

        async def flip() -> None:
            while True:
                await asyncio.sleep(0.1)
                state["i"] += 1

        flipper = asyncio.ensure_future(flip())

    async def call() -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            value = await fc.do(cfg["key"], loader, ttl=cfg.get("ttl", 60))
            return {"pid": value["pid"], "t0": t0, "t1": time.monotonic()}
        except FlightError as exc:
            return {"error": type(exc).__name__, "message": str(exc), "t1": time.monotonic()}

    results = await asyncio.gather(*(call() for _ in range(cfg.get("callers", 1))))
    if cfg.get("clock_jump"):
        flipper.cancel()
    report = {"pid": pid, "node": fc.node_id, "results": results, "stats": fc.stats}
    print(json.dumps(report), flush=True)
    if cfg.get("hold"):
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await fc.aclose()
    return report


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
