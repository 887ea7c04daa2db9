"""Followers watch sessions (docs/protocol.md, "Followers watch sessions"): a follower of
flights bound to their owner's session re-checks that session once a lease for all of them,
and each flight only when meta's own TTL ran out; after a gap of its wake channel, it joins
each again. Real servers; the owner that stops is a real process (SIGSTOP)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from flightcache import EmbeddedServer
from flightcache._config import Tuning
from flightcache._protocol.session import Session

from .helpers.flights import wait_until
from .test_sessions import Held, _claimed_bound, _sessions

SCALE_WORKER = Path(__file__).with_name("helpers") / "scale_worker.py"


def _rechecks(fc: Any) -> Any:
    return fc._flights.follower.rechecks


async def _bound_flights(fc: Any, keys: list[str]) -> tuple[list[Any], list[Held]]:
    """``keys`` in flight, owned by ``fc`` and bound to its session (claimed once it was
    usable), their loaders held."""
    first, held = await _claimed_bound(fc, keys[0], f"v-{keys[0]}")
    loaders = [held, *(Held(f"v-{k}") for k in keys[1:])]
    rest = zip(keys[1:], loaders[1:], strict=True)
    calls = [first, *(asyncio.ensure_future(fc.do(k, h)) for k, h in rest)]
    await asyncio.wait_for(asyncio.gather(*(h.started.wait() for h in loaders)), 10)
    return calls, loaders


async def _never() -> str:
    raise AssertionError("the follower must not run a loader")


async def _followed(follower: Any, key: str) -> asyncio.Future[Any]:
    """``follower``'s call of ``key``, once it follows the flight (its loader never runs)."""
    follows = follower.stats["follows"]
    call = asyncio.ensure_future(follower.do(key, _never))
    await wait_until(lambda: follower.stats["follows"] > follows, 10, "the follow")
    return call


async def _all_bound(redis_client: aioredis.Redis, fc: Any, keys: list[str]) -> None:
    bound = [await redis_client.hget(fc.keyspace.flight(k).meta, "se") for k in keys]
    assert all(bound), f"{bound.count(None)} of {len(keys)} not bound"


