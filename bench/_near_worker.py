"""One near-cache node for the invalidation figures: ``python -m bench._near_worker URL NS``.

It keeps one ``FlightCache`` (near cache on, default lease) in namespace ``NS`` for its whole
life, so it is one live node, and takes orders as JSON lines on stdin, answering each with one
JSON line on stdout:

- ``{"op": "warm"}``: one read, so the node is registered, listening for invalidations, and
  its scripts are loaded; answers its pid and node id.
- ``{"op": "read", "key"}``: ``fc.get(key)``; answers the value (``null`` for MISSING), whether
  it came from the near cache without a round trip (``near``), and whether the key is held
  in the near cache afterwards (``held``: it will be served from there until its lease ends
  or an invalidation drops it).
- ``{"op": "quit"}`` (or end of input): close the cache and exit.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from typing import Any

from flightcache import MISSING, FlightCache


def _held(fc: FlightCache, key: str) -> bool:
    near = fc._near  # the bench looks inside: whether this node now holds a leased copy
    if near is None:
        return False
    entry = near._entries.get(fc.keyspace.flight(key).digest)
    return entry is not None and near.clock() < entry[0]


async def read(fc: FlightCache, key: str) -> dict[str, Any]:
    near = fc._near
    hits = near.hits if near is not None else 0
    value = await fc.get(key)
    return {
        "value": None if value is MISSING else value,
        "near": near is not None and near.hits > hits,
        "held": _held(fc, key),
    }


async def main(url: str, namespace: str) -> int:
    fc = FlightCache(url, namespace=namespace)
    try:
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                return 0
            msg = json.loads(line)
            op = msg.get("op")
            if op == "quit":
                return 0
            try:
                if op == "warm":
                    await fc.get(f"warm:{os.getpid()}")
                    reply: dict[str, Any] = {"pid": os.getpid(), "node_id": fc.node_id}
                elif op == "read":
                    reply = await read(fc, str(msg["key"]))
                else:
                    reply = {"error": f"unknown op {op!r}"}
            except Exception:
                reply = {"error": traceback.format_exc()}
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
            if "error" in reply:
                return 1
    finally:
        await fc.aclose()


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2])))
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: leave quietly
        sys.exit(130)
