"""The protocol's parts on a real server: fenced scripts, script reloading, the heartbeat."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from flightcache import BackendUnavailable, ConfigError
from flightcache._protocol.flight import LUA
from flightcache._protocol.heartbeat import Heartbeat


async def test_scripts_are_reloaded_after_the_server_forgets_them(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    fc = make_cache()

    async def loader() -> str:
        return "v"

    assert await fc.do("a", loader) == "v"
    await redis_client.script_flush()
    assert await fc.do("b", loader) == "v"  # NOSCRIPT -> SCRIPT LOAD -> EVALSHA


async def test_a_write_with_a_stale_token_is_refused_and_writes_nothing(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    fc = make_cache()
    fk = fc.keyspace.flight("q")
    conn = fc._conn
    await redis_client.hset(fk.meta, mapping={"ownerToken": "7", "status": "RUNNING"})
    keys = (fk.result, fk.meta, fk.stream, fk.waiters)
    done_keys = (*keys, fk.cost)
    stale = await conn.script(
        LUA["complete_flight"], fk, done_keys, (6, b"jstale", 60_000, "1", 1000, "", 5)
    )
    assert stale == 0
    assert await redis_client.get(fk.result) is None
    assert await redis_client.xlen(fk.stream) == 0
    failed = await conn.script(LUA["fail_flight"], fk, keys, (6, "error", b"e{}", 1000, 1000))
    assert failed == 0
    renewed = await conn.script(
        LUA["renew_leases"], fk, (fk.meta, fk.stream, fk.waiters), (6, 3000, 3000)
    )
    assert renewed == [0]
    assert await redis_client.pttl(fk.meta) == -1  # untouched: no expiry was set
    current = await conn.script(
        LUA["complete_flight"], fk, done_keys, (7, b"jcurrent", 60_000, "1", 1000, "", 5)
    )
    assert current == 1
    assert await redis_client.get(fk.result) == b"jcurrent"
    assert not await redis_client.exists(fk.meta)


async def test_an_owner_whose_token_was_replaced_is_fenced_and_follows(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """The loader finishes after another token took the flight (before a heartbeat noticed):
    the result is not written; the owner follows, and when that flight lapses, claims again."""
    fc = make_cache(lease=3.0)
    fk = fc.keyspace.flight("q")
    gate, started = asyncio.Event(), asyncio.Event()
    runs: list[int] = []

    async def loader() -> str:
        runs.append(1)
        started.set()
        if len(runs) == 1:
            await gate.wait()
            return "stale"
        return "fresh"

    task = asyncio.ensure_future(fc.do("q", loader))
    await asyncio.wait_for(started.wait(), 5)
    await redis_client.hset(fk.meta, "ownerToken", "999999999")  # another owner took over...
    await redis_client.pexpire(fk.meta, 400)  # ...and then died
    gate.set()
    assert await asyncio.wait_for(task, 5) == "fresh"
    assert fc.stats["fenced_writes"] == 1
    assert len(runs) == 2
    assert await fc.get("q") == "fresh"


async def test_heartbeat_gives_up_when_it_cannot_prove_its_lease() -> None:
    """Renewals that keep failing cancel the work once a whole lease has passed (fake clock)."""
    now = [0.0]
    attempts: list[float] = []

    async def renew() -> bool:
        attempts.append(now[0])
        now[0] += 0.4  # each failed try costs 0.4 s of (fake) time
        raise BackendUnavailable("down")

    work = asyncio.ensure_future(asyncio.sleep(60))
    hb = Heartbeat(renew, work, lease_s=0.03, digest="d", clock=lambda: now[0]).start()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(work, 5)
    await hb.stop()
    assert hb.lost and "no renewal" in hb.reason
    assert len(attempts) == 1  # 0.4 s > the 0.03 s lease: it gave up after the first failure


async def test_heartbeat_keeps_renewing_while_the_work_runs_and_stops_with_it() -> None:
    renewals: list[int] = []

    async def renew() -> bool:
        renewals.append(1)
        return True

    work = asyncio.ensure_future(asyncio.sleep(0.7))
    hb = Heartbeat(renew, work, lease_s=0.3, digest="d").start()
    await work
    count = len(renewals)
    await asyncio.sleep(0.3)
    await hb.stop()
    assert not hb.lost
    assert 3 <= count <= 8  # every lease/3 = 100 ms over 700 ms (a loaded machine is late)
    assert len(renewals) == count  # nothing after the work ended


async def test_lease_lost_cancels_the_loader_at_once(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """A renewal that finds another token cancels the running loader (the suicide rule)."""
    fc = make_cache(lease=0.3)
    fk = fc.keyspace.flight("q")
    cancelled, started = asyncio.Event(), asyncio.Event()
    runs: list[int] = []

    async def loader() -> str:
        runs.append(1)
        started.set()
        if len(runs) > 1:
            return "second"
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "first"

    task = asyncio.ensure_future(fc.do("q", loader))
    await asyncio.wait_for(started.wait(), 5)
    await redis_client.hset(fk.meta, "ownerToken", "999999999")
    await redis_client.pexpire(fk.meta, 300)
    await asyncio.wait_for(cancelled.wait(), 2)
    assert await asyncio.wait_for(task, 5) == "second"
    assert fc.stats["lease_lost"] == 1


async def test_heartbeat_gives_up_when_a_renewal_hangs_past_the_lease() -> None:
    """A renewal that never answers cannot prove the lease: the work is cancelled when the
    lease runs out, not when some socket timeout fires much later."""

    async def renew() -> bool:
        await asyncio.sleep(3600)
        return True

    work = asyncio.ensure_future(asyncio.sleep(60))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    hb = Heartbeat(renew, work, lease_s=0.3, digest="d").start()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(work, 5)
    await hb.stop()
    assert hb.lost
    assert 0.25 <= loop.time() - t0 <= 1.0


async def test_heartbeat_retries_any_flight_error_until_the_lease_is_unproven() -> None:
    calls: list[int] = []

    async def renew() -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise ConfigError("a passing refusal")
        return True

    work = asyncio.ensure_future(asyncio.sleep(0.5))
    hb = Heartbeat(renew, work, lease_s=0.3, digest="d").start()
    await work
    await hb.stop()
    assert not hb.lost
    assert len(calls) >= 3  # the failure was retried, and renewals went on
