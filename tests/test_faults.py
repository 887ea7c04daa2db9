"""Faults the protocol must ride out (docs/faults.md): a slow follower still reads the end of
its own flight after another flight of the key began; server failures are never reported as
the loader's."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flightcache import EmbeddedServer, FlightCache, RemoteError, Tuning
from flightcache._protocol.flight import RedisFlights

from .helpers.flights import wait_for_flight
from .helpers.proxy import CuttableProxy

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


# -- the server's failures are not the loader's ------------------------------------------------


@pytest.fixture
def proxy(server: EmbeddedServer) -> Iterator[CuttableProxy]:
    p = CuttableProxy(server.host, server.port).start()
    yield p
    p.close()


async def _owner_and_follower(
    make_cache: Any, proxy: CuttableProxy, **kw: Any
) -> tuple[FlightCache, FlightCache]:
    owner = make_cache(f"redis://127.0.0.1:{proxy.port}/0", **kw)  # through the proxy
    follower = make_cache(**kw)  # straight to the server
    await owner.get("warm-up")
    await follower.get("warm-up")
    return owner, follower


async def test_a_result_written_through_a_short_outage_reaches_everyone_once(
    make_cache: Any, proxy: CuttableProxy
) -> None:
    owner, follower = await _owner_and_follower(make_cache, proxy, lease=3.0)
    gate = asyncio.Event()

    async def loader() -> str:
        await gate.wait()
        return "the value"

    running = asyncio.ensure_future(owner.do("k", loader))
    await wait_for_flight(follower, "k")
    followed = asyncio.ensure_future(follower.do("k", loader))
    await wait_for_flight(follower, "k", followers=1)
    proxy.cut()  # the owner's complete_flight fails until the server is back
    gate.set()
    await asyncio.sleep(0.5)
    proxy.heal()
    assert await asyncio.wait_for(running, 10) == "the value"
    assert await asyncio.wait_for(followed, 10) == "the value"
    assert owner.stats["loader_runs"] == 1 and follower.stats["loader_runs"] == 0
    assert owner.stats["loader_errors"] == 0


async def test_a_result_the_server_never_takes_goes_to_local_callers_and_is_no_error(
    make_cache: Any, proxy: CuttableProxy, redis_client: Any
) -> None:
    """The server stays out of reach past the failover window: the owner's callers still
    get the value it computed (fail-open); followers get no error from it, nothing is
    negative-cached, and they take the flight over once its lease lapses."""
    owner, follower = await _owner_and_follower(
        make_cache, proxy, lease=0.6, tuning=Tuning(failover_s=0.5)
    )
    gate = asyncio.Event()

    async def owners() -> str:
        await gate.wait()
        return "computed by the owner"

    async def followers() -> str:
        return "computed by the follower"

    running = asyncio.ensure_future(owner.do("k", owners))
    await wait_for_flight(follower, "k")
    followed = asyncio.ensure_future(follower.do("k", followers))
    await wait_for_flight(follower, "k", followers=1)
    proxy.cut()
    gate.set()
    try:
        assert await asyncio.wait_for(running, 10) == "computed by the owner"
        assert await asyncio.wait_for(followed, 10) == "computed by the follower"
    finally:
        proxy.heal()
    assert owner.stats["loader_errors"] == 0 and owner.stats["fail_open"] >= 1
    fk = follower.keyspace.flight("k")
    assert await redis_client.get(fk.result) == b'j"computed by the follower"'


async def test_chunks_appended_through_a_short_outage_reach_every_follower(
    make_cache: Any, proxy: CuttableProxy
) -> None:
    owner, follower = await _owner_and_follower(make_cache, proxy, lease=3.0)
    gate = asyncio.Event()

    async def produce() -> Any:
        yield 1
        await gate.wait()
        for n in range(2, 6):
            yield n
            await asyncio.sleep(0.05)

    async def consume(fc: FlightCache) -> list[Any]:
        return [chunk async for chunk in fc.stream("s", produce)]

    running = asyncio.ensure_future(consume(owner))
    await wait_for_flight(follower, "s")
    followed = asyncio.ensure_future(consume(follower))
    await wait_for_flight(follower, "s", followers=1)
    proxy.cut()  # appends fail and are retried
    gate.set()
    await asyncio.sleep(0.5)
    proxy.heal()
    assert await asyncio.wait_for(running, 10) == [1, 2, 3, 4, 5]
    assert await asyncio.wait_for(followed, 10) == [1, 2, 3, 4, 5]
    assert owner.stats["loader_errors"] == 0 and owner.stats["loader_runs"] == 1


# -- a Cluster failover ------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_cluster_failover_mid_flight_gives_every_caller_one_value(
    namespace: str, tmp_path: Path
) -> None:
    """3 masters with a replica each; 4 processes x 10 callers on one key, loader 3 s; the
    master of the key's slot, which is also the node the URL names, is SIGKILLed 0.5 s into
    the loader. Every caller gets a value, the same one, from at most 2 loader runs (the
    first owner may lose its lease while the slot has no master), and nobody fails open."""
    from flightcache._backends.embedded import EmbeddedCluster

    from .helpers.procs import Fleet, markers, wait_for
    from .test_cluster import _master_of

    with EmbeddedCluster(masters=3, replicas=1) as cluster:
        key = "the-question"
        digest = FlightCache("memory://").keyspace.flight(key).digest
        master = _master_of(cluster, f"{{{digest}}}")
        cfg = {
            "url": f"redis+cluster://127.0.0.1:{master.port}",
            "namespace": namespace,
            "key": key,
            "markers": str(tmp_path),
            "callers": 10,
            "loader_s": 3.0,
            "lease": 3.0,
            "start_at": time.monotonic() + 2.0,
        }
        with Fleet() as fleet:
            workers = [fleet.start(f"w{i}", **cfg) for i in range(4)]
            wait_for(lambda: markers(tmp_path, "start"), 30, "the first loader to start")
            time.sleep(0.5)
            os.kill(master.pid, signal.SIGKILL)
            assert master.proc is not None
            master.proc.wait(5)
            reports = [w.wait(90) for w in workers]
    assert all(rep is not None for rep in reports)
    results = [r for rep in reports if rep for r in rep["results"]]
    assert len(results) == 40
    errors = [r for r in results if "pid" not in r]
    assert not errors, errors[:3]
    assert len({r["pid"] for r in results}) == 1, {r["pid"] for r in results}
    stats = [rep["stats"] for rep in reports if rep]
    assert sum(s["loader_runs"] for s in stats) <= 2, [s["loader_runs"] for s in stats]
    assert sum(s["fail_open"] for s in stats) == 0


# -- smaller faults ------------------------------------------------------------------------------


async def test_an_invalidation_cancelled_after_its_delete_still_reaches_every_holder(
    make_cache: Any, redis_client: Any
) -> None:
    """The caller of ``invalidate`` gives up right after the delete: the other nodes are
    still told (they drop their copies long before their leases end), and the marker ends
    once they acknowledged."""
    holder = make_cache(near_lease=30.0)
    invalidator = make_cache(near_lease=30.0)
    await invalidator.set("k", "old", ttl=600)
    assert await holder.get("k") == "old"  # leased for 30 s
    fk = invalidator.keyspace.flight("k")
    task = asyncio.ensure_future(invalidator.invalidate("k"))
    while await redis_client.exists(fk.result):  # noqa: ASYNC110 (the server's state)
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    t0 = time.monotonic()
    while await holder.get("k") == "old":
        assert time.monotonic() - t0 < 10, "the holder kept serving the old value"
        await asyncio.sleep(0.01)
    while await redis_client.exists(fk.marker):
        assert time.monotonic() - t0 < 10, "the marker outlived the acknowledgements"
        await asyncio.sleep(0.01)


def test_each_refresh_ahead_call_scales_the_draw_with_its_own_beta() -> None:
    """Two keys read alike, asked with very different betas: the large beta makes its key
    due long before expiry, the small one leaves its key alone (one beta per call, not one
    shared by every key)."""
    from flightcache._protections.ahead import RefreshAhead

    now = [100.0]
    ahead = RefreshAhead(clock=lambda: now[0])
    for key in ("eager", "lazy"):
        ahead.saw(key, sent=100.0, ttl_left_ms=10_000, cost_ms=100)  # expires at 110
    now[0] = 105.0  # 5 s before expiry, 50 costs ahead
    assert ahead.due("eager", 1e6) is not None
    assert ahead.due("lazy", 1e-6) is None


async def test_one_server_of_a_sharded_list_down_fails_open_only_its_own_keys(
    namespace: str,
) -> None:
    from flightcache._backends.ring import HashRing

    with EmbeddedServer() as up, EmbeddedServer() as down:
        urls = [up.url, down.url]
        fc = FlightCache(
            urls,
            namespace=namespace,
            tuning=Tuning(failover_s=0.3),
            socket_timeout=1.0,
            near_cache=False,
        )
        try:
            await fc.get("warm-up")
            ring = HashRing([f"127.0.0.1:{up.port}", f"127.0.0.1:{down.port}"])
            keys = {ring.node_for(fc.keyspace.flight(f"k{i}").digest): f"k{i}" for i in range(50)}
            on_up, on_down = keys[f"127.0.0.1:{up.port}"], keys[f"127.0.0.1:{down.port}"]
            down.stop()

            async def loader() -> str:
                return "v"

            assert await fc.do(on_down, loader) == "v"  # answered here: its server is gone
            assert fc.stats["fail_open"] == 1
            assert await fc.do(on_up, loader) == "v"  # still through its own server
            assert fc.stats["fail_open"] == 1
            fk = fc.keyspace.flight(on_up)
            import redis.asyncio as aioredis

            admin = aioredis.Redis.from_url(up.url)
            try:
                assert await admin.get(fk.result) == b'j"v"'
            finally:
                await admin.aclose()
        finally:
            await fc.aclose()


async def test_a_result_the_server_refuses_goes_to_local_callers_and_is_no_loader_error(
    private_server: EmbeddedServer, namespace: str
) -> None:
    """The server refuses the result's write (out of memory): the owner's callers still get
    the loader's value, which is not counted as the loader's error."""
    import redis.asyncio as aioredis

    admin = aioredis.Redis.from_url(private_server.url)
    owner = FlightCache(private_server.url, namespace=namespace, near_cache=False)
    gate = asyncio.Event()

    async def loader() -> str:
        await gate.wait()
        return "x" * 10_000

    try:
        running = asyncio.ensure_future(owner.do("k", loader))
        await wait_for_flight(owner, "k")
        await admin.config_set("maxmemory-policy", "noeviction")
        await admin.config_set("maxmemory", "1")  # every write is refused from now on
        gate.set()
        assert await asyncio.wait_for(running, 10) == "x" * 10_000
        assert owner.stats["loader_errors"] == 0 and owner.stats["loader_runs"] == 1
    finally:
        await admin.config_set("maxmemory", "0")
        await owner.aclose()
        await admin.aclose()


async def test_calls_after_the_server_closed_idle_connections_do_not_fail(
    make_cache: Any, redis_client: Any
) -> None:
    """A restart or a cut leaves the pools' idle connections dead: the next command finds
    out at once and goes again on a fresh connection, so neither an invalidation (which
    waits on the blocking pool) nor a flight reports an outage that is over."""
    holder, invalidator = make_cache(), make_cache()
    await invalidator.set("k", "v", ttl=60)
    assert await holder.get("k") == "v"  # a holder to wait for
    await redis_client.client_kill_filter(_type="normal", skipme=True)
    result = await invalidator.invalidate("k")
    assert result.how == "acked", result
    await redis_client.client_kill_filter(_type="normal", skipme=True)

    async def loader() -> str:
        return "fresh"

    assert await invalidator.do("j", loader) == "fresh"
    assert invalidator.stats["fail_open"] == 0


async def test_a_cluster_owner_runs_its_loader_before_its_claim_is_confirmed(
    cluster: Any, namespace: str
) -> None:
    """On a Cluster the token is taken after the join (INCR, in another slot); the loader
    starts at once, and the owner's first fenced write confirms the claim when
    confirm_claim, sent beside it, never arrives. A write carrying another claim's id is
    refused: the lazy confirmation fences like the token does."""
    from flightcache._protocol.state import LUA

    fc = FlightCache(cluster.url, namespace=namespace, lease=1.0, near_cache=False)
    follower = FlightCache(cluster.url, namespace=namespace, lease=1.0, near_cache=False)
    flights = fc._flights
    assert isinstance(flights, RedisFlights) and not flights.token_in_join
    real = flights.conn.script

    async def no_confirm(lua: Any, *args: Any) -> Any:
        if lua is LUA["confirm_claim"]:
            return 1  # as if sent; the server never sees it
        return await real(lua, *args)

    flights.conn.script = no_confirm  # type: ignore[method-assign]
    gate = asyncio.Event()

    async def loader() -> str:
        await gate.wait()
        return "confirmed by its writes"

    try:
        await fc.get("warm-up")
        running = asyncio.ensure_future(fc.do("k", loader))
        info = await wait_for_flight(follower, "k")  # a renewal (1 s lease) confirmed it
        followed = asyncio.ensure_future(follower.do("k", loader))
        await wait_for_flight(follower, "k", followers=1)
        gate.set()
        assert await running == await followed == "confirmed by its writes"
        assert info.token is not None and fc.stats["fenced_writes"] == 0
        fk = fc.keyspace.flight("stale")
        conn = flights.conn
        await conn.client.hset(fk.meta, mapping={"status": "CLAIMING", "claimId": "theirs"})
        refused = await real(
            LUA["complete_flight"],
            fk,
            (fk.result, fk.meta, fk.stream, fk.waiters, fk.cost),
            (7, b'j"x"', 60_000, "1", 1000, "", 5, "p:", fk.digest, 65536, "mine"),
        )
        assert refused == 0 and await conn.client.get(fk.result) is None
    finally:
        await fc.aclose()
        await follower.aclose()
