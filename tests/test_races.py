"""Races and faults found by an adversarial review of the protocol. Each test pins down one
bug that was found and fixed (its docstring tells the mechanism it guards against); those
whose docstring starts with GUARD pin down behaviour the review checked and found correct.

All tests run against real servers (the session server or a private one); where a test has
to force one specific interleaving it delays a step of the flightcache client itself (never
Redis), which is equivalent to that process being descheduled for a moment.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from flightcache import (
    MISSING,
    BackendUnavailable,
    ConfigError,
    EmbeddedServer,
    FlightCache,
    FlightError,
    RemoteError,
    StreamRestarted,
)
from flightcache._backends.embedded import free_port
from flightcache._waits import within

from .helpers.flights import wait_for_flight
from .helpers.procs import SRC, wait_for

STREAM_OWNER = Path(__file__).parent / "helpers" / "stream_owner.py"


class Boom(Exception):
    pass


# -- correctness -----------------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_stream_followers_that_take_over_late_never_mix_two_owners_chunks(
    server: EmbeddedServer, namespace: str, tmp_path: Path
) -> None:
    """Three processes follow a stream whose owner is SIGKILLed mid-stream. The rank-0
    follower claims and produces anew. The others got `{0, rank}` from their wake-up join,
    sleep, and join again while the new flight runs: that join returns FOLLOW with the new
    flight's claimEntry, and XREAD is exclusive of it, so they never see its `claimed` event
    and never call `restart()`. `on_chunk` then drops the new owner's chunks 0..k-1 (they
    have k chunks of the dead owner) and appends k.., and `has_all(n)` accepts the result:
    their callers get the first owner's prefix glued to the second owner's tail."""
    cfg = {
        "url": server.url,
        "namespace": namespace,
        "key": "story",
        "chunks": 50,
        "interval_s": 0.1,
        "lease": 0.6,
        "markers": str(tmp_path),
    }
    env = dict(os.environ, PYTHONPATH=str(SRC))
    owner = subprocess.Popen(  # noqa: ASYNC220
        [sys.executable, str(STREAM_OWNER), json.dumps(cfg)], env=env
    )
    caches = [FlightCache(server.url, namespace=namespace, lease=0.6) for _ in range(3)]
    try:
        wait_for((tmp_path / "chunk-0").exists, 15, "the first owner's first chunk")

        async def second_owner() -> AsyncIterator[dict[str, Any]]:
            for n in range(10):
                await asyncio.sleep(0.03)
                yield {"n": n, "by": "second-owner"}

        seen: list[list[str]] = [[] for _ in caches]

        async def follow(i: int) -> None:
            try:
                async for chunk in caches[i].stream("story", second_owner):
                    seen[i].append(chunk["by"])
                    if i == len(caches) - 1 and len(seen[i]) == 2:
                        owner.send_signal(signal.SIGKILL)
            except StreamRestarted:
                seen[i].append("RESTARTED")

        tasks = []
        for i in range(len(caches)):  # join order = waiters rank
            tasks.append(asyncio.ensure_future(follow(i)))
            if i < len(caches) - 1:  # the last one kills the owner as soon as it has 2 chunks
                await wait_for_flight(caches[0], "story", followers=i + 1)
        await asyncio.wait_for(asyncio.gather(*tasks), 15)
        mixed = [s for s in seen if "first-owner" in s and "second-owner" in s]
        assert not mixed, f"callers got chunks of two owners glued together: {seen}"
        # The contract, for each caller: it had the first owner's chunks, so it ends with
        # StreamRestarted (never a stream that just stops short), or it had none and got
        # the second owner's whole stream.
        whole = ["second-owner"] * 10
        for s in seen:
            firsts = s[:-1]
            ok = s == whole or (firsts and set(firsts) == {"first-owner"} and s[-1] == "RESTARTED")
            assert ok, f"a caller ended with neither the whole stream nor StreamRestarted: {seen}"
        # The new owner's flight goes on for the cache after its readers left: its stream is
        # what gets stored.
        deadline = time.monotonic() + 10
        while (stored := await caches[0].get("story")) is MISSING:
            assert time.monotonic() < deadline, "the new owner's stream was never stored"
            await asyncio.sleep(0.05)
        assert [c["by"] for c in stored] == whole
    finally:
        owner.kill()
        owner.wait(10)
        for fc in caches:
            await fc.aclose()


async def test_refresh_followers_of_one_flight_run_the_loader_once_on_takeover(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """`opts.refresh` makes *every* join of the flight task ignore the stored result, not just
    the first. After a takeover the rank-0 follower claims and stores a fresh value; the
    next follower wakes from its rank sleep, joins in mode 'always', skips that brand-new
    value because of refresh, finds meta vacant and runs the loader a second time (and a
    third follower a third time...). The same applies to the _Lost path and to the
    'result gone' path of _follow. With refresh=False the same sequence runs the loader once.

    The dead owner is the meta hash a SIGKILLed owner leaves behind (RUNNING, a token, a
    lease that lapses), plus a waiters entry of a process that died with it."""
    b, c = make_cache(lease=0.3), make_cache(lease=0.3)
    fk = b.keyspace.flight("k")
    await redis_client.set(fk.result, b'j"stored before the refresh"')
    await redis_client.hset(fk.meta, mapping={"status": "RUNNING", "ownerToken": "999999999"})
    await redis_client.pexpire(fk.meta, 400)
    await redis_client.rpush(fk.waiters, "crashed-host:1:dead00")
    runs: list[int] = []

    async def loader() -> str:
        runs.append(1)
        return f"run {len(runs)}"

    first = asyncio.ensure_future(b.do("k", loader, refresh=True))
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(c.do("k", loader, refresh=True))
    results = await asyncio.wait_for(asyncio.gather(first, second), 8)
    assert len(runs) == 1, f"one takeover, {len(runs)} loader runs: {results}"
    assert results[0] == results[1]


async def test_a_refresh_call_coalescing_onto_a_plain_lookup_still_refreshes(
    make_cache: Any,
) -> None:
    """The local single-flight table is keyed by digest only. A `do(refresh=True)` that
    arrives while a plain `do()` of the same key is in its GET coalesces onto that slot and
    is handed the stored value: the refresh is silently dropped (nothing is recomputed, the
    old value stays stored). Same for `stream(refresh=True)` attaching to a LocalStream."""
    fc = make_cache()

    async def old() -> str:
        return "old"

    async def new() -> str:
        return "new"

    assert await fc.do("k", old) == "old"
    plain = asyncio.ensure_future(fc.do("k", old))
    refreshed = asyncio.ensure_future(fc.do("k", new, refresh=True))
    await plain
    assert await refreshed == "new"
    assert await fc.get("k") == "new"


async def test_a_follower_gets_an_uncached_error_published_just_after_its_block_ran_out(
    make_cache: Any,
) -> None:
    """_follow's wait runs out with no event; before its re-check (a peek, then a join in
    mode 'first') reaches the server, the owner's loader fails with an error that is not
    negative-cached (error_ttl 0; the same holds for loader timeouts, ValueTooLarge and
    SerializationError, which are never cached). fail_flight deleted meta and waiters, so
    the join says vacant (rank -1): the follower never reads the `error` event that sits
    right after its last_id, sleeps, claims and runs the loader again. The error should
    reach it ("a loader's exception reaches every follower of that flight") and the loader
    should have run once.

    The interleaving is forced by holding the follower's join until the owner has finished
    (as if the follower process were descheduled for that moment)."""
    owner, follower = make_cache(lease=0.3, error_ttl=0), make_cache(lease=0.3, error_ttl=0)
    gate = asyncio.Event()
    runs: list[int] = []

    async def loader() -> str:
        runs.append(1)
        if len(runs) == 1:
            await gate.wait()
            raise Boom("the model is down")
        return "a second run"

    owner_task = asyncio.ensure_future(owner.do("q", loader))
    for _ in range(200):
        if runs:
            break
        await asyncio.sleep(0.01)
    assert runs, "the owner's loader never started"

    flights: Any = follower._flights
    real_join = flights._join
    rechecks = flights.follower.rechecks
    real_send = rechecks._send
    held = False

    async def hold() -> None:
        nonlocal held
        held = True
        gate.set()
        with contextlib.suppress(Boom):
            await owner_task

    async def join(fk: Any, opts: Any, claim: str, **kw: Any) -> Any:
        if claim == "first" and not held:  # the follower's block just ran out
            await hold()
        return await real_join(fk, opts, claim, **kw)

    async def send(due: list[Any]) -> list[Any]:  # the re-check's peeks, held alike
        if not held:
            await hold()
        return list(await real_send(due))

    flights._join = join
    rechecks._send = send
    follower_task = asyncio.ensure_future(follower.do("q", loader))
    with pytest.raises(RemoteError, match="the model is down"):
        await asyncio.wait_for(follower_task, 8)
    assert len(runs) == 1


# -- robustness ------------------------------------------------------------------------------


async def test_a_loader_error_whose_message_is_not_utf8_reaches_callers_and_followers(
    make_cache: Any,
) -> None:
    """`encode_error` runs orjson.dumps on str(exc); a message with a lone surrogate (any
    OSError about a surrogate-escaped file name, say) makes it raise TypeError inside
    `_own`'s except block. The owner's callers get that TypeError instead of the loader's
    exception; fail_flight is never sent, so the follower waits for the lease to lapse,
    takes over and runs the loader a second time."""
    owner, other = make_cache(lease=0.5), make_cache(lease=0.5)
    gate = asyncio.Event()
    runs: list[int] = []
    bad_name = b"report-\xff.txt".decode("utf-8", "surrogateescape")

    async def loader() -> str:
        runs.append(1)
        if len(runs) == 1:
            await gate.wait()
            raise FileNotFoundError(f"no such file: {bad_name}")
        return "second run"

    local = asyncio.ensure_future(owner.do("q", loader))
    await wait_for_flight(owner, "q")
    remote = asyncio.ensure_future(other.do("q", loader))
    await wait_for_flight(owner, "q", followers=1)
    gate.set()
    outcomes = await asyncio.wait_for(asyncio.gather(local, remote, return_exceptions=True), 8)
    assert isinstance(outcomes[0], FileNotFoundError), outcomes
    assert isinstance(outcomes[1], RemoteError), outcomes
    assert outcomes[1].type_name == "FileNotFoundError"
    assert len(runs) == 1
    assert other.stats["follows"] == 1 and other.stats["loader_runs"] == 0


async def test_a_new_connection_to_a_frozen_server_fails_instead_of_hanging(
    private_server: EmbeddedServer, namespace: str
) -> None:
    """The short-command pool has socket_timeout=None and relies on the sweeper, but a
    connection enters the sweeper's table only after `super().get_connection()` returns,
    i.e. after the connect handshake (CLIENT SETNAME, CLIENT SETINFO). socket_connect_timeout
    bounds only the TCP connect, which a SIGSTOPped server's kernel completes. So any call
    that needs a new connection (the first call, a burst, or the call after the sweeper cut
    one) hangs forever on a frozen server."""
    fc = FlightCache(private_server.url, namespace=namespace, socket_timeout=1.0, fail_open=False)
    os.kill(private_server.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(BackendUnavailable):
            await asyncio.wait_for(fc.get("k"), 6)
        assert time.monotonic() - t0 <= 4.5
    finally:
        os.kill(private_server.pid, signal.SIGCONT)
        await fc.aclose()


async def test_a_failed_refresh_does_not_destroy_the_stored_value(make_cache: Any) -> None:
    """fail_flight SETs the error record over the result key. For a refresh flight that key
    still holds the good value everyone is being served; one failed refresh replaces it
    with the error for error_ttl (every caller now gets RemoteError) and then leaves the key
    empty. A refresh that fails should leave the value it meant to replace (DESIGN.md 6:
    everyone keeps getting the current value while one owner recomputes)."""
    fc = make_cache(error_ttl=1.0)

    async def good() -> str:
        return "good"

    async def failing() -> str:
        raise Boom("upstream 503")

    assert await fc.do("k", good) == "good"
    with pytest.raises(Boom):
        await fc.do("k", failing, refresh=True)
    assert await fc.get("k") == "good"
    assert await fc.do("k", good) == "good"


async def test_aclose_while_an_embedded_server_is_starting_leaves_no_server_running() -> None:
    """`_ready` starts the embedded server under `_start_lock` without re-checking `_closed`
    afterwards. aclose() during the start sees `_server is None` and returns; the start then
    finishes, the call succeeds on the closed cache, and the valkey-server process is never
    stopped."""
    fc = FlightCache("embedded://", namespace="review")
    call = asyncio.ensure_future(fc.get("k"))
    for _ in range(1000):
        if fc._start_lock.locked():
            break
        await asyncio.sleep(0.001)
    await fc.aclose()
    with contextlib.suppress(FlightError):
        await asyncio.wait_for(call, 15)
    server = fc._server
    try:
        alive = server is not None and server.proc is not None and server.proc.poll() is None
        assert not alive, "aclose() returned and the embedded server is still running"
    finally:
        if server is not None:
            server.stop()
        if fc._conn is not None:
            await fc._conn.aclose()


async def test_a_call_in_progress_when_aclose_runs_never_starts_a_loader_after_close(
    server: EmbeddedServer, namespace: str
) -> None:
    """aclose() cancels the flight tasks it sees, but a do() that is in its GET when aclose
    starts is not one of them: when the GET returns (aclose yields while it cancels the
    sweeper), do() starts a new flight task. The pool reconnects on demand after
    disconnect(), so that task claims the flight and runs the loader after aclose() has
    returned, on a cache that is closed (and it leaks the reopened connections and a new
    sweeper task). Scanned over the number of loop turns between do() and aclose()."""
    late: list[int] = []
    for turns in range(12):
        fc = FlightCache(server.url, namespace=f"{namespace}-{turns}")
        await fc.get("warm-up")
        closed = False

        async def loader() -> str:
            if closed:  # noqa: B023 (read when the loader runs: that is the point)
                late.append(turns)  # noqa: B023
            return "v"

        call = asyncio.ensure_future(fc.do("k", loader))
        for _ in range(turns):
            await asyncio.sleep(0)
        await fc.aclose()
        closed = True
        with contextlib.suppress(FlightError):
            await asyncio.wait_for(call, 5)
        await asyncio.sleep(0.05)
        if fc._conn is not None:
            await fc._conn.aclose()  # the connections the late flight reopened
    assert not late, f"loaders started after aclose() returned (loop turns {late})"


def _counted() -> tuple[list[int], Callable[[], Awaitable[str]]]:
    """A loader returning "v", and the list it appends to at each run."""
    runs: list[int] = []

    async def loader() -> str:
        runs.append(1)
        return "v"

    return runs, loader


async def test_a_caller_cancelled_during_its_lookup_does_not_start_a_loader_for_nobody(
    make_cache: Any,
) -> None:
    """do()'s `except CancelledError` around the hit-path GET always starts a flight task
    ("others may be waiting"), even when nobody else waits on the slot: a caller that gives
    up before anything ran (asyncio.wait_for around do(), a client that disconnected)
    triggers a loader run nobody asked for, e.g. a paid LLM call."""
    fc = make_cache()
    await fc.get("warm-up")
    runs, loader = _counted()
    call = asyncio.ensure_future(fc.do("k", loader))
    await asyncio.sleep(0)  # the caller is now waiting for its GET
    fk = fc.keyspace.flight("k")
    assert fk.digest in fc._inflight and not fc._tasks  # no flight started yet
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await asyncio.sleep(0.3)
    assert runs == []


async def test_a_first_caller_cancelled_during_its_lookup_starts_a_loader_only_for_callers_left(
    make_cache: Any,
) -> None:
    """A second caller of the key joins the first caller's lookup, then leaves (cancelled);
    when the first caller is cancelled too, nobody waits: no loader runs (with one shared
    future, the caller who left still counted as waiting, and a loader ran for nobody). With
    the second caller still there, the first one's cancel starts the flight for it."""
    fc = make_cache()
    await fc.get("warm-up")
    runs, loader = _counted()
    first = asyncio.ensure_future(fc.do("k", loader))
    await asyncio.sleep(0)  # the first caller waits for its join
    second = asyncio.ensure_future(fc.do("k", loader))
    await asyncio.sleep(0)  # the second waits for the first's outcome
    assert fc.stats["coalesced"] == 1
    second.cancel()
    first.cancel()
    for call in (first, second):
        with pytest.raises(asyncio.CancelledError):
            await call
    await asyncio.sleep(0.3)
    assert runs == []

    first = asyncio.ensure_future(fc.do("k2", loader))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(fc.do("k2", loader))
    await asyncio.sleep(0)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await asyncio.wait_for(second, 10) == "v"
    assert runs == [1]


