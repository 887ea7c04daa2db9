"""The server's clock steps (docs/faults.md): a private server runs under libfaketime
(Debian's ``faketime``), whose offset a file sets while it runs.

Invalidation must stay correct when the server's clock jumps forward past every node's
liveness lease (the live set looks empty); running flights lose their leases and are taken
over, with their first owners fenced.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flightcache import MISSING, BackendUnavailable, EmbeddedServer, FlightCache

from .helpers.flights import wait_for_flight

LIBFAKETIME = next(
    (
        p
        for p in (
            "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
            "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
            "/usr/lib/faketime/libfaketime.so.1",
        )
        if Path(p).exists()
    ),
    None,
)

pytestmark = pytest.mark.skipif(
    LIBFAKETIME is None or shutil.which("faketime") is None,
    reason="libfaketime is not installed (Debian package `faketime`; .ci/run installs it)",
)


class SteppedServer(EmbeddedServer):
    """A server whose clock is offset by what ``offset`` (a faketime spec) says now."""

    def __init__(self, offset_file: Path) -> None:
        super().__init__()
        self.offset_file = offset_file
        offset_file.write_text("+0s\n")

    def _command(self, directory: str) -> list[str]:
        return [
            "env",
            f"LD_PRELOAD={LIBFAKETIME}",
            f"FAKETIME_TIMESTAMP_FILE={self.offset_file}",
            "FAKETIME_NO_CACHE=1",
            "FAKETIME_DONT_FAKE_MONOTONIC=1",
            *super()._command(directory),
        ]

    def step(self, spec: str) -> None:
        self.offset_file.write_text(spec + "\n")


_UNSUPPORTED: list[str] = []  # the reason, once a binary was seen not to start under it


@pytest.fixture
def stepped(tmp_path: Path) -> Iterator[SteppedServer]:
    if _UNSUPPORTED:
        pytest.skip(_UNSUPPORTED[0])
    server = SteppedServer(tmp_path / "offset")
    try:
        server.start(timeout=3.0)
    except BackendUnavailable as exc:
        # Debian's redis-server (its allocator) and libfaketime clash: "Unexpected recursive
        # calls to clock_gettime()"; the bundled Valkey runs under it.
        _UNSUPPORTED.append(f"{server.binary} does not run under libfaketime: {exc}")
        pytest.skip(_UNSUPPORTED[0])
    try:
        yield server
    finally:
        server.stop()


async def _server_ms(fc: FlightCache) -> float:
    conn = await fc._designated()  # the server's own clock, as TIME reads it
    assert conn is not None
    seconds, micros = await conn.client.time()
    return seconds * 1000 + micros / 1000


async def test_the_offset_file_steps_the_servers_clock(stepped: SteppedServer) -> None:
    fc = FlightCache(stepped.url, namespace="t", near_cache=False)
    try:
        before = await _server_ms(fc)
        stepped.step("+120s")
        after = await _server_ms(fc)
        assert 110_000 < after - before < 130_000
    finally:
        await fc.aclose()


async def test_invalidate_after_a_forward_step_waits_for_the_lease_and_no_copy_survives(
    stepped: SteppedServer,
) -> None:
    """A forward step past every node's liveness lease empties the live set. A holder that
    misses the invalidation message (as a paused node would) still holds a leased copy;
    the invalidator, not finding itself in the live set it renews, waits out the longest
    lease instead of returning at once, so no read after it returns serves the old value."""
    kw: dict[str, Any] = dict(namespace="t", near_lease=1.0, skew_margin=0.25, node_ttl=6.0)
    holder, invalidator = FlightCache(stepped.url, **kw), FlightCache(stepped.url, **kw)
    try:
        await invalidator.set("k", "old", ttl=600)
        assert await holder.get("k") == "old"  # leased for about 1 s
        conn = await holder._designated()
        assert conn is not None
        channel = holder.keyspace.invalidations
        conn.listener._channels[channel] = conn.listener._channels[channel].__class__(
            channel, lambda _data: None, lambda: None
        )  # the holder hears nothing from now on
        stepped.step("+60s")  # past every node's 6 s liveness lease, by the server's clock
        assert await invalidator.nodes() == []  # the live set looks empty
        t0 = time.monotonic()
        result = await invalidator.invalidate("k")
        took = time.monotonic() - t0
        assert result.how == "lease", result
        assert took >= 1.0, took  # the longest lease (1 s), plus the skew margin
        assert await holder.get("k") is MISSING  # its copy ran out with the lease
    finally:
        await holder.aclose()
        await invalidator.aclose()


async def test_a_forward_step_mid_flight_is_a_takeover_and_the_first_owner_is_fenced(
    stepped: SteppedServer,
) -> None:
    """Decided behaviour: a forward step of the server's clock longer than a lease expires
    every running flight's lease at once. Its owner's next renewal is refused and its
    loader cancelled; the flight is claimed again with a new token (by whichever process
    joins first) and run once more; the first run's value is never written, and every
    caller gets the second run's."""
    owner = FlightCache(stepped.url, namespace="t", lease=1.0, near_cache=False)
    follower = FlightCache(stepped.url, namespace="t", lease=1.0, near_cache=False)
    gate = asyncio.Event()
    runs: list[str] = []

    async def owners() -> str:
        runs.append("owner")
        if len(runs) == 1:
            await gate.wait()  # the first run is still going when the clock steps
            return "the first run's"
        return "a second run's"

    async def followers() -> str:
        runs.append("follower")
        return "a second run's"

    try:
        running = asyncio.ensure_future(owner.do("k", owners))
        await wait_for_flight(owner, "k")
        followed = asyncio.ensure_future(follower.do("k", followers))
        await wait_for_flight(owner, "k", followers=1)
        stepped.step("+30s")
        assert await asyncio.wait_for(followed, 10) == "a second run's"
        assert await asyncio.wait_for(running, 10) == "a second run's"
        assert len(runs) == 2, runs
        assert owner.stats["lease_lost"] == 1
        assert await follower.get("k") == "a second run's"
    finally:
        gate.set()
        await owner.aclose()
        await follower.aclose()