async def test_a_follower_of_many_bound_flights_re_checks_their_session_not_each_flight(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """200 bound flights followed for three leases: the follower peeks their one session
    about once a lease and no flight at all (meta's own TTL, the 9 s backstop, has not run
    out); with their own leases it would have peeked each flight about three times."""
    tuning = Tuning(session_backstop_ms=9000)
    owner = make_cache(lease=1.0, near_cache=False, tuning=tuning)
    follower = make_cache(lease=1.0, near_cache=False, tuning=tuning)
    keys = [f"k{i}" for i in range(200)]
    calls, loaders = await _bound_flights(owner, keys)
    await _all_bound(redis_client, owner, keys)

    followed = [asyncio.ensure_future(follower.do(k, _never)) for k in keys]
    rechecks = _rechecks(follower)
    await wait_until(lambda: follower.stats["follows"] == 200, 10, "200 follows")
    assert len(rechecks._watches) == 1  # one session watched, for all 200
    peeks, sessions = rechecks.peeks, rechecks.session_peeks
    await asyncio.sleep(3.0)
    peeks, sessions = rechecks.peeks - peeks, rechecks.session_peeks - sessions
    assert peeks == 0, peeks
    assert 2 <= sessions <= 5, sessions  # one a lease (1 s, plus margin and spread)
    assert rechecks.woken == 0
    for h in loaders:
        h.release.set()
    assert await asyncio.gather(*calls) == [f"v-{k}" for k in keys]
    assert await asyncio.gather(*followed) == [f"v-{k}" for k in keys]
    assert not rechecks._watches  # the flights ended: the session is no longer watched
    assert follower.stats["loader_runs"] == 0


async def test_a_bound_flight_whose_own_keys_lapsed_while_its_session_lives_is_taken_over(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """The owner keeps its session but stops renewing one flight's own keys (an owner that
    abandoned a flight without a write): its meta lapses at the backstop with no message,
    and the follower, whose session check keeps saying alive, finds it with the flight's own
    peek, due when meta's TTL runs out, and takes it over."""
    tuning = Tuning(session_backstop_ms=3000)
    owner = make_cache(lease=1.0, near_cache=False, tuning=tuning)
    follower = make_cache(lease=1.0, near_cache=False, tuning=tuning)
    call, held = await _claimed_bound(owner, "q", "stale")
    fk = owner.keyspace.flight("q")
    assert await redis_client.hget(fk.meta, "se")
    renewer = owner._flights.renewer
    (lease,) = [
        lease
        for lease in list(renewer._leases.values())
        if not isinstance(lease.args, Session) and fk.meta in str(lease.args)
    ]
    renewer.remove(lease)  # the owner renews its session only
    fresh = Held("fresh")
    taking = asyncio.ensure_future(follower.do("q", fresh))
    await wait_until(lambda: follower.stats["follows"] == 1, 10, "the follow")
    rechecks = _rechecks(follower)
    await asyncio.wait_for(fresh.started.wait(), 15)  # the backstop (3 s) and a margin
    assert rechecks.peeks >= 1 and rechecks.session_peeks >= 1
    session = _sessions(owner).current
    assert session is not None and not session.ended  # its session lived throughout
    # (its stream and waiters lapsed with meta: the claim counts as a first attempt)
    fresh.release.set()
    assert await asyncio.wait_for(taking, 10) == "fresh"
    held.release.set()
    assert await asyncio.wait_for(call, 10) == "fresh"  # fenced: it returns the new value
    assert follower.stats["loader_runs"] == 1 and fresh.runs == 1


async def test_a_gap_in_the_wake_channel_makes_every_bound_flights_follower_join_again(
    make_cache: Any, server: EmbeddedServer, redis_client: aioredis.Redis
) -> None:
    """A bound flight vanishes with no message (its meta and stream deleted, as a failover to
    a replica that lacks them would), and the follower's listener connection is killed: the
    follower joins again as soon as its channel is back and takes the flight over, long
    before its session check (alive) or meta's own TTL (60 s) would have had it join."""
    tuning = Tuning(session_backstop_ms=60_000)
    owner = make_cache(lease=5.0, near_cache=False, tuning=tuning)
    follower = make_cache(lease=5.0, near_cache=False, tuning=tuning)
    call, held = await _claimed_bound(owner, "g", "stale")
    fk = owner.keyspace.flight("g")
    fresh = Held("fresh")
    taking = asyncio.ensure_future(follower.do("g", fresh))
    await wait_until(lambda: follower.stats["follows"] == 1, 10, "the follow")
    rechecks = _rechecks(follower)
    assert len(rechecks._watches) == 1
    await redis_client.delete(fk.meta, fk.stream)
    listener = follower._conn.listener
    reconnects = listener.reconnects
    killed = 0
    for client in await redis_client.client_list():
        if f"{follower.node_id}:listen" in client.get("name", ""):
            killed += await redis_client.client_kill_filter(_id=client["id"])
    assert killed == 1
    t0 = time.monotonic()
    await asyncio.wait_for(fresh.started.wait(), 20)  # well before 60 s
    assert time.monotonic() - t0 < 20
    assert listener.reconnects > reconnects
    assert rechecks.woken >= 1  # woken by the gap (its session check, at 5 s, says alive)
    fresh.release.set()
    assert await asyncio.wait_for(taking, 10) == "fresh"
    held.release.set()
    assert await asyncio.wait_for(call, 10) == "fresh"


@pytest.mark.timeout(120)
async def test_followers_of_a_stopped_owners_bound_flights_take_them_all_over(
    make_cache: Any, server: EmbeddedServer, namespace: str, tmp_path: Path
) -> None:
    """An owner process holds 300 flights bound to its session (warmed first); the follower
    watches the session, peeking the bound flights none at all, until the owner is stopped
    (SIGSTOP): then its session lapses, the watch wakes every follower of a bound flight,
    and the follower takes over all 300 (any unbound one by its own peek) with the right
    values."""
    n = 300
    cfg = {
        "url": server.url,
        "namespace": namespace,
        "keys": n,
        "role": "owner",
        "loader_s": 120.0,
        "lease": 1.0,
        "markers": str(tmp_path),
        "warm_s": 0.8,  # (a session starts after lease/3 of owning)
    }
    proc = subprocess.Popen(  # noqa: ASYNC220 (started once; the test waits on the server)
        [sys.executable, str(SCALE_WORKER), json.dumps(cfg)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        await wait_until(lambda: (tmp_path / "owning").exists(), 30, "the owner's 300 flights")
        follower = make_cache(lease=1.0, near_cache=False)
        admin = aioredis.Redis.from_url(server.url)
        metas = [follower.keyspace.flight(f"key-{i}").meta for i in range(n)]
        bound = len([m for m in metas if await admin.hget(m, "se")])
        await admin.aclose()
        assert bound >= n - 20, bound

        async def take(i: int) -> str:
            return f"taken-{i}"

        calls = [
            asyncio.ensure_future(follower.do(f"key-{i}", lambda i=i: take(i))) for i in range(n)
        ]
        rechecks = _rechecks(follower)
        await wait_until(lambda: follower.stats["follows"] == n, 20, "300 follows")
        peeks = rechecks.peeks
        await asyncio.sleep(2.0)
        # only the unbound flights are peeked one by one: about once a lease each
        assert rechecks.peeks - peeks <= (n - bound) * 4, (rechecks.peeks - peeks, bound)
        sessions = rechecks.session_peeks
        woken = rechecks.woken
        os.kill(proc.pid, signal.SIGSTOP)
        values = await asyncio.wait_for(asyncio.gather(*calls), 60)
        assert values == [f"taken-{i}" for i in range(n)]
        assert follower.stats["loader_runs"] == n
        assert rechecks.session_peeks > sessions
        assert rechecks.woken - woken >= bound  # the watch woke each bound flight's follower
    finally:
        proc.kill()
        proc.wait(10)


async def test_a_follower_whose_join_crossed_a_gap_joins_again_before_it_watches_the_session(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """The follower's listener connection is killed, and is back, between its join's send and
    its answer: that answer says bound, but the node may have missed the end or left the
    waiters list meanwhile, so it does not watch the session from it; it joins again, and
    watches from that join's answer."""
    owner = make_cache(lease=5.0, near_cache=False)
    follower = make_cache(lease=5.0, near_cache=False)
    call, held = await _claimed_bound(owner, "x", "the value")
    flights = follower._flights
    listener = follower._conn.listener
    original = flights._join
    joins: list[int] = []

    async def join(*args: Any, **kwargs: Any) -> Any:
        state = await original(*args, **kwargs)
        joins.append(state.kind)
        if len(joins) == 1:  # a gap after the first join was sent, over before it returns
            reconnects = listener.reconnects
            for client in await redis_client.client_list():
                if f"{follower.node_id}:listen" in client.get("name", ""):
                    await redis_client.client_kill_filter(_id=client["id"])
            await wait_until(
                lambda: listener.reconnects > reconnects and listener.subscribed, 10, "a gap"
            )
        return state

    flights._join = join

    followed = asyncio.ensure_future(follower.do("x", _never))
    rechecks = _rechecks(follower)
    await wait_until(lambda: len(rechecks._watches) == 1, 10, "the session watched")
    assert joins == [2, 2]  # follow, then follow again (FOLLOW = 2) before watching
    held.release.set()
    assert await asyncio.wait_for(followed, 10) == "the value"
    assert await asyncio.wait_for(call, 10) == "the value"


async def test_a_flagged_read_that_finds_the_stream_gone_peeks_the_flight_itself(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """A follower of a bound flight hears nothing (its listener closed), the flight ends and
    its stream lapses (deleted here, as after a stall longer than its linger), and the
    follower's waiter is flagged for a read, as the sync fast path's is: the read finds
    nothing, so the follower peeks the flight itself and finds the result, where its session
    (alive) and meta's own TTL (60 s) would have kept it waiting."""
    tuning = Tuning(session_backstop_ms=60_000)
    owner = make_cache(lease=5.0, near_cache=False, tuning=tuning)
    follower = make_cache(lease=5.0, near_cache=False, tuning=tuning)
    call, held = await _claimed_bound(owner, "e", "the value")
    fk = owner.keyspace.flight("e")

    followed = await _followed(follower, "e")
    rechecks = _rechecks(follower)
    assert len(rechecks._watches) == 1
    await follower._conn.listener.aclose()  # deaf from now on: the end is not heard
    held.release.set()
    assert await asyncio.wait_for(call, 10) == "the value"
    await redis_client.delete(fk.stream)
    peeks = rechecks.peeks
    (waiter,) = follower._flights.hub._waiters[fk.digest]
    waiter.lost()
    assert await asyncio.wait_for(followed, 4) == "the value"
    assert rechecks.peeks > peeks


async def test_the_waiters_list_a_follower_makes_lives_as_long_as_a_bound_flights_meta(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """The first follower of a bound flight makes its waiters list: the list gets meta's own
    TTL (up to the backstop), not the join's lease and linger (1.5 s here), which would lapse
    before the owner's first renewal of its keys (every half of the 9 s backstop) and take the
    follower out of the flight's wake-ups; the end 2.5 s later reaches it by its message."""
    tuning = Tuning(session_backstop_ms=9000, stream_linger_ms=500)
    owner = make_cache(lease=1.0, near_cache=False, tuning=tuning)
    follower = make_cache(lease=1.0, near_cache=False, tuning=tuning)
    call, held = await _claimed_bound(owner, "w", "the value")
    fk = owner.keyspace.flight("w")

    followed = await _followed(follower, "w")
    assert await redis_client.pttl(fk.waiters) > 5000
    await asyncio.sleep(2.5)  # past the join's own 1.5 s, before the owner's renewal at 4.5 s
    assert await redis_client.exists(fk.waiters)
    held.release.set()
    assert await asyncio.wait_for(followed, 1.5) == "the value"  # (its session check: 1 s)
    assert await call == "the value"
    rechecks = _rechecks(follower)
    assert rechecks.peeks == 0 and rechecks.woken == 0  # the message, not a re-check
