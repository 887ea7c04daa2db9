"""Faults the protocol must ride out (docs/faults.md): a slow follower still reads the end of
its own flight after another flight of the key began; server failures are never reported as
the loader's."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from flightcache import FlightCache, RemoteError

from .helpers.flights import wait_for_flight

LEASE = 0.5


def _deafen(fc: FlightCache) -> None:
    """The follower hears no wake-up from now on (as if every message were lost): it learns
    what happened from its lease re-check alone, the slowest path there is."""
    hub = fc._flights.hub  # type: ignore[union-attr]
    for waiters in hub._waiters.values():
        waiters.clear()


async def _second_flight(fc: FlightCache, key: str, gate: asyncio.Event) -> asyncio.Future[Any]:
    """Another flight of ``key`` begins (and runs) right after the first ended."""

    async def blocked() -> str:
        await gate.wait()
        return "the second flight's value"

    second = asyncio.ensure_future(fc.do(key, blocked, store=False, lease=LEASE))
    await wait_for_flight(fc, key)
    return second


async def test_a_slow_follower_gets_its_own_flights_value_after_another_flight_began(
    make_cache: Any,
) -> None:
    owner, follower, other = (make_cache(lease=LEASE) for _ in range(3))
    gate, later = asyncio.Event(), asyncio.Event()

    async def first() -> str:
        await gate.wait()
        return "the first flight's value"

    running = asyncio.ensure_future(owner.do("k", first, store=False))
    await wait_for_flight(owner, "k")
    followed = asyncio.ensure_future(follower.do("k", first, store=False))
    await wait_for_flight(owner, "k", followers=1)
    _deafen(follower)
    gate.set()
    assert await running == "the first flight's value"
    second = await _second_flight(other, "k", later)  # the key's next flight is running
    try:
        assert await asyncio.wait_for(followed, 10) == "the first flight's value"
    finally:
        later.set()
        await second


async def test_a_slow_follower_gets_its_own_flights_error_after_another_flight_began(
    make_cache: Any,
) -> None:
    owner, follower, other = (make_cache(lease=LEASE, error_ttl=0) for _ in range(3))
    gate, later = asyncio.Event(), asyncio.Event()

    async def failing() -> str:
        await gate.wait()
        raise ValueError("the first flight failed")

    running = asyncio.ensure_future(owner.do("k", failing))
    await wait_for_flight(owner, "k")
    followed = asyncio.ensure_future(follower.do("k", failing))
    await wait_for_flight(owner, "k", followers=1)
    _deafen(follower)
    gate.set()
    with pytest.raises(ValueError):
        await running
    second = await _second_flight(other, "k", later)
    try:
        with pytest.raises(RemoteError, match="the first flight failed"):
            await asyncio.wait_for(followed, 10)
    finally:
        later.set()
        await second


async def test_a_slow_stream_follower_gets_the_whole_first_stream_not_a_restart(
    make_cache: Any,
) -> None:
    owner, follower, other = (make_cache(lease=LEASE) for _ in range(3))
    gate, later = asyncio.Event(), asyncio.Event()

    async def produce() -> Any:
        yield "a"
        await gate.wait()
        yield "b"
        yield "c"

    async def consume(fc: FlightCache) -> list[Any]:
        return [chunk async for chunk in fc.stream("s", produce, store=False)]

    running = asyncio.ensure_future(consume(owner))
    await wait_for_flight(owner, "s")
    followed = asyncio.ensure_future(consume(follower))
    await wait_for_flight(owner, "s", followers=1)
    await asyncio.sleep(0.1)  # the follower has the first chunk
    _deafen(follower)
    gate.set()
    assert await running == ["a", "b", "c"]
    second = await _second_flight(other, "s", later)
    try:
        assert await asyncio.wait_for(followed, 10) == ["a", "b", "c"]
    finally:
        later.set()
        await second
