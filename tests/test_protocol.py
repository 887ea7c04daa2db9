"""The protocol's parts on a real server: fenced scripts, script reloading, the heartbeat."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from flightcache import BackendUnavailable, ConfigError, EmbeddedServer
from flightcache._config import Tuning
from flightcache._protocol.flight import LUA
from flightcache._protocol.heartbeat import Heartbeat, Renewer

from .helpers.monitor import CommandLog


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


async def _taken_over(
    fc: Any, redis_client: aioredis.Redis
) -> tuple[asyncio.Future[Any], asyncio.Event]:
    """``fc.do("q")`` whose first run waits, once another token holds its flight (for 0.3 s,
    then it lapses); its second run returns "second". The call, and an event set when the
    first run is cancelled."""
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
    return task, cancelled


async def test_lease_lost_cancels_the_loader_at_once(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """A renewal that finds another token cancels the running loader (the suicide rule)."""
    fc = make_cache(lease=0.3)
    task, cancelled = await _taken_over(fc, redis_client)
    await asyncio.wait_for(cancelled.wait(), 2)
    assert await asyncio.wait_for(task, 5) == "second"
    assert fc.stats["lease_lost"] == 1


async def test_a_lease_whose_renewal_the_server_refused_is_not_given_back(
    make_cache: Any, redis_client: aioredis.Redis, server: EmbeddedServer
) -> None:
    """A renewal refused (another token holds the flight) gives the lease up, and no
    give-back follows: the server said the token holds nothing, and ``fail_flight`` asks it
    the same (docs/protocol.md, "A lease given up is given back"). Counted on the wire with
    MONITOR: no ``fail_flight`` at all, while the owner's retry completes."""
    fc = make_cache(lease=0.3)
    log = CommandLog("127.0.0.1", server.port)
    try:
        task, _cancelled = await _taken_over(fc, redis_client)
        assert await asyncio.wait_for(task, 5) == "second"
        await asyncio.sleep(0.2)  # let MONITOR catch up
    finally:
        log.close()
    assert fc.stats["lease_lost"] == 1
    assert log.scripts[LUA["complete_flight"].sha.decode()] == 1, log.scripts  # (it saw)
    assert log.scripts[LUA["fail_flight"].sha.decode()] == 0, log.scripts


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


async def test_a_short_renewal_extends_the_lease_only_and_a_full_one_the_stream_and_waiters(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    fc = make_cache()
    fk = fc.keyspace.flight("q")
    await redis_client.hset(fk.meta, mapping={"ownerToken": "7", "status": "RUNNING"})
    await redis_client.xadd(fk.stream, {"t": "claimed"})
    await redis_client.rpush(fk.waiters, "node")
    for key in (fk.stream, fk.waiters):
        await redis_client.pexpire(key, 60_000)
    keys = (fk.meta, fk.stream, fk.waiters)

    async def ttls() -> list[int]:
        return [await redis_client.pttl(key) for key in keys]

    assert await fc._conn.script(LUA["renew_leases"], fk, keys, (7, 5000, 0, "")) == [1]
    meta, stream, waiters = await ttls()
    assert 4000 < meta <= 5000
    assert 50_000 < stream <= 60_000 and 50_000 < waiters <= 60_000  # untouched
    assert await fc._conn.script(LUA["renew_leases"], fk, keys, (7, 5000, 20_000, "")) == [1]
    meta, stream, waiters = await ttls()
    assert 4000 < meta <= 5000
    assert 19_000 < stream <= 20_000 and 19_000 < waiters <= 20_000
    # A stale token extends nothing, short or full.
    assert await fc._conn.script(LUA["renew_leases"], fk, keys, (6, 90_000, 90_000, "")) == [0]
    assert max(await ttls()) <= 20_000


async def test_renewals_are_full_at_least_every_few_sends_counting_the_unanswered() -> None:
    """``full_every=2``: at most two short renewals sent since the last full one answered;
    a full one that failed is sent full again, a short one that failed still counts."""
    sent: list[bool] = []
    failing = {2, 6}  # the 3rd send (a short one) and the 7th (a full one) fail

    async def renew(batch: Any) -> list[bool]:
        sent.append(batch[0].take_full())
        if len(sent) - 1 in failing:
            raise BackendUnavailable("down")
        return [True]

    renewer = Renewer(renew)
    work = asyncio.ensure_future(asyncio.sleep(60))
    lease = renewer.add(work, lease_s=0.3, digest="d", full_every=2)
    try:
        for _ in range(500):
            if len(sent) >= 9:
                break
            await asyncio.sleep(0.01)
    finally:
        work.cancel()
        await renewer.aclose()
    assert not lease.lost
    # full, short, short (fails, counted), full, short, short, full (fails), full, short
    assert sent[:9] == [True, False, False, True, False, False, True, True, False]


async def test_with_short_renewals_the_stream_and_waiters_outlive_the_lease_all_flight_long(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """A 0.3 s lease with a 0.6 s linger: a full renewal every other one (short_renewals).
    Sampled every 10 ms (MULTI) for 3 s of a followed flight (waiters exist): the stream's
    and waiters' PTTL never fall below the lease's, and the server ran fewer PEXPIREs than
    full renewals cost (three each)."""
    tuning = Tuning(stream_linger_ms=600, session_backstop_ms=0)  # (a flight's own lease)
    owner = make_cache(lease=0.3, tuning=tuning, near_cache=False)
    follower = make_cache(lease=0.3, tuning=tuning, near_cache=False)
    fk = owner.keyspace.flight("q")
    started, release = asyncio.Event(), asyncio.Event()

    async def loader() -> str:
        started.set()
        await release.wait()
        return "v"

    async def follower_loader() -> str:
        return "the follower's loader ran"

    async def pexpires() -> int:
        stats = await redis_client.info("commandstats")
        return int(stats.get("cmdstat_pexpire", {}).get("calls", 0))

    own = asyncio.ensure_future(owner.do("q", loader))
    await asyncio.wait_for(started.wait(), 5)
    follow = asyncio.ensure_future(follower.do("q", follower_loader))
    try:
        for _ in range(500):
            if await redis_client.exists(fk.waiters):
                break
            await asyncio.sleep(0.01)
        lease = next(iter(owner._flights.renewer._leases.values()))  # type: ignore[union-attr]
        renewals, before = lease.renewals, await pexpires()
        samples: list[tuple[int, int, int]] = []
        loop = asyncio.get_running_loop()
        until = loop.time() + 3.0
        while loop.time() < until:
            async with redis_client.pipeline(transaction=True) as pipe:
                meta, stream, waiters = (
                    await pipe.pttl(fk.meta).pttl(fk.stream).pttl(fk.waiters).execute()
                )
            samples.append((meta, stream, waiters))
            await asyncio.sleep(0.01)
        renewals, sent = lease.renewals - renewals, await pexpires() - before
    finally:
        release.set()
        results = await asyncio.gather(own, follow, return_exceptions=True)
    assert results == ["v", "v"]
    assert owner.stats["lease_lost"] == 0
    worst = min(samples, key=lambda s: min(s[1], s[2]) - s[0])
    assert all(0 < meta <= min(stream, waiters) for meta, stream, waiters in samples), worst
    assert renewals >= 15  # every 0.1 s for 3 s (a loaded machine is late)
    assert sent <= 2.2 * renewals  # 2 a renewal, half of them short; 3 if all were full