# -- error reporting (cosmetic) --------------------------------------------------------------


async def test_a_password_in_the_url_query_string_is_never_shown(make_cache: Any) -> None:
    """redis-py reads `?password=` from the query string (its documented form for unix://
    URLs). safe_url masks only the userinfo password and returns the URL unchanged when
    there is none, so the password appears in BackendUnavailable messages and in repr()."""
    port = free_port()
    fc = make_cache(f"redis://127.0.0.1:{port}/0?password=s3cret-pw", fail_open=False)
    assert "s3cret" not in repr(fc)
    with pytest.raises(BackendUnavailable) as info:
        await fc.get("q")
    assert "s3cret" not in str(info.value)


async def test_a_loader_that_raises_cancelled_error_is_not_reported_as_a_closed_cache(
    make_cache: Any,
) -> None:
    """A loader that raises CancelledError on its own (it awaited something another
    component cancelled) is taken for a close of the cache: the flight is given back with
    `reset` and every local caller gets FlightError("the FlightCache was closed") while the
    cache is open."""
    fc = make_cache()

    async def loader() -> str:
        raise asyncio.CancelledError()

    with pytest.raises(FlightError, match="raised CancelledError itself") as info:
        await fc.do("k", loader)
    assert "closed" not in str(info.value)
    assert type(info.value) is FlightError  # not a RemoteError, not a cancellation
    assert not await fc.get("k")  # and not negative-cached


