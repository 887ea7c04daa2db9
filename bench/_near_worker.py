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

import os
import sys
from typing import Any

from flightcache import MISSING, FlightCache

from ._orders import serve


def _held(fc: FlightCache, key: str) -> bool:
    near = fc._near  # the bench looks inside: whether this node now holds a leased copy
    if near is None:
        return False
    entry = near._entries.get(fc.keyspace.flight(key).digest)
    return entry is not None and near.clock() < entry[0]


async def read(fc: FlightCache, msg: dict[str, Any]) -> dict[str, Any]:
    key = str(msg["key"])
    near = fc._near
    hits = near.hits if near is not None else 0
    value = await fc.get(key)
    return {
        "value": None if value is MISSING else value,
        "near": near is not None and near.hits > hits,
        "held": _held(fc, key),
    }


async def warm(fc: FlightCache, msg: dict[str, Any]) -> dict[str, Any]:
    await fc.get(f"warm:{os.getpid()}")
    return {"pid": os.getpid(), "node_id": fc.node_id}


if __name__ == "__main__":
    serve(lambda: FlightCache(sys.argv[1], namespace=sys.argv[2]), {"warm": warm, "read": read})
