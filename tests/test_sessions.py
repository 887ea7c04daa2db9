"""Session leases on a real server (docs/protocol.md, "Sessions"): a flight claimed while its
owner has a session is bound to it, lives while the session holds its epoch, and is fenced
and taken over once it does not; a renewal never brings a lapsed session back."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.connection

from flightcache import EmbeddedServer
from flightcache._config import Tuning
from flightcache._protocol.flight import LUA
from flightcache._protocol.renewals import KEEP_BATCH
from flightcache._protocol.session import Session

from .helpers.monitor import CommandLog


def _sessions(fc: Any) -> Any:
    return fc._flights.owner.sessions


async def _usable_session(fc: Any) -> Session:
    """The owner's session, once claims bind to it (bounded: 3 s)."""
    for _ in range(300):
        session = _sessions(fc).current
        if session is not None and session.usable():
            return session  # type: ignore[no-any-return]
        await asyncio.sleep(0.01)  # (test polling: the session starts on its own thread)
    raise AssertionError("no usable session in 3 s")


class Held:
    """A loader that runs until released."""

    def __init__(self, value: str) -> None:
        self.value = value
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.runs = 0

    async def __call__(self) -> str:
        self.runs += 1
        self.started.set()
        await self.release.wait()
        return self.value


async def _claimed_bound(fc: Any, key: str, value: str) -> tuple[asyncio.Future[Any], Held]:
    """A flight of ``key`` owned by ``fc``, claimed once its session was usable."""
    warm = Held("warm")
    warming = asyncio.ensure_future(fc.do(f"{key}:warm", warm))  # owning starts a session
    await asyncio.wait_for(warm.started.wait(), 5)
    await _usable_session(fc)
    held = Held(value)
    call = asyncio.ensure_future(fc.do(key, held))
    await asyncio.wait_for(held.started.wait(), 5)
    warm.release.set()
    assert await warming == "warm"
    return call, held