@pytest.mark.parametrize("url", ["redis://:pw@127.0.0.1:99999/0", "redis://:pw@127.0.0.1:x/0"])
def test_a_bad_port_is_a_config_error(url: str) -> None:
    """safe_url reads `parts.port` outside its try block: a bad port raises a bare ValueError
    from FlightCache(), not ConfigError (and repr() of such a cache would raise too)."""
    with pytest.raises(ConfigError):
        FlightCache(url)


# -- guards (pass) ---------------------------------------------------------------------------


async def test_guard_the_pool_returns_every_slot_after_cancelled_and_swept_commands(
    private_server: EmbeddedServer, namespace: str
) -> None:
    """GUARD: BoundedPool's semaphore, its checkout table and redis-py's in-use set stay
    balanced when commands are cancelled at every stage (waiting for a slot, connecting,
    mid-reply): no slot leaks, no double release, and the cache works afterwards."""
    fc = FlightCache(private_server.url, namespace=namespace, max_connections=4, socket_timeout=0.5)
    try:
        assert fc._conn is not None
        pool: Any = fc._conn.client.connection_pool

        async def one(i: int) -> None:
            with contextlib.suppress(asyncio.TimeoutError, FlightError):
                await asyncio.wait_for(fc.get(f"k{i}"), 0.0005 * (i % 7))

        for _ in range(5):
            await asyncio.gather(*(one(i) for i in range(60)))
        await asyncio.gather(*(fc.get(f"after{i}") for i in range(20)))
        # Calls whose callers left still go out with their batch (the convoy's writes): the
        # connections those hold come back once the batches are answered.
        drains = list(fc._conn._convoy._drains)
        await asyncio.wait_for(asyncio.gather(*drains), 5)
        assert pool._slots._value + (pool._lane._value if pool._lane else 0) == 4
        assert pool._out == {}
        assert len(pool._in_use_connections) == 0
    finally:
        await fc.aclose()


