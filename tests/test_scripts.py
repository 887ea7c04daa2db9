"""The fenced scripts under stale tokens, and the claim scripts under driver retries.

Every write an owner makes is a script that checks its token in the same call
(docs/protocol.md, "What the fencing token protects"); these tests try the two writes no
other test tried with a stale token, ``append_chunks`` and ``fail_flight`` with ``reset``,
first by calling the script directly, then through a real owner whose token was replaced
under it. The last tests resend ``join_flight`` and ``confirm_claim`` as redis-py's retry may
after a lost reply, and check that they answer the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from flightcache import EmbeddedServer, FlightCache, FlightError, StreamRestarted
from flightcache._backends.redis import RedisConnection
from flightcache._protocol.flight import LUA
from flightcache._protocol.wakeup import parse_message

from .helpers.flights import wait_for_flight, wait_until

STALE = "999999999"  # a token that is not the owner's


async def _stream_events(client: Any, stream: str) -> list[dict[bytes, bytes]]:
    return [fields for _id, fields in await client.xrange(stream)]


async def test_append_chunks_with_a_stale_token_is_refused_and_writes_nothing(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    fc = make_cache()
    await fc.get("warm-up")
    conn = fc._conn
    fk = fc.keyspace.flight("q")
    await redis_client.hset(fk.meta, mapping={"ownerToken": "7", "status": "RUNNING"})
    await redis_client.rpush(fk.waiters, "some-node")
    # KEYS meta, stream, waiters; ARGV token, first sequence number, ..., chunks. The token
    # is checked first: with a stale one nothing after it is read.
    refused = await conn.script(
        LUA["append_chunks"],
        fk,
        (fk.meta, fk.stream, fk.waiters),
        (6, 0, fc.keyspace.wake_prefix, fk.digest, 65536, "", b'"a chunk"'),
    )
    assert refused == 0
    assert await redis_client.exists(fk.stream) == 0  # no chunk event, no stream at all
    assert await redis_client.hget(fk.meta, "ownerToken") == b"7"
    assert await redis_client.pttl(fk.meta) == -1  # no TTL touched
    assert await redis_client.lrange(fk.waiters, 0, -1) == [b"some-node"]


async def test_the_wake_message_of_an_append_is_the_entries_it_appended_fields_and_all(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """``add_chunks`` writes each chunk's netstrings itself (not through ``wake_add``): what a
    waiting node hears must still be exactly the stream's new entries, ids and fields, and
    ``prev`` the entry before them; chunks that are empty, long, binary or look like
    netstrings included."""
    fc = make_cache()
    await fc.get("warm-up")
    fk = fc.keyspace.flight("q")
    token = "123456789012345"
    await redis_client.hset(fk.meta, mapping={"ownerToken": token, "status": "RUNNING"})
    await redis_client.rpush(fk.waiters, "node-a", "node-a")  # queued twice: told once
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(fc.keyspace.wake_prefix + "node-a")
    try:
        heard = []
        odd = [b"", b"x" * 300, "\u00e9".encode(), b"3:a,1:b", b"\x00\xff"]
        batches = [(0, [b'"first"']), (1, odd)]
        for seq, chunks in batches:
            before = await redis_client.xrevrange(fk.stream, count=1)
            written = await fc._conn.script(
                LUA["append_chunks"],
                fk,
                (fk.meta, fk.stream, fk.waiters),
                (token, seq, fc.keyspace.wake_prefix, fk.digest, 65536, "", *chunks),
            )
            assert written == 1
            message = None
            while message is None:
                message = await pubsub.get_message(timeout=5.0)
            digest, prev, entries = parse_message(message["data"])
            assert digest == fk.digest
            assert prev == (before[0][0] if before else b"0-0")
            heard += entries
            assert [fields[b"v"] for _, fields in entries] == chunks
        assert heard == await redis_client.xrange(fk.stream)
        assert [int(fields[b"s"]) for _, fields in heard] == list(range(6))
        assert await pubsub.get_message(timeout=0.2) is None  # one message a call, not two
    finally:
        await pubsub.aclose()


async def test_complete_flight_with_trailing_chunks_and_a_stale_token_writes_nothing(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """The chunks a stream's completion carries are written after the token check, in the
    same script: a stale owner's last chunks land nowhere. The current owner's land before
    its ``done``, numbered on from the ones appended before."""
    fc = make_cache()
    await fc.get("warm-up")
    conn = fc._conn
    fk = fc.keyspace.flight("q")
    await redis_client.hset(fk.meta, mapping={"ownerToken": "7", "status": "RUNNING"})
    keys = (fk.result, fk.meta, fk.stream, fk.waiters, fk.cost)

    def args(token: int) -> tuple[Any, ...]:
        # token, value, ttl, inline, linger, count, cost, prefix, digest, limit, claim id,
        # first trailing sequence number, trailing chunks
        prefix, digest = fc.keyspace.wake_prefix, fk.digest
        stored = (token, b'S["a","b"]', 60_000, "0", 10_000, "2", 5, prefix, digest, 65536)
        return (*stored, "", 0, b'"a"', b'"b"')

    assert await conn.script(LUA["complete_flight"], fk, keys, args(6)) == 0
    assert await redis_client.exists(fk.stream, fk.result) == 0  # no chunk, no done, no value
    assert await redis_client.hget(fk.meta, "ownerToken") == b"7"

    assert await conn.script(LUA["complete_flight"], fk, keys, args(7)) == 1
    events = await _stream_events(redis_client, fk.stream)
    assert [(e[b"t"], e.get(b"s"), e.get(b"v")) for e in events] == [
        (b"chunk", b"0", b'"a"'),
        (b"chunk", b"1", b'"b"'),
        (b"done", None, None),
    ]
    assert events[-1][b"n"] == b"2"


async def test_fail_flight_reset_with_a_stale_token_is_refused_and_writes_nothing(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    fc = make_cache()
    await fc.get("warm-up")
    conn = fc._conn
    fk = fc.keyspace.flight("q")
    await redis_client.hset(fk.meta, mapping={"ownerToken": "7", "status": "RUNNING"})
    await redis_client.rpush(fk.waiters, "some-node")
    refused = await conn.script(
        LUA["fail_flight"],
        fk,
        (fk.result, fk.meta, fk.stream, fk.waiters),
        (6, "reset", "", 0, 10_000, fc.keyspace.wake_prefix, fk.digest, 65536),
    )
    assert refused == 0
    assert await redis_client.exists(fk.stream) == 0  # no reset event
    assert await redis_client.hgetall(fk.meta) == {b"ownerToken": b"7", b"status": b"RUNNING"}
    assert await redis_client.pttl(fk.meta) == -1
    assert await redis_client.lrange(fk.waiters, 0, -1) == [b"some-node"]
    assert await redis_client.exists(fk.result) == 0


async def test_a_stream_owner_whose_token_was_replaced_cannot_append_its_next_chunk(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """A real stream owner: after chunk 0, another token takes the flight (as a takeover
    does); the owner's append of chunk 1 is refused, so no other process ever sees it. The
    owner then follows, and when that flight lapses, claims again and produces anew: its
    reader, which had the refused chunk, gets StreamRestarted; the stored stream is the new
    run's."""
    fc = make_cache(lease=9.0)  # renewals every 3 s: the append meets the new token first
    fk = fc.keyspace.flight("q")
    gate = asyncio.Event()
    runs: list[int] = []

    async def produce() -> AsyncIterator[int]:
        runs.append(1)
        yield 0
        await gate.wait()
        yield 1
        yield 2

    got: list[int] = []

    async def read() -> None:
        async for chunk in fc.stream("q", produce):
            got.append(chunk)

    reader = asyncio.ensure_future(read())
    info = await wait_for_flight(fc, "q")

    async def chunk_zero_appended() -> bool:
        return any(e.get(b"t") == b"chunk" for e in await _stream_events(redis_client, fk.stream))

    deadline = asyncio.get_running_loop().time() + 10
    while not await chunk_zero_appended():
        assert asyncio.get_running_loop().time() < deadline, "chunk 0 never appended"
        await asyncio.sleep(0.01)
    await redis_client.hset(fk.meta, "ownerToken", STALE)  # another owner holds the flight...
    await redis_client.pexpire(fk.meta, 1500)  # ...for a while, then dies
    gate.set()
    await wait_until(lambda: fc.stats["fenced_writes"] >= 1, 10, "the append to be fenced")
    events = await _stream_events(redis_client, fk.stream)
    own = str(info.token).encode()
    assert [e[b"s"] for e in events if e.get(b"t") == b"chunk" and e[b"tok"] == own] == [b"0"]
    with pytest.raises(StreamRestarted):
        await asyncio.wait_for(reader, 15)
    assert got[:1] == [0]  # (chunk 1 may have reached this process's own reader, no other)
    assert fc.stats["fenced_writes"] == 1
    assert await wait_until_stored(fc, "q") == [0, 1, 2]
    assert len(runs) == 2


