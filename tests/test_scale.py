"""Scale across distinct keys: what a process costs grows with its work, not with the
number of flights it waits for (docs/protocol.md, "Waiting, claiming and renewing at scale")."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import json
import math
import os
import subprocess
import sys
import threading
import time
import types
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
import redis.asyncio.connection
import redis.connection

from flightcache import EmbeddedServer, FlightCache
from flightcache._backends import convoy as convoy_module
from flightcache._backends.convoy import Convoy
from flightcache._config import Tuning
from flightcache._protocol.rechecks import Recheck
from flightcache._protocol.renewals import Owned

from .helpers.flights import wait_for_flight, wait_until

SCALE_WORKER = Path(__file__).with_name("helpers") / "scale_worker.py"
SRC = Path(__file__).resolve().parents[1] / "src"


def _start(cfg: dict[str, Any]) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(SRC), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, str(SCALE_WORKER), json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _report(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"worker overran {timeout} s: {err[-2000:]}") from None
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, f"no report (exit {proc.returncode}): {err[-2000:]}"
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def _connections(admins: list[redis.Redis], pid: int) -> tuple[int, int]:
    """The connections of process ``pid`` on every server (by its client names), and how
    many of them sit in a blocking command."""
    total = blocked = 0
    for admin in admins:
        for client in admin.client_list():
            if f":{pid}:" in client.get("name", ""):
                total += 1
                if client.get("cmd") in ("xread", "blpop", "brpop", "xreadgroup"):
                    blocked += 1
    return total, blocked


def _many_keys(urls: list[str], url: str, namespace: str, tmp_path: Path) -> None:
    """2,000 distinct keys owned by one process (20 s loaders) and followed by another that
    may use at most 16 pooled connections per server: every follower gets its value, none
    fails, and the follower waits on a fixed handful of connections, none blocked."""
    keys, pool = 2000, 16
    base = {"url": url, "namespace": namespace, "keys": keys, "markers": str(tmp_path)}
    # A 6 s lease: on a loaded 2-core machine (CI runs the suite twice beside other work) an
    # owner of 2,000 flights must not lose leases to a starved event loop; this test is
    # about the follower's connections, the renewal test below about the owner's ticks.
    owner = _start({**base, "role": "owner", "loader_s": 20.0, "lease": 6.0})
    admins = [redis.Redis.from_url(u) for u in urls]
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "owning").exists():
            assert owner.poll() is None, owner.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the owner never started its 2,000 loaders"
            time.sleep(0.05)
        follower = _start({**base, "role": "follower", "max_connections": pool})
        peak = blocked_peak = 0
        while follower.poll() is None:
            total, blocked = _connections(admins, follower.pid)
            peak, blocked_peak = max(peak, total), max(blocked_peak, blocked)
            time.sleep(0.25)
        got = _report(follower, 30)
        owned = _report(owner, 60)
    finally:
        for proc in (owner,):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        for admin in admins:
            admin.close()
    assert owned["right"] == keys and owned["loader_runs"] == keys, owned
    assert got["error_count"] == 0, got["errors"]
    assert got["right"] == keys, got
    assert got["loader_runs"] == 0, got
    assert got["stats"]["follows"] == keys, got["stats"]
    # Waiting holds no connection: the pool (at most 16 per server) and one listener per
    # server are all the follower ever had, for 2,000 flights of 20 s.
    assert blocked_peak == 0
    assert 1 <= peak <= (pool + 1) * len(urls) + 1, peak


@pytest.mark.timeout(120)
def test_2000_distinct_flights_followed_on_a_fixed_number_of_connections(
    private_server: EmbeddedServer, namespace: str, tmp_path: Path
) -> None:
    _many_keys([private_server.url], private_server.url, namespace, tmp_path)


@pytest.mark.timeout(120)
def test_2000_distinct_flights_followed_on_a_cluster(
    cluster: Any, namespace: str, tmp_path: Path
) -> None:
    urls = [s.url for s in cluster.servers]
    _many_keys(urls, cluster.url, namespace, tmp_path)


def _client_id(admin_url: str, name_part: str) -> int:
    admin = redis.Redis.from_url(admin_url)
    try:
        for client in admin.client_list():
            if name_part in client.get("name", ""):
                return int(client["id"])
    finally:
        admin.close()
    raise AssertionError(f"no client named like {name_part!r}")


async def test_a_dropped_wake_up_still_ends_in_the_right_value_within_the_lease(
    make_cache: Any, server: EmbeddedServer, redis_client: aioredis.Redis
) -> None:
    """The follower's listener connection is killed while it waits, and the owner completes
    while it is gone: the follower still gets the value, well within one lease."""
    lease = 2.0
    owner, follower = make_cache(lease=lease), make_cache(lease=lease)
    gate = asyncio.Event()

    async def slow() -> str:
        await gate.wait()
        return "the value"

    async def never() -> str:
        raise AssertionError("the follower must not run the loader")

    running = asyncio.ensure_future(owner.do("k", slow))
    await wait_for_flight(owner, "k")
    followed = asyncio.ensure_future(follower.do("k", never))
    await wait_for_flight(owner, "k", followers=1)
    listener = _client_id(server.url, f"{follower.node_id}:listen")
    await redis_client.client_kill_filter(_id=listener)
    gate.set()  # published while the follower's listener is down
    t0 = time.monotonic()
    assert await asyncio.wait_for(followed, 10) == "the value"
    assert time.monotonic() - t0 < lease + 1.0  # recovered by the re-read, or the re-check
    assert await running == "the value"
    assert follower.stats["loader_runs"] == 0 and follower.stats["follows"] == 1


async def test_a_lost_wake_up_with_the_listener_deaf_is_found_by_the_lease_recheck(
    make_cache: Any, server: EmbeddedServer
) -> None:
    """With the follower unable to hear anything at all (its listener never subscribes),
    the lease-bounded re-check alone finds the result: no poll, one join per lease."""
    lease = 0.6
    owner = make_cache(lease=lease)
    follower = make_cache(lease=lease)
    await follower.get("warm-up")
    conn = follower._conn  # a listener that hears nothing: as if every message was lost
    await conn.listener.aclose()
    gate = asyncio.Event()

    async def slow() -> str:
        await gate.wait()
        return "late"

    running = asyncio.ensure_future(owner.do("k", slow))
    await wait_for_flight(owner, "k")
    followed = asyncio.ensure_future(follower.do("k", slow))
    await wait_for_flight(owner, "k", followers=1)
    await asyncio.sleep(0.5)
    gate.set()
    assert await asyncio.wait_for(followed, 10) == "late"
    assert await running == "late"
    assert follower.stats["loader_runs"] == 0


@pytest.mark.parametrize("near_cache", [False, True])
async def test_a_miss_is_two_round_trips_and_a_hit_one(
    private_server: EmbeddedServer, namespace: str, near_cache: bool
) -> None:
    """On one server, an owner's miss is join (with its token) then complete; a hit on
    another process is the join alone. Counted on the wire with MONITOR."""
    from .helpers.monitor import CommandLog

    fc = FlightCache(private_server.url, namespace=namespace, near_cache=near_cache, node_ttl=60)
    other = FlightCache(private_server.url, namespace=namespace, near_cache=near_cache, node_ttl=60)
    try:
        await fc.get("warm-up")
        await other.get("warm-up")
        log = CommandLog("127.0.0.1", private_server.port)
        try:
            before = sum(log.commands.values())

            async def loader() -> str:
                return "v"

            assert await fc.do("k", loader) == "v"
            await asyncio.sleep(0.2)  # let MONITOR catch up
            miss = sum(log.commands.values()) - before
            before = sum(log.commands.values())
            assert await other.do("k", loader) == "v"
            await asyncio.sleep(0.2)
            hit = sum(log.commands.values()) - before
        finally:
            log.close()
    finally:
        await fc.aclose()
        await other.aclose()
    assert miss == 2, log.commands
    assert hit == 1, log.commands


async def test_an_owner_of_1000_flights_renews_them_in_a_few_commands_a_tick(
    private_server: EmbeddedServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 owned flights with a 3 s lease (a tick every second) for 4 s: the renewals are
    a handful of scripts a tick (200 flights each), counted by the server, and each goes
    out in a write of its own (what the renewals' thread writes to its socket is looked
    at): a pipeline of all of them would hold up every other client's command while the
    server ran it (docs/protocol.md, "One script a write"). (The lease leaves a loaded
    2-core machine time to answer a tick: a renewal is due every lease/3.)"""
    writes: list[int] = []  # the scripts in each write of the renewals' thread
    send = redis.connection.AbstractConnection.send_packed_command

    def spy(self: Any, command: Any, check_health: bool = True) -> None:
        if threading.current_thread().name == "flightcache-renew":
            data = b"".join(command) if isinstance(command, list) else bytes(command)
            writes.append(data.count(b"EVALSHA"))
        send(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", spy)
    admin = aioredis.Redis.from_url(private_server.url)
    fc = FlightCache(private_server.url, namespace=namespace, lease=3.0, near_cache=False)
    try:
        await fc.get("warm-up")

        async def evalsha() -> int:
            stats = await admin.info("commandstats")
            return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))

        before = await evalsha()
        t0 = time.monotonic()

        async def loader() -> str:
            await asyncio.sleep(4.0)
            return "v"

        values = await asyncio.gather(*(fc.do(f"k{i}", loader) for i in range(1000)))
        elapsed = time.monotonic() - t0
        scripts = await evalsha() - before
    finally:
        await fc.aclose()
        await admin.aclose()
    assert values == ["v"] * 1000
    assert fc.stats["lease_lost"] == 0
    renewals = scripts - 2 * 1000  # every flight's join and complete
    ticks = elapsed / 1.0
    # 5 scripts of 200 flights a tick (and a few ticks more on a loaded machine), where one
    # script per flight would be 1,000 a tick.
    assert 0 < renewals <= 5 * (ticks + 3), (renewals, ticks)
    scripts_written = [n for n in writes if n]  # (the others: the connection's handshake)
    assert len(scripts_written) >= 5 and set(scripts_written) == {1}, writes


