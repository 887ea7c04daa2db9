"""Refresh-ahead (XFetch): a hot key is recomputed before it expires, never missed."""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

import pytest

from flightcache import FlightCache


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nodes", [1, 3])
async def test_a_hot_key_never_misses_across_its_expiries(
    backend_url: str, namespace: str, nodes: int
) -> None:
    if backend_url == "memory://" and nodes > 1:
        pytest.skip("memory:// is one process")
    caches = [FlightCache(backend_url, namespace=namespace) for _ in range(nodes)]
    ttl, cost, duration = 1.0, 0.1, 4.0
    runs: list[tuple[float, float]] = []
    running = 0
    overlapped = False

    async def loader() -> int:
        nonlocal running, overlapped
        running += 1
        overlapped |= running > 1
        started = time.monotonic()
        await asyncio.sleep(cost)
        running -= 1
        runs.append((started, time.monotonic()))
        return len(runs)

    try:
        # Connected first: a Cluster client learning its slots can take most of the TTL, and
        # the value must not be near its expiry before the first refresh-ahead can be drawn
        # (CI once saw the first calls of the hammer find it expired: a miss of the set-up).
        await asyncio.gather(*(fc.ping() for fc in caches))
        for fc in caches:  # warm: the one miss there is
            await fc.do("hot", loader, ttl=ttl, refresh_ahead=True)
        calls: list[tuple[float, int]] = []  # (when the call began, the run it got)
        # A refresh starts at least its cost plus a margin (50 ms) before the expiry: a loop
        # that does not run for longer than that misses physically. The suite's process is
        # large by now, and a full collection of it is one such stop: what exists is frozen
        # (gc.freeze), and the loop's longest stop is measured and printed with a failure.
        gc.collect()
        gc.freeze()
        stops: list[float] = [0.0]

        async def watch() -> None:
            while True:
                before = time.monotonic()
                await asyncio.sleep(0.005)
                stops.append(time.monotonic() - before - 0.005)

        watcher = asyncio.ensure_future(watch())
        t0 = time.monotonic()

        async def hammer(fc: FlightCache) -> None:
            while time.monotonic() - t0 < duration:
                started = time.monotonic()
                calls.append((started, await fc.do("hot", loader, ttl=ttl, refresh_ahead=True)))
                await asyncio.sleep(0.002)

        try:
            await asyncio.gather(*(hammer(fc) for fc in caches for _ in range(3)))
        finally:
            watcher.cancel()
            gc.unfreeze()
        stopped = f"the loop's longest stop: {max(stops) * 1000:.0f} ms"

        # No caller ever waited for the loader. A call that waited got a run that ended after
        # it began, and began when the run before had expired or was about to: stored after
        # its loader's end, that value lived a TTL at least from then. (A call that got a run
        # ending after it began but while the value before was still good did not wait: its
        # read crossed the new value's store, a few ms on a loaded Cluster.) No bound on a
        # wait, so the machine's load cannot fail it.
        def waited_for(began: float, run: int) -> bool:
            if began >= runs[run - 1][1]:
                return False  # the run had ended before the call began
            return run == 1 or began >= runs[run - 2][1] + ttl

        waited = [(began, run) for began, run in calls if waited_for(began, run)]
        assert not waited, (waited[:5], runs, stopped)
        assert not overlapped  # one recomputation at a time, across every node
        # Each stored value is recomputed once, shortly before it expires: about one run
        # per TTL (the XFetch draw is once per value, not per call: drawn per call at this
        # rate it would run about twice per TTL), never fewer (a value would have expired).
        refreshed = len(runs) - 1
        assert duration / ttl - 1 <= refreshed <= 1.5 * duration / ttl, (runs, stopped)
        assert sum(fc.stats["refreshes_ahead"] for fc in caches) >= refreshed
    finally:
        for fc in caches:
            await fc.aclose()


async def test_without_refresh_ahead_an_expiry_is_a_miss(make_cache: Any) -> None:
    """The control: the same key without refresh-ahead does make a caller wait."""
    fc = make_cache()

    async def loader() -> str:
        await asyncio.sleep(0.1)
        return "v"

    await fc.do("k", loader, ttl=0.3)
    await asyncio.sleep(0.4)
    started = time.monotonic()
    await fc.do("k", loader, ttl=0.3)
    assert time.monotonic() - started >= 0.09


def test_an_unlucky_draw_starts_a_refresh_no_earlier_than_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """U drawn next to 0 (-ln(U) about 28, uncapped): the refresh still waits until
    ``cost * (1 + beta * MAX_DRAW)`` + the margin before the expiry, not most of a TTL."""
    from flightcache._protections import ahead

    monkeypatch.setattr(ahead.random, "random", lambda: 1.0 - 1e-12)
    now = [100.0]
    known = ahead.RefreshAhead(clock=lambda: now[0])
    known.saw("k", sent=100.0, ttl_left_ms=10_000, cost_ms=100)  # expires at 110
    lead = 0.1 * (1 + ahead.MAX_DRAW) + ahead.MARGIN_S
    now[0] = 110.0 - lead - 0.01
    assert known.due("k", 1.0) is None  # uncapped it would be due since 107.2
    now[0] = 110.0 - lead + 0.01
    left_ms = known.due("k", 1.0)
    assert left_ms is not None and abs(left_ms - (lead - 0.01) * 1000) <= 1