async def wait_until_stored(fc: FlightCache, key: str, timeout: float = 10.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while not (value := await fc.get(key)):
        assert asyncio.get_running_loop().time() < deadline, f"{key!r} was never stored"
        await asyncio.sleep(0.02)
    return value


async def test_an_owner_closed_after_losing_its_flight_cannot_give_it_back(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """Closing a cache gives its flights back (fail_flight with reset). An owner whose flight
    another token holds by then must not reset that owner's flight: the reset is refused,
    meta and the queue stay as they are, no reset event reaches the followers."""
    fc = make_cache(lease=9.0)
    fk = fc.keyspace.flight("q")
    gate = asyncio.Event()

    async def loader() -> str:
        await gate.wait()
        return "never"

    task = asyncio.ensure_future(fc.do("q", loader))
    await wait_for_flight(fc, "q")
    await redis_client.hset(fk.meta, "ownerToken", STALE)
    await redis_client.rpush(fk.waiters, "a-follower-of-the-new-owner")
    before = await _stream_events(redis_client, fk.stream)
    await fc.aclose()
    with pytest.raises(FlightError, match="closed"):
        await task
    assert await redis_client.hget(fk.meta, "ownerToken") == STALE.encode()
    assert await _stream_events(redis_client, fk.stream) == before  # no reset event
    assert b"a-follower-of-the-new-owner" in await redis_client.lrange(fk.waiters, 0, -1)


# -- driver retries ----------------------------------------------------------------------------


@pytest.fixture
def resent(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, Any, Any]]]:
    """Every join_flight and confirm_claim of this process is sent twice, as redis-py's retry
    does when a reply is lost; the second reply is the one the library gets. Records
    (script, first reply, second reply)."""
    calls: list[tuple[str, Any, Any]] = []
    original = RedisConnection.script_timed  # (what RedisConnection.script calls too)

    async def twice(self: RedisConnection, lua: Any, fk: Any, keys: Any, args: Any) -> Any:
        first, waited = await original(self, lua, fk, keys, args)
        if lua.name not in ("join_flight", "confirm_claim"):
            return first, waited
        again, _ = await original(self, lua, fk, keys, args)
        calls.append((lua.name, first, again))
        return again, waited  # (the lease counts from the first: the earlier write)

    monkeypatch.setattr(RedisConnection, "script_timed", twice)
    yield calls