@pytest.mark.timeout(120)
async def test_an_owner_on_a_cluster_writes_a_nodes_renewals_200_flights_at_a_time(
    cluster: Any, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,000 owned flights on the test Cluster (3 masters), lease 3 s, loaders of 4 s: a
    tick's renewals (one script a slot) go to the nodes in pipelines of up to 200 flights
    one after another, so no write to a node carries more (the renewal scripts in each
    write are counted by their SHA); in one pipeline a node got about 333 in one write,
    and ran them all before any other client's command."""
    from flightcache._protocol.state import LUA

    sha = LUA["renew_leases"].sha
    writes: list[int] = []
    send = redis.asyncio.connection.AbstractConnection.send_packed_command

    async def spy(self: Any, command: Any, check_health: bool = True) -> None:
        data = b"".join(command) if isinstance(command, list) else bytes(command)
        if sha in data:
            writes.append(data.count(sha))
        await send(self, command, check_health)

    monkeypatch.setattr(redis.asyncio.connection.AbstractConnection, "send_packed_command", spy)
    fc = FlightCache(cluster.url, namespace=namespace, lease=3.0, near_cache=False)
    try:

        async def loader() -> str:
            await asyncio.sleep(4.0)
            return "v"

        values = await asyncio.gather(*(fc.do(f"k{i}", loader) for i in range(1000)))
    finally:
        await fc.aclose()
    assert values == ["v"] * 1000
    assert fc.stats["lease_lost"] == 0
    assert sum(writes) >= 1000 and max(writes) <= 200, writes


async def test_a_renewal_batch_that_finds_some_tokens_replaced_cancels_exactly_those_loaders(
    private_server: EmbeddedServer, namespace: str
) -> None:
    """50 owned flights, claimed together, renewed in one batch every 0.5 s (lease 1.5 s).
    Another owner's token is written into 5 of them: the next batch answers 0 for exactly
    those, so exactly their 5 loaders are cancelled; once the other owner's lease lapses
    they are claimed again. The other 45 loaders run on to their end, their leases kept.
    Without sessions: a flight bound to one (at its claim, or by a renewal before the
    tokens are written) renews its own keys every half of the backstop, not every lease/3,
    so its replaced token would be found only then (CI once found one so); bound flights
    lose their leases with their session (test_bind.py, test_sessions.py)."""
    admin = aioredis.Redis.from_url(private_server.url)
    fc = FlightCache(
        private_server.url,
        namespace=namespace,
        lease=1.5,
        near_cache=False,
        tuning=Tuning(session_backstop_ms=0),
    )
    stolen = set(range(5))
    started = [asyncio.Event() for _ in range(50)]
    release = asyncio.Event()
    cancelled: set[int] = set()
    runs = [0] * 50

    async def loader(i: int) -> str:
        runs[i] += 1
        if runs[i] > 1:
            return f"again {i}"
        started[i].set()
        try:
            await release.wait()
        except asyncio.CancelledError:
            cancelled.add(i)
            raise
        return f"v{i}"

    tasks = [asyncio.ensure_future(fc.do(f"k{i}", functools.partial(loader, i))) for i in range(50)]
    try:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 10)
        for i in stolen:
            meta = fc.keyspace.flight(f"k{i}").meta
            await admin.hset(meta, "ownerToken", "999999999")  # another owner took it...
            await admin.pexpire(meta, 1500)  # ...and will not renew it
        for _ in range(300):  # the next renewal batch, within one interval (0.5 s)
            if len(cancelled) >= len(stolen):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)  # two more batches: nobody else is cancelled
        assert cancelled == stolen
        release.set()
        values = await asyncio.wait_for(asyncio.gather(*tasks), 15)
    finally:
        release.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await fc.aclose()
        await admin.aclose()
    assert values == [f"again {i}" if i in stolen else f"v{i}" for i in range(50)]
    assert fc.stats["lease_lost"] == len(stolen)
    assert runs == [2 if i in stolen else 1 for i in range(50)]