async def test_a_refresh_of_a_large_value_runs_the_loader_once(make_cache: Any) -> None:
    """A refresh follower that finds the flight ended with a value too large for the done
    event reads the stored result instead of starting another flight."""
    owner, follower = make_cache(), make_cache()
    big = "x" * 100_000  # over the 64 KiB that ride inside the done event
    runs: list[int] = []
    gate = asyncio.Event()

    async def loader() -> str:
        runs.append(1)
        await gate.wait()
        return big

    await owner.set("k", "old")
    first = asyncio.ensure_future(owner.do("k", loader, refresh=True))
    await wait_for_flight(owner, "k")
    second = asyncio.ensure_future(follower.do("k", loader, refresh=True))
    await wait_for_flight(owner, "k", followers=1)
    gate.set()
    assert await first == await second == big
    assert len(runs) == 1
    assert follower.stats["follows"] == 1 and follower.stats["loader_runs"] == 0


async def test_a_second_invalidation_during_the_first_still_waits_for_holders(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """The first invalidation deleted the value and is still waiting; a second one must not
    report "absent" (holders may still serve the value the first removed)."""
    fc = make_cache()
    fk = fc.keyspace.flight("k")
    await redis_client.set(fk.marker, "an-invalidation-under-way", px=2000)
    result = await fc.invalidate("k")
    assert result.how != "absent"


async def test_store_false_does_not_keep_errors_either(make_cache: Any) -> None:
    fc = make_cache(error_ttl=60)
    runs: list[int] = []

    async def failing() -> str:
        runs.append(1)
        raise Boom("no")

    for _ in range(2):
        with pytest.raises(Boom):
            await fc.do("q", failing, store=False)
    assert len(runs) == 2


def test_a_near_cache_copy_never_outlives_its_nodes_liveness() -> None:
    from flightcache._leases.near import Leaser, NearCache

    now = [100.0]
    near = NearCache(max_entries=10, max_bytes=1000, clock=lambda: now[0])
    leaser = Leaser(
        near,
        lease_s=5.0,
        skew_margin_s=0.25,
        heard=lambda: 0,
        live_until=lambda: 102.0,  # the live set lists this node until then
        clock=lambda: now[0],
    )
    leaser.grant("d", b"jv", sent=100.0, ttl_left_ms=60_000, heard=leaser.heard())
    now[0] = 101.7
    assert near.get("d") == b"jv"
    now[0] = 101.8  # 102 - skew: past it, though the 5 s lease would run on
    assert near.get("d") is None


async def test_a_bounded_wait_delivers_a_cancellation_that_arrives_as_it_completes() -> None:
    """``asyncio.wait_for`` before 3.12 returns the result when its caller is cancelled in
    the same turn of the loop as the awaited thing completes: a cancelled ``do()`` (seen on
    a Cluster, where a pool's bounded wait for a connection ended just then) returned its
    value. ``within`` awaits in the caller's task, so the cancellation is delivered."""
    loop = asyncio.get_running_loop()
    for _ in range(20):
        fut: asyncio.Future[str] = loop.create_future()
        caller = asyncio.ensure_future(within(fut, 10.0))
        await asyncio.sleep(0)  # the caller waits on fut
        fut.set_result("done")
        caller.cancel()  # the same turn of the loop
        with pytest.raises(asyncio.CancelledError):
            await caller
    with pytest.raises(asyncio.TimeoutError):
        await within(loop.create_future(), 0.01)
    assert await within(asyncio.sleep(0, "ok"), 1.0) == "ok"


def test_no_library_code_bounds_a_wait_with_asyncio_wait_for() -> None:
    """Every bounded wait in the package goes through ``within`` (the one above)."""
    offenders = []
    for path in sorted((Path(SRC) / "flightcache").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "wait_for"
                and isinstance(node.value, ast.Name)
                and node.value.id == "asyncio"
            ):
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


@pytest.mark.skipif(sys.version_info < (3, 11), reason="3.10 does not count cancellations")
async def test_a_cancellation_the_driver_loses_still_reaches_the_caller(
    server: EmbeddedServer,
) -> None:
    """redis-py bounds a socket write with ``asyncio.wait_for`` when ``socket_timeout`` is set
    (the Cluster client), and so loses a cancellation that arrives in the same turn as the
    write completes (the race above): the caller's ``do()`` went on and returned. Every
    command runs through ``RedisConnection.run``, which sees the pending cancellation and
    delivers it. Here the driver's step is that same ``wait_for`` race, made deterministic."""
    from flightcache._backends.redis import RedisConnection
    from flightcache._types import Stats

    conn = RedisConnection(server.url, stats=Stats(), socket_timeout=5.0)
    loop = asyncio.get_running_loop()
    try:
        for _ in range(5):
            written: asyncio.Future[str] = loop.create_future()
            writing = asyncio.Event()

            async def op(written: asyncio.Future[str] = written, writing: Any = writing) -> str:
                await conn.client.ping()
                writing.set()
                return await asyncio.wait_for(written, 5.0)  # what redis-py does

            caller = asyncio.ensure_future(conn.run(op))
            await writing.wait()  # the caller waits inside wait_for now
            written.set_result("sent")
            caller.cancel()  # the same turn of the loop: wait_for returns "sent"
            with pytest.raises(asyncio.CancelledError):
                await caller
        assert await conn.run(lambda: conn.client.ping()) is True  # nothing left pending
    finally:
        await conn.aclose()
