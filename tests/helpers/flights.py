"""Waiting for a flight to reach a state, instead of ordering tasks with sleeps.

Polling is fine in tests: each poll is one ``inspect`` (one pipeline), and the bound is
generous, so a loaded machine only makes the wait longer, never the test wrong.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from flightcache import FlightCache, FlightInfo


async def wait_for_flight(
    fc: FlightCache,
    key: Any,
    *,
    followers: int = 0,
    timeout: float = 15.0,
) -> FlightInfo:
    """Poll ``inspect(key)`` until its flight runs under a confirmed owner (a token in meta)
    with at least ``followers`` other processes queued behind it. A refresh flight runs
    while the old result is still stored (``inspect`` says "cached"): the token counts."""
    deadline = time.monotonic() + timeout
    info = await fc.inspect(key)
    while not (info.token and info.followers >= followers):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout} s waiting for a running flight with "
                f"{followers} follower(s); last seen: {info}"
            )
        await asyncio.sleep(0.01)
        info = await fc.inspect(key)
    return info


async def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.01) -> Any:
    """Poll a cheap local condition from async code until it holds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)