@pytest.mark.timeout(60)
async def test_an_idle_node_costs_the_server_at_most_one_command_a_second(
    private_server: EmbeddedServer, namespace: str
) -> None:
    """Node liveness (one SET a renewal) and the listener's pings, counted by the server
    with script internals included, over 8 s of a node doing nothing."""
    admin = aioredis.Redis.from_url(private_server.url)
    fc = FlightCache(private_server.url, namespace=namespace)
    try:
        await fc.get("warm-up")
        await asyncio.sleep(0.5)
        await admin.config_resetstat()
        t0 = time.monotonic()
        await asyncio.sleep(8.0)
        elapsed = time.monotonic() - t0
        stats = await admin.info("commandstats")
    finally:
        await fc.aclose()
        await admin.aclose()
    ours = {k: v["calls"] for k, v in stats.items() if k not in ("cmdstat_info",)}
    ours.pop("cmdstat_config|resetstat", None)
    assert sum(ours.values()) / elapsed <= 1.0, ours


def _conn_of(fc: FlightCache) -> Any:
    return _conn_of_flights(fc).conn


def _conn_of_flights(fc: FlightCache) -> Any:
    parts = fc._parts
    assert parts is not None
    return parts.redis_flights[0]


@pytest.mark.timeout(120)
async def test_a_burst_of_5000_owned_flights_keeps_every_lease(
    private_server: EmbeddedServer, namespace: str
) -> None:
    """5,000 calls on distinct keys started at once in one process (lease 3 s, loaders 4 s):
    the joins past the pool ride the convoy, each lease counts from its claim's write, and
    the renewals run on a thread of their own, so every loader runs once and no lease is
    lost. (With renewals on the event loop and leases counted from the call, 5,000 at once
    lost leases and 10,000 never finished: docs/protocol.md, "Batched renewals".)"""
    fc = FlightCache(private_server.url, namespace=namespace, lease=3.0, near_cache=False)
    try:
        await fc.get("warm-up")

        async def loader(i: int) -> int:
            await asyncio.sleep(4.0)
            return i

        def call(i: int) -> Any:
            async def load() -> int:
                return await loader(i)

            return fc.do(f"k{i}", load)

        values = await asyncio.gather(*(call(i) for i in range(5000)))
        convoy = _conn_of(fc)._convoy
    finally:
        await fc.aclose()
    assert values == list(range(5000))
    assert fc.stats["lease_lost"] == 0
    assert fc.stats["loader_runs"] == 5000
    assert convoy.batches > 0  # the burst went past the pool: the convoy carried it


