"""Fail-open: an unreachable or stopped server degrades to this process, and recovers."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
import redis.asyncio as aioredis

from flightcache import BackendUnavailable, EmbeddedServer, FlightCache, Tuning
from flightcache._backends.embedded import free_port


async def test_an_unreachable_server_degrades_to_this_process(
    make_cache: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fc = make_cache(f"redis://127.0.0.1:{free_port()}/0")
    runs: list[int] = []

    async def loader() -> str:
        runs.append(1)
        await asyncio.sleep(0.1)
        return "local"

    with caplog.at_level(logging.WARNING, logger="flightcache.failopen"):
        results = await asyncio.gather(*(fc.do("q", loader) for _ in range(20)))
        assert results == ["local"] * 20
        assert len(runs) == 1  # single-flight still holds in this process
        for _ in range(50):
            assert await fc.do("q", loader) == "local"  # from this process's own store
            assert await fc.get("q") == "local"
    assert len(runs) == 1
    assert fc.stats["fail_open"] >= 1
    outage_logs = [r for r in caplog.records if "unreachable" in r.message]
    assert len(outage_logs) == 1  # logged once, not per call
    assert "127.0.0.1" in outage_logs[0].message


async def test_fail_closed_raises_instead(make_cache: Any) -> None:
    fc = make_cache(f"redis://127.0.0.1:{free_port()}/0", fail_open=False)

    async def loader() -> str:
        return "never"

    with pytest.raises(BackendUnavailable):
        await fc.do("q", loader)


@pytest.mark.timeout(60)
async def test_stopping_and_restarting_the_server_under_load(
    namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = EmbeddedServer().start()
    port = server.port
    # Fail-open starts once a flight's failover window (failover_s) has passed unanswered.
    fc = FlightCache(
        server.url,
        namespace=namespace,
        socket_timeout=0.5,
        near_lease=0.5,
        tuning=Tuning(failover_s=0.5),
    )
    errors: list[BaseException] = []
    answered = 0
    stop = asyncio.Event()

    async def load(i: int) -> None:
        nonlocal answered

        async def loader() -> str:
            await asyncio.sleep(0.01)
            return f"v{i}"

        while not stop.is_set():
            try:
                assert await fc.do(f"k{i}", loader, ttl=60) == f"v{i}"
                answered += 1
            except Exception as exc:  # any failure is what this test looks for
                errors.append(exc)
            await asyncio.sleep(0.005)

    try:
        with caplog.at_level(logging.WARNING, logger="flightcache.failopen"):
            workers = [asyncio.ensure_future(load(i)) for i in range(8)]
            await asyncio.sleep(0.5)
            await asyncio.to_thread(server.stop)  # the server goes away under load
            await asyncio.sleep(1.5)
            during = fc.stats["fail_open"]
            server = await asyncio.to_thread(EmbeddedServer(port=port).start)
            back = time.monotonic()
            while fc._failopen is not None and fc._failopen.down:  # recovers by itself
                assert time.monotonic() - back < 15
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*workers)
        assert not errors, errors[:3]
        assert answered > 100
        assert during > 0
        # Back to shared flights: the values are stored on the (new, empty) server again.
        client = aioredis.Redis.from_url(server.url)
        stored = await client.get(fc.keyspace.flight("k0").result)
        await client.aclose()
        assert stored is not None
        messages = [r.message for r in caplog.records]
        assert sum("unreachable" in m for m in messages) == 1
        assert sum("answers again" in m for m in messages) == 1
    finally:
        stop.set()
        await fc.aclose()
        server.stop()


async def test_a_whole_cluster_down_fails_open_too(namespace: str) -> None:
    from flightcache._backends.embedded import EmbeddedCluster

    cluster = EmbeddedCluster(masters=3, replicas=0).start()
    url = cluster.url
    cluster.stop()  # every node gone before the cache ever connects
    fc = FlightCache(url, namespace=namespace, socket_timeout=0.5, tuning=Tuning(failover_s=0.5))

    async def loader() -> str:
        return "local"

    try:
        assert await fc.do("q", loader) == "local"
        assert fc.stats["fail_open"] == 1
        with pytest.raises(BackendUnavailable):
            await fc.ping()  # health checks never fail open
    finally:
        await fc.aclose()


async def test_an_exhausted_pool_is_not_an_outage(server: EmbeddedServer, namespace: str) -> None:
    """Busy connections mean this process is overloaded, not that the server is down."""
    from flightcache import FlightError

    fc = FlightCache(server.url, namespace=namespace, max_connections=2, socket_timeout=0.3)
    await fc.get("warm")
    pool: Any = fc._conn.client.connection_pool  # type: ignore[union-attr]
    pool._wait_timeout = 0.2
    held = []
    while not pool.saturated:  # every connection for ordinary calls (the lane is kept apart)
        held.append(await pool.get_connection())
    try:
        with pytest.raises(FlightError, match="exhausted"):
            await fc.get("k")
        assert fc.stats["fail_open"] == 0 and not fc._failopen.down  # type: ignore[union-attr]
    finally:
        for conn in held:
            await pool.release(conn)
        await fc.aclose()