def _same_answer(name: str, first: Any, again: Any) -> bool:
    """The same decision: for a claim its attempts, entry and token; for a follow its token,
    rank and position. (Times left, which move on between the two sends, are not compared.)"""
    if name == "join_flight":
        kind = int(first[0])
        fields = {3: (0, 1, 2, 3), 2: (0, 1, 3, 4)}.get(kind, range(len(first)))
        return all(first[i] == again[i] for i in fields)
    return bool(first == again)


@pytest.mark.parametrize("where", ["one server", "cluster"])
async def test_join_and_confirm_answer_the_same_when_the_driver_resends_them(
    where: str,
    server: EmbeddedServer,
    namespace: str,
    resent: list[tuple[str, Any, Any]],
    request: Any,
) -> None:
    """A claim resent gets the same claim (not "follow your own flight"), a confirmation
    resent is confirmed again, a follower's join resent queues it once: the loader runs once
    and both processes get its value. On one server the join takes the token itself; on a
    Cluster (owner-seq on another slot) confirm_claim does."""
    if where == "cluster":
        cluster = request.getfixturevalue("cluster")
        url = cluster.url
        first = cluster.servers[0]
        admin: Any = RedisCluster(host=first.host, port=first.port)
    else:
        url = server.url
        admin = aioredis.Redis.from_url(server.url)
    owner = FlightCache(url, namespace=namespace)
    follower = FlightCache(url, namespace=namespace)
    gate = asyncio.Event()
    runs: list[int] = []

    async def loader() -> str:
        runs.append(1)
        await gate.wait()
        return "the value"

    try:
        task = asyncio.ensure_future(owner.do("q", loader))
        await wait_for_flight(owner, "q")
        other = asyncio.ensure_future(follower.do("q", loader))
        info = await wait_for_flight(owner, "q", followers=1)
        assert info.followers == 1  # queued once, though its join arrived twice
        fk = owner.keyspace.flight("q")
        claims = [e for e in await _stream_events(admin, fk.stream) if e[b"t"] == b"claimed"]
        assert len(claims) == 1  # one claim, though the claimer's join arrived twice
        gate.set()
        assert await asyncio.wait_for(task, 10) == await asyncio.wait_for(other, 10)
        assert runs == [1]
        names = [name for name, _first, _again in resent]
        assert "join_flight" in names
        if where == "cluster":
            assert "confirm_claim" in names
        kinds = {int(first[0]) for name, first, _ in resent if name == "join_flight"}
        assert {2, 3} <= kinds  # a follow and a claim were among the resent joins
        different = [r for r in resent if not _same_answer(*r)]
        assert not different, different
    finally:
        gate.set()
        await owner.aclose()
        await follower.aclose()
        await admin.aclose()