async def test_a_busy_event_loop_that_still_turns_keeps_its_leases(
    private_server: EmbeddedServer, namespace: str
) -> None:
    """Once two loaders run, the loop is kept busy in 0.6 s slices of synchronous work for
    3.5 s, with a 1.5 s lease: a renewal that needed a few turns of such a loop would come
    after the lease (a renewal is due 1 s before it ends). On their own thread the renewals
    go on, because the loop still turns (pulses) well within 2/3 of the lease. (It fails
    with the renewals on the loop.)"""
    fc = FlightCache(private_server.url, namespace=namespace, lease=1.5, near_cache=False)
    try:
        await fc.get("warm-up")
        running: list[int] = []
        both = asyncio.Event()

        async def loader() -> str:
            running.append(1)
            if len(running) == 2:
                both.set()
            await asyncio.sleep(4.0)
            return "v"

        async def hog() -> None:  # once both loaders run (and their leases are registered)
            await both.wait()
            end = time.monotonic() + 3.5
            while time.monotonic() < end:
                time.sleep(0.6)  # noqa: ASYNC251 (the point: a loop busy between turns)
                await asyncio.sleep(0)

        values = await asyncio.gather(fc.do("a", loader), fc.do("b", loader), hog())
    finally:
        await fc.aclose()
    assert values[:2] == ["v", "v"]
    assert fc.stats["lease_lost"] == 0
    assert fc.stats["loader_runs"] == 2


async def test_calls_past_a_full_pool_ride_together_and_none_fails(
    private_server: EmbeddedServer, namespace: str
) -> None:
    """With 4 connections, 1,000 misses at once: the calls that find every connection busy
    wait in the convoy and go out together (far fewer writes than calls), every one is
    answered, and the process never holds more connections than it may (its pool of 4, the
    listener, and the renewals' own connection)."""
    admin = redis.Redis.from_url(private_server.url)
    fc = FlightCache(private_server.url, namespace=namespace, near_cache=False, max_connections=4)
    try:
        await fc.get("warm-up")
        peak = 0

        async def loader() -> str:
            await asyncio.sleep(0.5)
            return "v"

        async def watch() -> None:
            nonlocal peak
            while True:
                names = [c.get("name", "") for c in admin.client_list()]
                peak = max(peak, sum(n.startswith("flightcache:") for n in names))
                await asyncio.sleep(0.05)

        watcher = asyncio.ensure_future(watch())
        try:
            values = await asyncio.gather(*(fc.do(f"k{i}", loader) for i in range(1000)))
        finally:
            watcher.cancel()
        convoy = _conn_of(fc)._convoy
    finally:
        await fc.aclose()
        admin.close()
    assert values == ["v"] * 1000
    assert 0 < convoy.batches < 200  # 200 calls a write at most: 2,000 calls in > 10 writes
    assert 0 < peak <= 4 + 1 + 1, peak