async def test_renew_session_starts_renews_and_never_brings_a_lapsed_session_back(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    fc = make_cache()
    fk = fc.keyspace.flight("s")
    conn = fc._conn
    key = fc.keyspace.session("node-a")

    async def renew(epoch: str, start: str) -> int:
        return int(await conn.script(LUA["renew_session"], fk, (key,), (epoch, 5000, start)))

    assert await renew("e1", "0") == 0  # nothing to renew: and nothing made
    assert not await redis_client.exists(key)
    assert await renew("e1", "1") == 1
    assert await redis_client.get(key) == b"e1"
    await redis_client.pexpire(key, 100)
    assert await renew("e1", "0") == 1
    assert 4000 < await redis_client.pttl(key) <= 5000
    assert await renew("e2", "0") == 0  # another epoch: refused, untouched
    assert await redis_client.get(key) == b"e1"
    assert await renew("e2", "1") == 1  # a new epoch replaces the old one
    assert await renew("e1", "0") == 0
    await redis_client.delete(key)  # it lapsed
    assert await renew("e2", "0") == 0
    assert not await redis_client.exists(key)


async def test_a_claim_made_with_a_usable_session_is_bound_to_it(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """Meta names the epoch and lives for the backstop; a follower is told the session's
    lease left; the result is written as usual."""
    fc = make_cache(lease=0.6, near_cache=False)
    follower = make_cache(lease=0.6, near_cache=False)
    call, held = await _claimed_bound(fc, "q", "v")
    fk = fc.keyspace.flight("q")
    session = _sessions(fc).current
    assert await redis_client.hget(fk.meta, "se") == session.epoch.encode()
    assert await redis_client.get(session.key) == session.epoch.encode()
    backstop = fc._flights.tuning.session_backstop_ms
    assert 600 < await redis_client.pttl(fk.meta) <= backstop
    assert await redis_client.pttl(session.key) <= 600
    info = await follower.inspect("q")
    assert info.state == "running"
    assert info.lease_left_ms is not None and info.lease_left_ms <= 600
    following = asyncio.ensure_future(follower.do("q", Held("the follower's")))
    await asyncio.sleep(1.5)  # a few session renewals; no flight renewal needed
    assert not following.done()
    held.release.set()
    assert await call == "v"
    assert await asyncio.wait_for(following, 5) == "v"
    assert held.runs == 1
    assert fc.stats["lease_lost"] == 0


async def test_a_bound_flight_whose_session_lapsed_is_fenced_and_taken_over(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """Deleting the session key (what a lapse does) ends the flight's liveness at once: the
    owner's result is refused, a follower claims the flight (attempt 2) and stores its own;
    the owner loses its flight (its renewal answers 0) and follows."""
    fc = make_cache(lease=0.6, near_cache=False)
    other = make_cache(lease=0.6, near_cache=False)
    call, _held = await _claimed_bound(fc, "q", "stale")
    fk = fc.keyspace.flight("q")
    session = _sessions(fc).current
    await redis_client.hset(fk.meta, "invalidated", "1")  # must not carry over
    await redis_client.delete(session.key)
    fresh = Held("fresh")
    taking = asyncio.ensure_future(other.do("q", fresh))
    await asyncio.wait_for(fresh.started.wait(), 5)
    meta = await redis_client.hgetall(fk.meta)
    assert meta[b"attempts"] == b"2"
    assert b"invalidated" not in meta
    for _ in range(300):  # its next renewal (lease/3) answers 0: bounded at 3 s
        if session.ended:
            break
        await asyncio.sleep(0.01)
    assert session.ended
    fresh.release.set()
    assert await asyncio.wait_for(taking, 5) == "fresh"
    assert await asyncio.wait_for(call, 10) == "fresh"  # its loader cancelled: it followed
    assert await fc.get("q") == "fresh"
    assert fc.stats["lease_lost"] == 1
    assert fc.stats["fenced_writes"] == 0  # (it lost the flight before it had a value)
    assert _sessions(fc).current is None or _sessions(fc).current is not session


async def test_the_flights_of_a_session_the_server_refused_are_not_given_back(
    make_cache: Any, redis_client: aioredis.Redis, server: EmbeddedServer
) -> None:
    """A session renewal refused (its key gone: a lapse) ends the epoch and gives its bound
    flights up; none is given back (``fail_flight``): none of them is this token's on the
    server any more, so each give-back would be refused in turn. Counted on the wire with
    MONITOR; the call claims the flight again and completes."""
    fc = make_cache(lease=0.6, near_cache=False)
    call, held = await _claimed_bound(fc, "q", "v")
    session = _sessions(fc).current
    log = CommandLog("127.0.0.1", server.port)
    try:
        await redis_client.delete(session.key)
        for _ in range(300):  # its next renewal (lease/3) answers 0: bounded at 3 s
            if session.ended:
                break
            await asyncio.sleep(0.01)
        assert session.ended and session.refused
        held.release.set()
        assert await asyncio.wait_for(call, 10) == "v"
        await asyncio.sleep(0.2)  # let MONITOR catch up
    finally:
        log.close()
    assert held.runs == 2  # given up, then claimed again
    assert fc.stats["lease_lost"] == 1
    assert log.scripts[LUA["complete_flight"].sha.decode()] == 1, log.scripts  # (it saw)
    assert log.scripts[LUA["fail_flight"].sha.decode()] == 0, log.scripts


async def test_a_stale_owners_write_is_refused_once_its_session_lapsed(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """The fence reads the session in the same script: a bound meta whose session key is
    gone refuses complete_flight, renew_leases and fail_flight from its own token."""
    fc = make_cache(lease=5.0, near_cache=False)
    call, held = await _claimed_bound(fc, "q", "v")
    fk = fc.keyspace.flight("q")
    conn = fc._conn
    session = _sessions(fc).current
    token = (await redis_client.hget(fk.meta, "ownerToken")).decode()
    keys = (fk.result, fk.meta, fk.stream, fk.waiters)
    renew = (fk.meta, fk.stream, fk.waiters), (token, 30_000, 30_000, "")
    assert await conn.script(LUA["renew_leases"], fk, *renew) == [1]
    await redis_client.set(session.key, "another-epoch")
    assert await conn.script(LUA["renew_leases"], fk, *renew) == [0]
    done = (token, b"jstale", 60_000, "1", 1000, "", 5)
    assert await conn.script(LUA["complete_flight"], fk, (*keys, fk.cost), done) == 0
    assert await redis_client.get(fk.result) is None
    assert await conn.script(LUA["fail_flight"], fk, keys, (token, "reset", b"", 1000)) == 0
    peek = await conn.script(LUA["peek_flight"], fk, (fk.meta,), (b"0-0",))
    assert peek == [-1]
    claim = await redis_client.hget(fk.meta, "claimEntry")
    assert await conn.script(LUA["peek_flight"], fk, (fk.meta,), (claim,)) == [-1]
    await redis_client.set(session.key, session.epoch)
    left = await conn.script(LUA["peek_flight"], fk, (fk.meta,), (claim,))
    assert left[0] == -1 or int(left[0][0]) > 0  # (bound: meta's TTL, node, epoch, session's)
    held.release.set()
    await asyncio.wait_for(call, 10)


async def test_an_owner_of_many_bound_flights_renews_their_liveness_in_one_command(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """300 bound flights, lease 1 s, backstop 9 s: over 3 s the server runs one
    renew_session per tick, and the flights' own renewals come at most once each (every half
    of the backstop, 4.5 s), not every lease/3 (which would be 9 each). (A shorter lease is
    given up by a loaded CI machine whose loop the burst of 300 calls holds for more than 2/3
    of it.)"""
    tuning = Tuning(session_backstop_ms=9000)
    fc = make_cache(lease=1.0, near_cache=False, tuning=tuning)
    call, held = await _claimed_bound(fc, "first", "v")
    loaders = [Held(f"v{i}") for i in range(300)]
    calls = [asyncio.ensure_future(fc.do(f"k{i}", h)) for i, h in enumerate(loaders)]
    await asyncio.wait_for(asyncio.gather(*(h.started.wait() for h in loaders)), 10)
    metas = [fc.keyspace.flight(f"k{i}").meta for i in range(300)]
    bound = [await redis_client.hget(m, "se") for m in metas]
    assert all(bound), f"{bound.count(None)} of 300 not bound"

    async def sha_calls() -> dict[str, int]:
        stats = await redis_client.info("commandstats")
        return {k: int(v["calls"]) for k, v in stats.items() if k.startswith("cmdstat_")}

    leases = list(fc._flights.renewer._leases.values())
    own = [lease for lease in leases if not isinstance(lease.args, Session)]
    assert len(own) == 301
    session = _sessions(fc).current.lease
    renewals, ticks = sum(lease.renewals for lease in own), session.renewals
    before = await sha_calls()
    await asyncio.sleep(3.0)
    ran = {k: v - before.get(k, 0) for k, v in (await sha_calls()).items()}
    renewals = sum(lease.renewals for lease in own) - renewals
    ticks = session.renewals - ticks
    # The session every lease/3 (about 9 times in 3 s); each flight's own keys every half
    # of the backstop (4.5 s): at most once each in 3 s, where a lease of its own would have
    # been renewed 9 times. The server's PEXPIREs are those and nothing
    # else: three a flight renewal, one a session renewal, and at most one more renewal
    # of each flight run in the window but settled after it (a batch at its end).
    assert 4 <= ticks <= 15, ticks
    assert renewals <= 301, renewals
    assert ran.get("cmdstat_pexpire", 0) <= (renewals + 301) * 3 + ticks + 1, ran
    for h in (held, *loaders):
        h.release.set()
    results = await asyncio.gather(call, *calls)
    assert results == ["v", *(f"v{i}" for i in range(300))]
    assert fc.stats["lease_lost"] == 0


async def test_bound_flights_keys_are_renewed_in_short_scripts(
    make_cache: Any, redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 bound flights, lease 1 s, backstop 2 s: their own keys fall due together (every
    half of the backstop), and the renewals' thread renews them in scripts of at most
    ``KEEP_BATCH`` flights, not ``renew_batch`` (a script of 200 held the server for ~4 ms,
    and every wake-up due then waited behind it); each is renewed, none given up. The
    scripts are read off what the thread writes: ``renew_leases`` with its key count."""
    sha = LUA["renew_leases"].sha
    sizes: list[int] = []  # flights in each renew_leases the thread writes
    send = redis.connection.AbstractConnection.send_packed_command

    def spy(self: Any, command: Any, check_health: bool = True) -> None:
        data = b"".join(command) if isinstance(command, list) else bytes(command)
        if threading.current_thread().name == "flightcache-renew" and sha in data:
            # *<n>\r\n$7\r\nEVALSHA\r\n$40\r\n<sha>\r\n$<len>\r\n<numkeys>\r\n
            numkeys = data.split(sha, 1)[1].split(b"\r\n")[2]
            sizes.append(int(numkeys) // 3)
        send(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", spy)
    fc = make_cache(lease=1.0, near_cache=False, tuning=Tuning(session_backstop_ms=2000))
    call, held = await _claimed_bound(fc, "first", "v")
    loaders = [Held(f"v{i}") for i in range(200)]
    calls = [asyncio.ensure_future(fc.do(f"k{i}", h)) for i, h in enumerate(loaders)]
    await asyncio.wait_for(asyncio.gather(*(h.started.wait() for h in loaders)), 10)
    metas = [fc.keyspace.flight(f"k{i}").meta for i in range(200)]
    assert all([await redis_client.hget(m, "se") for m in metas])  # bound at their claims
    own = [x for x in fc._flights.renewer._leases.values() if not isinstance(x.args, Session)]
    before = sum(lease.renewals for lease in own)
    for _ in range(400):  # due 1 s after their claims; bounded at 4 s
        if sum(lease.renewals for lease in own) - before >= 200:
            break
        await asyncio.sleep(0.01)
    assert sum(lease.renewals for lease in own) - before >= 200, sizes
    assert sizes and max(sizes) <= KEEP_BATCH < 200, sizes
    assert sum(sizes) >= 200, sizes
    for h in (held, *loaders):
        h.release.set()
    results = await asyncio.gather(call, *calls)
    assert results == ["v", *(f"v{i}" for i in range(200))]
    assert fc.stats["lease_lost"] == 0


async def test_an_idle_owner_ends_its_session_and_renews_nothing(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    fc = make_cache(lease=0.3, near_cache=False)
    call, held = await _claimed_bound(fc, "q", "v")
    session = _sessions(fc).current
    held.release.set()
    assert await call == "v"
    for _ in range(300):  # 3 leases of idleness end it (0.9 s); bounded at 3 s
        if session.ended:
            break
        await asyncio.sleep(0.01)
    assert session.ended
    assert _sessions(fc).current is None
    await asyncio.sleep(0.5)
    assert not await redis_client.exists(session.key)  # not renewed: it lapsed
    assert not fc._flights.renewer._leases


async def test_a_call_lease_other_than_the_caches_is_not_bound(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    fc = make_cache(lease=0.6, near_cache=False)
    call, held = await _claimed_bound(fc, "q", "v")
    other = Held("w")
    odd = asyncio.ensure_future(fc.do("odd", other, lease=1.2))
    await asyncio.wait_for(other.started.wait(), 5)
    meta = await redis_client.hgetall(fc.keyspace.flight("odd").meta)
    assert b"se" not in meta
    assert await redis_client.pttl(fc.keyspace.flight("odd").meta) <= 1200
    held.release.set()
    other.release.set()
    assert await call == "v"
    assert await odd == "w"


async def test_no_session_with_the_backstop_off(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    fc = make_cache(lease=0.6, near_cache=False, tuning=Tuning(session_backstop_ms=0))
    held = Held("v")
    call = asyncio.ensure_future(fc.do("q", held))
    await asyncio.wait_for(held.started.wait(), 5)
    assert _sessions(fc) is None
    assert await redis_client.hget(fc.keyspace.flight("q").meta, "se") is None
    held.release.set()
    assert await call == "v"