async def test_a_call_queued_in_the_step_the_last_drain_ends_still_goes_out(
    private_server: EmbeddedServer, namespace: str
) -> None:
    """With one drain allowed (``MAX_WRITES`` 1) and a call on the wire (so calls queue), a
    call made in the very step the drain ends (it found nothing more to send) starts a
    drain of its own and is answered. A drain counted out only by a done callback, a turn
    later, left such a call waiting for the next call to start one: for ever when none
    came (seen once in nine runs of the gateway's scale phase, a stream's completion)."""
    from flightcache._protocol.state import LUA

    fc = FlightCache(private_server.url, namespace=namespace, near_cache=False)
    read = LUA["read_result"]
    keys = [f"{namespace}:x:r", f"{namespace}:x:m", f"{namespace}:x:c"]
    try:
        await fc.get("warm-up")
        convoy = _conn_of(fc)._convoy
        convoy.MAX_WRITES = 1
        real_drain = convoy._drain
        late: list[asyncio.Future[Any]] = []

        async def drain_then_call() -> None:
            await real_drain()
            if not late:  # still the step in which the drain ended
                late.append(asyncio.ensure_future(convoy.call(read, keys, [])))

        convoy._drain = drain_then_call
        convoy._out += 1  # a call on the wire: the next ones queue
        try:
            first = await asyncio.wait_for(convoy.call(read, keys, []), 10)
            await wait_until(lambda: bool(late), 10, "the late call")
            second = await asyncio.wait_for(late[0], 10)
        finally:
            convoy._out -= 1
    finally:
        await fc.aclose()
    assert first[0][0] is None and second[0][0] is None  # nothing stored: both answered


async def test_calls_made_together_share_a_write_and_a_lone_call_goes_at_once(
    private_server: EmbeddedServer, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone hit is written at once, alone (the convoy carries nothing). 100 hits of
    distinct keys asked in one turn of the loop: the first goes alone, the other 99 wait
    for the end of the turn and go out together, in writes of at most ``MAX_CALLS`` calls
    (all of them at once while that makes at most ``MAX_WRITES``), each answered right."""
    fc = FlightCache(private_server.url, namespace=namespace, near_cache=False)
    out = peak = 0
    real_send = convoy_module.send_calls

    async def counted_send(*args: Any, **kwargs: Any) -> list[Any]:
        nonlocal out, peak
        out += 1
        peak = max(peak, out)
        try:
            return await real_send(*args, **kwargs)
        finally:
            out -= 1

    async def never() -> str:
        raise AssertionError("every key is stored")

    monkeypatch.setattr(convoy_module, "send_calls", counted_send)
    try:
        for i in range(100):
            await fc.set(f"k{i}", f"v{i}")
        convoy = _conn_of(fc)._convoy
        batches, carried = convoy.batches, convoy.carried
        assert await fc.do("k0", never) == "v0"
        assert (convoy.batches, convoy.carried) == (batches, carried)
        values = await asyncio.gather(*(fc.do(f"k{i}", never) for i in range(100)))
        assert values == [f"v{i}" for i in range(100)]
        assert convoy.carried - carried == 99
        assert convoy.batches - batches == math.ceil(99 / Convoy.MAX_CALLS)
        # The writes of one turn are all out before the first is answered: the server runs
        # the first batch while this process packs the next (no lockstep of all callers).
        assert peak == min(math.ceil(99 / Convoy.MAX_CALLS), Convoy.MAX_WRITES)
    finally:
        await fc.aclose()


@dataclasses.dataclass
class _Held:
    """``keys`` flights of ``owner`` whose loaders all run and wait for ``release``, and a
    second cache on the same server to follow them."""

    owner: FlightCache
    follower: FlightCache
    release: asyncio.Event
    owned: list[asyncio.Future[str]]

    def follow(self) -> list[asyncio.Future[str]]:
        return [
            asyncio.ensure_future(self.follower.do(f"k{i}", _never)) for i in range(len(self.owned))
        ]

    async def end(self, followed: list[asyncio.Future[str]]) -> None:
        """Release the loaders: every caller of both caches gets the owner's value."""
        self.release.set()
        assert await asyncio.gather(*self.owned) == ["v"] * len(self.owned)
        assert await asyncio.gather(*followed) == ["v"] * len(self.owned)


async def _never() -> str:
    raise AssertionError("the owner is alive")


OWN_LEASES = Tuning(session_backstop_ms=0)  # no session: every flight renews its own lease


@contextlib.asynccontextmanager
async def _held(
    url: str,
    namespace: str,
    keys: int,
    lease: float,
    tuning: Tuning | None = None,
    before: Callable[[FlightCache], Awaitable[None]] | None = None,
) -> AsyncIterator[_Held]:
    """``before``: told the owner once both caches are up, before its flights start."""
    owner = FlightCache(url, namespace=namespace, lease=lease, near_cache=False, tuning=tuning)
    follower = FlightCache(url, namespace=namespace, lease=lease, near_cache=False, tuning=tuning)
    release, all_run = asyncio.Event(), asyncio.Event()
    runs = 0

    async def load() -> str:
        nonlocal runs
        runs += 1
        if runs == keys:
            all_run.set()
        await release.wait()
        return "v"

    try:
        await owner.get("warm-up")
        await follower.get("warm-up")
        if before is not None:
            await before(owner)
        owned = [asyncio.ensure_future(owner.do(f"k{i}", load)) for i in range(keys)]
        await asyncio.wait_for(all_run.wait(), 10)
        yield _Held(owner, follower, release, owned)
    finally:
        release.set()
        await owner.aclose()
        await follower.aclose()


async def test_following_many_flights_for_many_leases_costs_no_timer_or_wake_up_per_flight(
    private_server: EmbeddedServer, namespace: str
) -> None:
    """300 flights followed for about three and a half leases of a live owner (lease 1 s:
    shorter ones were lost to a loaded machine's stalls in CI): their re-checks are one heap
    and one timer (once every flight has joined, the loop holds a few timers more, not 300;
    while the joins are out their writes hold timeouts of their own), each flight is peeked
    about once a lease in calls of many flights, and no follower is woken by a re-check (the
    claim still holds each time); when the owner ends, every follower has its value."""
    keys = 300
    loop = asyncio.get_running_loop()
    scheduled: Any = loop._scheduled  # type: ignore[attr-defined]

    def timers() -> int:
        return sum(not handle.cancelled() for handle in scheduled)

    # Flights of their own lease (no session, as on a Cluster): a session's flights are
    # watched through it (test_watch.py), and the burst's would be bound by a renewal.
    async with _held(private_server.url, namespace, keys, 1.0, OWN_LEASES) as held:
        rechecks = _conn_of_flights(held.follower).follower.rechecks
        timers_before = timers()
        followed = held.follow()
        await wait_until(
            lambda: held.follower.stats["follows"] >= keys, 5.0, "every flight to be joined"
        )
        added: list[int] = []
        for _ in range(36):  # 3.6 s: three re-checks a flight, the first after the lease
            await asyncio.sleep(0.1)
            added.append(timers() - timers_before)
        peeks, calls, woken = rechecks.peeks, rechecks.peek_calls, rechecks.woken
        await held.end(followed)
    assert max(added) <= 5, added  # one timer per flight would be 300
    assert woken == 0, (woken, peeks)  # a -1 while the owner lives: a lease it lost
    assert keys * 2 <= peeks <= keys * 5, peeks  # about one a flight and lease
    assert calls <= peeks / 5, (calls, peeks)  # many flights a script call


async def test_flights_owned_and_followed_leave_no_reference_cycle_when_they_end(
    private_server: EmbeddedServer, namespace: str
) -> None:
    """200 flights owned by one cache and followed by another: once every caller has its
    value, the cyclic GC finds none of flightcache's objects (nor a task or coroutine) to
    free; each flight's objects went by their reference counts when it ended. Objects left
    in cycles wait for a full collection, whose pause grows with every object alive (ten
    thousand flights in flight: hundreds of milliseconds on a slow machine)."""
    keys = 200
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds is kept in gc.garbage to look at
    try:
        async with _held(private_server.url, namespace, keys, lease=3.0) as held:
            followed = held.follow()
            await wait_until(
                lambda: held.follower.stats["follows"] >= keys, 5.0, "every flight to be joined"
            )
            await held.end(followed)
            del followed
            gc.collect()
            found = Counter(
                type(o).__qualname__
                for o in gc.garbage
                if type(o).__module__.startswith("flightcache")
                or isinstance(o, asyncio.Task | types.CoroutineType)
            )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not found, found  # (before: a Lease, a FlightContext, a Task... every flight)


async def test_a_flight_in_flight_holds_few_objects_for_the_collector_to_walk(
    private_server: EmbeddedServer, namespace: str
) -> None:
    """500 flights owned by one cache, then followed by another: the objects the cyclic GC
    tracks grow by at most 75 an owned flight and 48 a followed one (this test's own task
    and loader included). A full collection walks every one of them while the flights run:
    ten thousand owned flights were some 880,000 objects and pauses of 50 to 120 ms among
    their ends. Before the owner's ``append`` and ``drop`` closures and the flight task's
    lambdas went (``_Appender``, ``Owner._drop``, partials): 88 and 50."""
    keys = 500

    def tracked() -> set[int]:
        gc.collect()
        return {id(o) for o in gc.get_objects()}

    before: set[int] = set()

    async def baseline(owner: FlightCache) -> None:
        async def warm() -> str:
            return "w"

        await owner.do("warm-up-flight", warm)  # (the session and the lanes are up)
        before.update(tracked())

    async with _held(private_server.url, namespace, keys, lease=3.0, before=baseline) as held:
        await asyncio.sleep(0.5)  # (the claims' replies settled)
        owning = tracked()
        followed = held.follow()
        await wait_until(
            lambda: held.follower.stats["follows"] >= keys, 5.0, "every flight to be joined"
        )
        await asyncio.sleep(0.5)
        following = tracked()
        await held.end(followed)
    per_owned = len(owning - before) / keys
    per_followed = len(following - owning) / keys
    assert per_owned <= 75, per_owned
    assert per_followed <= 48, per_followed


@pytest.mark.parametrize(
    "tuning",
    [Tuning(session_backstop_ms=4000), OWN_LEASES],
    ids=["bound-to-a-session", "own-lease"],
)
async def test_renewing_flights_adds_no_object_per_flight_for_the_collector_to_walk(
    private_server: EmbeddedServer, namespace: str, tuning: Tuning
) -> None:
    """1,000 flights owned for their first renewals: bound to the session (their own keys,
    every half of the backstop) or each on its own lease (every lease/3). Each renewal is
    packed once and kept, and what is kept is bytes, which the cyclic GC does not track:
    once every flight is renewed, the objects it tracks have grown by fewer than one for
    five flights (a connection's made meanwhile: its own, not the flights'). Before, each
    flight's packing was a tuple of three lists: 4 objects a flight, promoted to the oldest
    generation, which set off a full collection of every flight's objects some 15 s into a
    wait (10,000 flights: 200 to 300 ms, docs/operations.md)."""
    keys = 1000
    # (A 6 s lease: the first renewals, and so the packings, come 2 s after the claims at
    # the earliest, after the count taken below even on a loaded machine.)
    async with _held(private_server.url, namespace, keys, lease=6.0, tuning=tuning) as held:
        renewer = held.owner._flights.renewer
        leases = [lease for lease in renewer._leases.values() if isinstance(lease.args, Owned)]
        assert len(leases) == keys
        gc.collect()
        before = {id(o) for o in gc.get_objects()}
        unpacked = sum(lease.packed is None for lease in leases)
        assert unpacked >= keys * 0.9, unpacked  # (what the count below is about)
        renewed = {id(lease): lease.renewals for lease in leases}
        # (A claim sent before the session was up is bound by its first renewal, which is
        # not packed, and packed at its next: half of the backstop later.)
        await wait_until(
            lambda: all(
                lease.packed is not None and lease.renewals > renewed[id(lease)] for lease in leases
            ),
            15.0,
            "every flight renewed in a packed renewal",
        )
        gc.collect()
        grown = Counter(type(o).__name__ for o in gc.get_objects() if id(o) not in before)
    assert grown.total() < keys / 5, grown.most_common(6)


async def test_followed_flights_that_ended_leave_no_recheck_items_behind(
    private_server: EmbeddedServer, namespace: str
) -> None:
    """500 flights followed with a 30 s lease end at once: each one's re-check item, due a
    lease later, leaves its slot when its follower is done, so a process whose flights end
    quickly keeps none of them (nor their waiters) for a lease, and never sweeps stale ones
    out in one long step."""
    keys = 500
    async with _held(private_server.url, namespace, keys, lease=30) as held:
        rechecks = _conn_of_flights(held.follower).follower.rechecks

        def queued() -> list[Any]:  # the flights' items in the slots (a watch's aside)
            items = [item for slot in rechecks._slots.values() for item in slot]
            return [item for item in items if isinstance(item, Recheck)]

        followed = held.follow()
        for _ in range(100):
            if len(queued()) >= keys:
                break
            await asyncio.sleep(0.05)
        assert len(queued()) == keys  # one item a followed flight
        await held.end(followed)
        assert queued() == []
        assert len(rechecks) == 0, len(rechecks)  # (a watched session's item too, retired)


async def test_flights_that_ended_are_never_rechecked_and_the_others_still_are(
    private_server: EmbeddedServer, namespace: str
) -> None:
    """400 flights of their own lease (1 s) followed; the first 200 end at once. Their
    items leave the slots with their followers (200 stay), none of them is peeked again,
    and each of the 200 still running is peeked again within a lease and a half (its item
    was not lost with the others' leaving), with no follower woken (the owner lives)."""
    keys, lease = 400, 1.0
    owner = FlightCache(
        private_server.url, namespace=namespace, lease=lease, near_cache=False, tuning=OWN_LEASES
    )
    follower = FlightCache(
        private_server.url, namespace=namespace, lease=lease, near_cache=False, tuning=OWN_LEASES
    )
    first, rest, started = asyncio.Event(), asyncio.Event(), 0
    all_run = asyncio.Event()

    def loader(i: int) -> Callable[[], Awaitable[str]]:
        async def load() -> str:
            nonlocal started
            started += 1
            if started == keys:
                all_run.set()
            await (first if i < keys // 2 else rest).wait()
            return f"v{i}"

        return load

    try:
        await owner.get("warm-up")
        await follower.get("warm-up")
        owned = [asyncio.ensure_future(owner.do(f"k{i}", loader(i))) for i in range(keys)]
        await asyncio.wait_for(all_run.wait(), 10)
        rechecks = _conn_of_flights(follower).follower.rechecks
        peeked: list[tuple[float, str]] = []
        real_send = rechecks._send

        async def send(due: list[Any]) -> list[Any]:
            now = time.monotonic()
            peeked.extend((now, entry.fk.meta) for entry in due)
            return list(await real_send(due))

        rechecks._send = send
        followed = [asyncio.ensure_future(follower.do(f"k{i}", _never)) for i in range(keys)]
        await wait_until(lambda: len(rechecks) >= keys, 5.0, "every flight to be followed")
        metas = {i: follower.keyspace.flight(f"k{i}").meta for i in range(keys)}
        first.set()
        half = keys // 2
        assert await asyncio.gather(*followed[:half]) == [f"v{i}" for i in range(half)]
        ended = time.monotonic()
        assert len(rechecks) == keys - half, len(rechecks)
        woken = rechecks.woken
        await asyncio.sleep(1.5 * lease + 0.5)
        after = [meta for at, meta in peeked if at > ended]
        gone = {metas[i] for i in range(half)}
        running = {metas[i] for i in range(half, keys)}
        assert not gone & set(after)  # an ended flight is never re-checked
        assert running <= set(after), len(running - set(after))  # each other one still is
        assert rechecks.woken == woken  # the owner lives: no follower woken
        rest.set()
        assert await asyncio.gather(*followed[half:]) == [f"v{i}" for i in range(half, keys)]
        assert await asyncio.gather(*owned) == [f"v{i}" for i in range(keys)]
        assert len(rechecks) == 0
    finally:
        first.set()
        rest.set()
        await owner.aclose()
        await follower.aclose()


@pytest.mark.timeout(90)
async def test_every_flight_of_a_killed_owner_is_taken_over_by_its_follower(
    private_server: EmbeddedServer, namespace: str, tmp_path: Path
) -> None:
    """An owner process of 300 flights (30 s loaders, lease 1 s) is SIGKILLed while this
    process follows them all: each flight's re-check (one heap, one timer) finds its claim
    lapsed and wakes its follower, which takes the flight over and runs its own loader:
    every caller gets the takeover's value, each loader once, all within a few leases."""
    keys, lease = 300, 1.0
    cfg = {
        "url": private_server.url,
        "namespace": namespace,
        "keys": keys,
        "markers": str(tmp_path),
        "role": "owner",
        "loader_s": 30.0,
        "lease": lease,
    }
    owner = _start(cfg)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "owning").exists():
            assert owner.poll() is None, owner.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the owner never started its loaders"
            await asyncio.sleep(0.05)
        follower = FlightCache(
            private_server.url, namespace=namespace, lease=lease, near_cache=False
        )
        runs: list[int] = []

        async def load(i: int) -> str:
            runs.append(i)
            return f"taken-{i}"

        try:
            await follower.get("warm-up")
            calls = [
                asyncio.ensure_future(follower.do(f"key-{i}", functools.partial(load, i)))
                for i in range(keys)
            ]
            await asyncio.sleep(1.5)  # a lease and more: every flight followed, re-checked
            assert not any(call.done() for call in calls)
            assert runs == []
            owner.kill()
            killed = time.monotonic()
            values = await asyncio.wait_for(asyncio.gather(*calls), 60)
            took = time.monotonic() - killed
            rechecks = _conn_of_flights(follower).follower.rechecks
        finally:
            await follower.aclose()
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.communicate()
    assert values == [f"taken-{i}" for i in range(keys)]
    assert sorted(runs) == list(range(keys))
    assert rechecks.woken >= keys  # each follower woken by its re-check, none by polling
    # The lease left (<= 1 s), the margin, the spread and the 10 ms gather, then a join and a
    # takeover each; generous for a loaded 2-core machine.
    assert took <= 5 * lease + 5, took


async def test_the_lease_rechecks_of_one_owners_flights_are_spread_not_in_one_instant(
    private_server: EmbeddedServer, namespace: str
) -> None:
    """One owner renews all its leases in one batch, so the leases of its 200 flights end
    together. Their follower's first re-checks come after the lease's end (never before:
    nothing is asked while the owner is known alive) and are spread over the re-check's
    window (a tenth of the lease here) instead of all in one instant."""
    peeked = asyncio.Event()
    async with _held(private_server.url, namespace, 200, 1.0, OWN_LEASES) as held:
        peeks: list[float] = []
        rechecks = _conn_of_flights(held.follower).follower.rechecks
        real_send = rechecks._send

        async def send(due: list[Any]) -> list[Any]:
            peeks.extend([time.monotonic()] * len(due))
            if len(peeks) >= 200:
                peeked.set()
            return list(await real_send(due))

        rechecks._send = send
        joined = time.monotonic()
        followed = held.follow()
        await asyncio.wait_for(peeked.wait(), 5)
        first = sorted(peeks[:200])
        await held.end(followed)
    assert len(first) == 200
    assert first[0] - joined >= 0.3  # none before the lease it was told of ran out
    assert first[-1] - first[0] >= 0.04, first[-1] - first[0]  # spread over ~0.1 s
