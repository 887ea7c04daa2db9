"""fc.stream: one producer run, chunks live to every caller in every process, replay on hit."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from flightcache import (
    MISSING,
    ConfigError,
    EmbeddedServer,
    FlightCache,
    RemoteError,
    StreamRestarted,
    ValueTooLarge,
)

from .helpers.flights import wait_for_flight, wait_until
from .helpers.procs import SRC, wait_for


def producer_of(chunks: list[Any], delay: float = 0.0, runs: list[int] | None = None) -> Any:
    async def produce() -> AsyncIterator[Any]:
        if runs is not None:
            runs.append(1)
        for chunk in chunks:
            if delay:
                await asyncio.sleep(delay)
            yield chunk

    return produce


async def collect(stream: Any) -> list[Any]:
    return [chunk async for chunk in stream]


async def test_a_stream_runs_once_and_a_hit_replays_it(backend_url: str, make_cache: Any) -> None:
    fc = make_cache(backend_url)
    runs: list[int] = []
    produce = producer_of([{"delta": "Hel"}, {"delta": "lo"}, {"delta": "!"}], runs=runs)
    first = fc.stream("q", produce)
    assert await first.opened() == "MISS"
    assert await collect(first) == [{"delta": "Hel"}, {"delta": "lo"}, {"delta": "!"}]
    again = fc.stream("q", produce)
    assert await collect(again) == [{"delta": "Hel"}, {"delta": "lo"}, {"delta": "!"}]
    assert again.source == "HIT"
    assert len(runs) == 1
    assert await fc.do("q", producer_of([])) == [{"delta": "Hel"}, {"delta": "lo"}, {"delta": "!"}]


async def test_a_stored_stream_keeps_no_cost_key_and_a_stored_value_does(
    make_cache: Any, redis_client: Any
) -> None:
    """Refresh-ahead reads a result's cost, and only ``do()`` refreshes ahead: a stream's
    result is stored with its TTL and no cost key beside it (one key less for each cached
    answer), a value's with its cost, as before."""
    fc = make_cache()
    assert await collect(fc.stream("s", producer_of(["a", "b"]))) == ["a", "b"]

    async def load() -> str:
        await asyncio.sleep(0.02)
        return "v"

    assert await fc.do("v", load) == "v"
    stream_keys, value_keys = fc.keyspace.flight("s"), fc.keyspace.flight("v")
    assert await redis_client.pttl(stream_keys.result) > 0
    assert await redis_client.exists(stream_keys.cost) == 0
    assert await redis_client.pttl(value_keys.result) > 0
    assert int(await redis_client.get(value_keys.cost)) >= 20


async def test_local_subscribers_share_one_run_and_see_the_same_chunks(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url)
    runs: list[int] = []
    produce = producer_of(list(range(20)), delay=0.01, runs=runs)
    streams = [fc.stream("q", produce) for _ in range(50)]
    results = await asyncio.gather(*(collect(s) for s in streams))
    assert results == [list(range(20))] * 50
    assert len(runs) == 1
    assert sorted(s.source for s in streams) == ["COALESCED"] * 49 + ["MISS"]


async def test_remote_followers_get_chunks_live_and_late_joiners_get_them_all(
    make_cache: Any,
) -> None:
    """A follower in another process gets each chunk while the producer is still working on
    the next one (live, not at the end); a late joiner gets every chunk made before it
    joined, then the rest live."""
    owner, follower, late = make_cache(), make_cache(), make_cache()
    gate, three = asyncio.Event(), asyncio.Event()
    produced: list[float] = []
    gap = 1.0  # the producer "thinks" this long before chunk 4

    async def produce() -> AsyncIterator[int]:
        for n in range(6):
            if n == 3:
                three.set()
                await gate.wait()
            if n == 4:
                await asyncio.sleep(gap)
            produced.append(time.monotonic())
            yield n

    seen: list[float] = []

    async def follow() -> list[int]:
        out = []
        async for chunk in follower.stream("q", produce):
            seen.append(time.monotonic())
            out.append(chunk)
        return out

    own = asyncio.ensure_future(collect(owner.stream("q", produce)))
    await wait_for_flight(owner, "q")
    remote = asyncio.ensure_future(follow())
    await wait_for_flight(owner, "q", followers=1)
    await asyncio.wait_for(three.wait(), 5)
    late_stream = late.stream("q", produce)
    assert await late_stream.opened() == "COALESCED"
    late_task = asyncio.ensure_future(collect(late_stream))
    await wait_for_flight(owner, "q", followers=2)
    gate.set()
    assert await own == await remote == await late_task == list(range(6))
    assert owner.stats["loader_runs"] == 1
    assert follower.stats["loader_runs"] == late.stats["loader_runs"] == 0
    assert follower.stats["follows"] == late.stats["follows"] == 1
    # Live: chunk 3 reached the other process before the producer made chunk 4, a whole
    # second later (a generous bound; the benchmark measures the real lag, milliseconds).
    assert seen[3] < produced[4], (seen[3] - produced[3], gap)


async def test_a_stream_that_fails_reaches_everyone_and_is_not_cached(
    make_cache: Any,
) -> None:
    owner, other = make_cache(error_ttl=0.2), make_cache(error_ttl=0.2)

    class Upstream(Exception):
        flightcache_data: ClassVar[dict[str, int]] = {"status": 502}

    gate = asyncio.Event()

    async def produce() -> AsyncIterator[str]:
        yield "partial"
        await gate.wait()
        raise Upstream("cut off")

    async def drain(stream: Any, into: list[Any]) -> None:
        async for chunk in stream:
            into.append(chunk)

    local_seen: list[Any] = []
    remote_seen: list[Any] = []
    own = asyncio.ensure_future(drain(owner.stream("q", produce), local_seen))
    await wait_for_flight(owner, "q")
    remote = asyncio.ensure_future(drain(other.stream("q", produce), remote_seen))
    await wait_for_flight(owner, "q", followers=1)
    gate.set()
    with pytest.raises(Upstream):
        await own
    with pytest.raises(RemoteError) as info:
        await asyncio.wait_for(remote, 10)
    assert info.value.type_name == "Upstream" and info.value.data == {"status": 502}
    assert local_seen == remote_seen == ["partial"]
    assert other.stats["follows"] == 1 and other.stats["loader_runs"] == 0
    assert await owner.get("q") is MISSING
    await asyncio.sleep(0.3)

    async def good() -> AsyncIterator[str]:
        yield "whole"

    assert await collect(owner.stream("q", good)) == ["whole"]


async def test_leaving_early_does_not_stop_the_stream_for_others(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url)
    produce = producer_of(list(range(10)), delay=0.01)
    quitter = fc.stream("q", produce)
    stayer = asyncio.ensure_future(collect(fc.stream("q", produce)))
    async for chunk in quitter:
        assert chunk == 0
        break
    await quitter.aclose()
    assert await stayer == list(range(10))
    assert await fc.get("q") == list(range(10))


async def test_ready_hands_over_the_chunks_that_came_without_waiting_and_no_more(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url)
    gate = asyncio.Event()

    async def produce() -> AsyncIterator[Any]:
        for i in range(4):
            yield i
        await gate.wait()
        yield 4

    stream = fc.stream("q", produce)
    assert stream.ready() == []  # not attached yet: nothing, and no waiting
    assert await stream.__anext__() == 0
    got: list[Any] = []
    for _ in range(200):  # the producer goes on in its own task: 1, 2 and 3 come at once
        got += stream.ready()
        if len(got) >= 3:
            break
        await asyncio.sleep(0.005)
    assert got == [1, 2, 3]
    assert stream.ready() == []  # 4 has not come: ready does not wait for it
    gate.set()
    assert await collect(stream) == [4]
    assert stream.ready() == []  # the end is for __anext__ to say
    await stream.aclose()
    assert await collect(stream) == []


async def test_ready_never_hands_over_the_chunks_of_a_restarted_stream() -> None:
    """A reader that had chunks when the stream restarted (a new owner) gets nothing from
    ``ready()`` and StreamRestarted from the next iteration; one that had none starts over
    with the new generation's chunks."""
    from flightcache._protocol.streaming import FlightStream, LocalStream

    local = LocalStream("digest")
    had, fresh = (FlightStream(lambda: (local, False)) for _ in range(2))
    local.opened("MISS")
    local.publish("old 1")
    local.publish("old 2")
    assert await had.__anext__() == "old 1"
    assert had.ready() == ["old 2"]
    await fresh.opened()  # attached, no chunk taken yet
    local.restart()
    for chunk in ("new 1", "new 2", "new 3"):  # more than `had` had: its index is inside
        local.publish(chunk)
    assert had.ready() == []
    with pytest.raises(StreamRestarted):
        await had.__anext__()
    assert fresh.ready() == []  # the restart is news for the next iteration first
    assert await fresh.__anext__() == "new 1"
    assert fresh.ready() == ["new 2", "new 3"]


async def test_a_subscriber_cancelled_while_waiting_leaves_the_others_waiting() -> None:
    """Each waiting subscriber has a future of its own: one cancelled mid-wait (a client
    gone) does not cancel the others' wait, they still get the next chunk, and waits
    given up again and again (timeouts, no news) do not pile up without bound."""
    from flightcache._protocol.streaming import PRUNE_AT, FlightStream, LocalStream

    local = LocalStream("digest")
    local.opened("MISS")
    gone, stays = (FlightStream(lambda: (local, False)) for _ in range(2))
    waits = [asyncio.ensure_future(s.__anext__()) for s in (gone, stays)]
    await asyncio.sleep(0)  # both wait now
    waits[0].cancel()
    await asyncio.sleep(0)
    assert waits[0].cancelled() and not waits[1].done()
    local.publish("chunk")
    assert await asyncio.wait_for(waits[1], 5) == "chunk"
    for _ in range(3 * PRUNE_AT):  # a reader polling with a short timeout, no news
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(stays.__anext__(), 0.0001)
    assert len(local._waiters) <= PRUNE_AT
    local.publish("next")
    assert await asyncio.wait_for(stays.__anext__(), 5) == "next"


async def test_a_stream_over_the_size_limit_is_refused_and_not_cached(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url, max_value_bytes=100)
    with pytest.raises(ValueTooLarge):
        await collect(fc.stream("q", producer_of(["x" * 40] * 5)))
    assert await fc.get("q") is MISSING


async def test_stream_and_do_values_do_not_mix(backend_url: str, make_cache: Any) -> None:
    fc = make_cache(backend_url)

    async def value() -> str:
        return "plain"

    await fc.do("q", value)
    with pytest.raises(ConfigError, match="not a stream"):
        await collect(fc.stream("q", producer_of(["a"])))
    with pytest.raises(ConfigError, match="producer"):
        fc.stream("q", "nope")  # type: ignore[arg-type]


async def test_a_loader_error_can_choose_its_negative_cache_ttl(make_cache: Any) -> None:
    fc = make_cache(error_ttl=60)
    runs: list[int] = []

    class RateLimited(Exception):
        flightcache_error_ttl = 0  # never cache: a retry must reach the upstream

    async def limited() -> str:
        runs.append(1)
        raise RateLimited("429")

    for _ in range(2):
        with pytest.raises(RateLimited):
            await fc.do("q", limited)
    assert len(runs) == 2


@pytest.mark.timeout(60)
async def test_owner_killed_mid_stream_restarts_cleanly(
    server: EmbeddedServer, namespace: str, tmp_path: Path
) -> None:
    """A caller that had chunks gets StreamRestarted; one that had none gets the new owner's
    whole stream; nothing mixes two generations."""
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
    owner = subprocess.Popen(  # noqa: ASYNC220 (started once, before the loop is busy)
        [
            sys.executable,
            str(Path(__file__).parent / "helpers" / "stream_owner.py"),
            json.dumps(cfg),
        ],
        env=env,
    )
    try:
        wait_for((tmp_path / "chunk-0").exists, 15, "the owner's first chunk")
        fc = FlightCache(server.url, namespace=namespace, lease=0.6)

        async def second_owner() -> AsyncIterator[dict[str, Any]]:
            for n in range(3):
                yield {"n": n, "by": "second-owner"}

        eager = fc.stream("story", second_owner)
        patient = fc.stream("story", second_owner)
        assert await patient.opened() == "COALESCED"
        got: list[Any] = []
        with pytest.raises(StreamRestarted):
            async for chunk in eager:
                got.append(chunk)
                if len(got) == 2:
                    os.kill(owner.pid, signal.SIGKILL)
        assert got and all(c["by"] == "first-owner" for c in got)
        assert await collect(patient) == [{"n": n, "by": "second-owner"} for n in range(3)]
        assert await fc.get("story") == [{"n": n, "by": "second-owner"} for n in range(3)]
        await fc.aclose()
    finally:
        owner.kill()
        owner.wait(10)


async def test_a_refreshed_stream_replaces_the_stored_one(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url)
    assert await collect(fc.stream("q", producer_of(["a", "b"]))) == ["a", "b"]
    fresh = fc.stream("q", producer_of(["c"]), refresh=True)
    assert await collect(fresh) == ["c"]
    assert fresh.source == "MISS"
    assert await collect(fc.stream("q", producer_of(["x"]))) == ["c"]


async def test_chunks_reach_remote_followers_while_the_producer_pauses(make_cache: Any) -> None:
    """A chunk made while an append was on the wire goes out when that append returns, not
    with the producer's next chunk."""
    owner, follower = make_cache(), make_cache()
    gate = asyncio.Event()
    made: dict[int, float] = {}

    async def produce() -> AsyncIterator[int]:
        await gate.wait()
        for n in range(4):
            made[n] = time.monotonic()
            yield n
        await asyncio.sleep(1.5)  # thinking
        made[4] = time.monotonic()
        yield 4

    seen: dict[int, float] = {}

    async def follow(stream: Any) -> None:
        async for chunk in stream:
            seen[chunk] = time.monotonic()

    own = asyncio.ensure_future(collect(owner.stream("q", produce)))
    await wait_for_flight(owner, "q")
    theirs = follower.stream("q", produce)
    assert await asyncio.wait_for(theirs.opened(), 5) == "COALESCED"
    gate.set()
    await asyncio.gather(own, follow(theirs))
    assert sorted(seen) == [0, 1, 2, 3, 4]
    # Chunk 3 went out while the producer thought, 1.5 s before chunk 4 was made (the tight
    # figure, milliseconds, is the benchmark's).
    assert seen[3] < made[4], (seen[3] - made[3], made[4] - made[3])


async def test_followers_get_every_chunk_made_before_the_producer_failed(make_cache: Any) -> None:
    owner, follower = make_cache(error_ttl=0), make_cache(error_ttl=0)
    gate = asyncio.Event()

    async def produce() -> AsyncIterator[int]:
        await gate.wait()
        for n in range(50):
            yield n
        raise RuntimeError("upstream went away")

    async def drain(stream: Any, into: list[int]) -> None:
        async for chunk in stream:
            into.append(chunk)

    mine: list[int] = []
    theirs: list[int] = []
    own = asyncio.ensure_future(drain(owner.stream("q", produce), mine))
    await wait_for_flight(owner, "q")
    other = asyncio.ensure_future(drain(follower.stream("q", produce), theirs))
    await wait_for_flight(owner, "q", followers=1)
    gate.set()
    with pytest.raises(RuntimeError):
        await own
    with pytest.raises(RemoteError, match="upstream went away"):
        await asyncio.wait_for(other, 10)
    assert mine == theirs == list(range(50))
    assert follower.stats["follows"] == 1 and follower.stats["loader_runs"] == 0


async def test_the_size_limit_covers_the_stored_stream_not_just_its_chunks(
    backend_url: str, make_cache: Any
) -> None:
    """Ten 9-byte chunks fit in 100 bytes; the stored list (tags, brackets, commas) does not."""
    fc = make_cache(backend_url, max_value_bytes=100)
    delivered: list[str] = []
    with pytest.raises(ValueTooLarge):
        async for chunk in fc.stream("q", producer_of(["1234567"] * 10)):
            delivered.append(chunk)
    assert len(delivered) < 10  # refused before the whole stream went out, not after
    assert await fc.get("q") is MISSING


async def test_a_takeover_of_a_stream_that_had_chunks_counts_as_a_new_attempt(
    make_cache: Any, redis_client: Any
) -> None:
    fc = make_cache()
    fk = fc.keyspace.flight("q")
    # What a stream owner that died after two chunks leaves behind (its meta has lapsed).
    await redis_client.xadd(fk.stream, {"t": "claimed", "n": "dead", "a": "1", "c": "x"})
    await redis_client.xadd(fk.stream, {"t": "chunk", "tok": "5", "s": "0", "v": "1"})
    await redis_client.xadd(fk.stream, {"t": "chunk", "tok": "5", "s": "1", "v": "2"})
    gate = asyncio.Event()

    async def produce() -> AsyncIterator[int]:
        await gate.wait()
        yield 1

    task = asyncio.ensure_future(collect(fc.stream("q", produce)))
    for _ in range(100):
        info = await fc.inspect("q")
        if info.state == "running":
            break
        await asyncio.sleep(0.01)
    assert info.attempts == 2
    gate.set()
    assert await task == [1]


async def test_a_follower_reads_back_only_when_chunks_came_before_its_join(
    private_server: EmbeddedServer, namespace: str
) -> None:
    """A stream follower that joined before the first chunk reads nothing back: its join
    queued its node in waiters, so every chunk is published to it. One that joined after
    chunks were appended reads them at once (while the producer pauses), in one read.
    ``XRANGE`` counted on the wire with MONITOR (the owner never sends one)."""
    from .helpers.monitor import CommandLog

    caches = [FlightCache(private_server.url, namespace=namespace) for _ in range(3)]
    owner, early, late = caches
    start, more = asyncio.Event(), asyncio.Event()

    async def produce() -> AsyncIterator[int]:
        await start.wait()
        for n in range(3):
            yield n
        await more.wait()
        yield 3

    log = None
    try:
        for fc in caches:
            await fc.get("warm-up")  # listeners subscribed before any waiter exists
        log = CommandLog("127.0.0.1", private_server.port)
        own = asyncio.ensure_future(collect(owner.stream("q", produce)))
        await wait_for_flight(owner, "q")
        early_stream = early.stream("q", produce)
        assert await early_stream.opened() == "COALESCED"
        start.set()
        early_chunks = [await asyncio.wait_for(anext(early_stream), 5) for _ in range(3)]
        late_stream = late.stream("q", produce)
        assert await late_stream.opened() == "COALESCED"
        late_chunks = [await asyncio.wait_for(anext(late_stream), 5) for _ in range(3)]
        await asyncio.sleep(0.2)  # let MONITOR catch up
        reads = sum(n for (_, cmd), n in log.commands.items() if cmd == "XRANGE")
        more.set()
        assert await own == [0, 1, 2, 3]
        assert early_chunks + await collect(early_stream) == [0, 1, 2, 3]
        assert late_chunks + await collect(late_stream) == [0, 1, 2, 3]
    finally:
        if log is not None:
            log.close()
        for fc in caches:
            await fc.aclose()
    assert early_chunks == late_chunks == [0, 1, 2]
    assert reads == 1, log.commands  # the late joiner's, none for the early one


async def test_the_chunks_a_stream_makes_as_it_ends_ride_its_completion(
    private_server: EmbeddedServer, namespace: str
) -> None:
    """Chunks still unsent when the producer ends are appended by ``complete_flight`` itself,
    before the done event, in the same script call: a producer that makes its three chunks
    at once costs its owner two scripts on the wire (the join and the completion, no
    ``append_chunks``), and a follower in another process sees the three chunks, in order,
    and the end. Script calls counted with MONITOR."""
    from .helpers.monitor import CommandLog

    owner, follower = (FlightCache(private_server.url, namespace=namespace) for _ in range(2))
    start = asyncio.Event()

    async def produce() -> AsyncIterator[int]:
        await start.wait()
        for n in range(3):
            yield n

    log = None
    try:
        for fc in (owner, follower):
            await fc.get("warm-up")  # listeners subscribed before any waiter exists
        log = CommandLog("127.0.0.1", private_server.port)
        own = asyncio.ensure_future(collect(owner.stream("q", produce)))
        await wait_for_flight(owner, "q")
        followed = follower.stream("q", produce)
        assert await followed.opened() == "COALESCED"
        start.set()
        assert await asyncio.wait_for(own, 10) == [0, 1, 2]
        assert await asyncio.wait_for(collect(followed), 10) == [0, 1, 2]
        await asyncio.sleep(0.2)  # let MONITOR catch up
        scripts = sum(n for (_, cmd), n in log.commands.items() if cmd == "EVALSHA")
        reads = sum(n for (_, cmd), n in log.commands.items() if cmd == "XRANGE")
    finally:
        if log is not None:
            log.close()
        for fc in (owner, follower):
            await fc.aclose()
    assert scripts == 3, log.commands  # the owner's join and completion, the follower's join
    assert reads == 0, log.commands  # the follower read nothing back: it was told it all


class _HeldAppends:
    """The owner's second ``append_chunks`` held back in this process until ``release``
    (only the client side is touched: every script still runs on the real server), so
    the run ends with that append on the wire; its answer is kept in ``answers``."""

    def __init__(self, fc: FlightCache, complete_after_append: bool) -> None:
        from flightcache._protocol.state import LUA

        self.conn = conn = fc._flights.owner.conn  # type: ignore[union-attr]
        self.real = conn.script
        self.append_sha = LUA["append_chunks"].sha
        self.complete_sha = LUA["complete_flight"].sha
        self.appends = 0
        self.first_back = asyncio.Event()  # the first append's answer came
        self.held = asyncio.Event()  # the second append is held now
        self.release = asyncio.Event()
        self.completing = asyncio.Event()  # the completion was called
        self.second_back = asyncio.Event()
        self.complete_after_append = complete_after_append
        self.answers: list[Any] = []
        conn.script = self.script

    async def script(self, lua: Any, fk: Any, keys: Any, args: Any) -> Any:
        if lua.sha == self.complete_sha:
            self.completing.set()
            if self.complete_after_append:  # the held append runs first, then this one
                self.release.set()
                await self.second_back.wait()
        if lua.sha != self.append_sha:
            return await self.real(lua, fk, keys, args)
        self.appends += 1
        if self.appends == 2:
            self.held.set()
            await self.release.wait()
        answer = await self.real(lua, fk, keys, args)
        self.answers.append(int(answer))
        (self.first_back if len(self.answers) == 1 else self.second_back).set()
        return answer


async def _stream_entries(server: EmbeddedServer, namespace: str, key: str) -> list[str]:
    """The flight's stream as ``chunk:<s>`` and ``done:<n>`` entries, in order."""
    import redis.asyncio as aioredis

    from flightcache._keys import KeySpace

    client = aioredis.Redis.from_url(server.url)
    try:
        fk = KeySpace(namespace).flight(key)
        entries = await client.xrange(fk.stream)
    finally:
        await client.aclose()
    out = []
    for _, fields in entries:
        kind = fields[b"t"].decode()
        if kind == "chunk":
            out.append(f"chunk:{int(fields[b's'])}")
        elif kind == "done":
            out.append(f"done:{int(fields[b'n'])}")
    return out


@pytest.mark.parametrize("append_first", [False, True], ids=["completion-first", "append-first"])
async def test_the_completion_overtakes_an_append_on_the_wire_without_a_gap_or_a_chunk_twice(
    private_server: EmbeddedServer, namespace: str, append_first: bool
) -> None:
    """The run ends while its last append is on the wire: the completion is sent without
    waiting for it, carrying that append's chunks too. Whichever of the two the server runs
    first, the stream holds every chunk once, in order, before the done event; a follower
    in another process gets every chunk once; the append that came second is refused
    (completion first) and is not counted as a fenced write (docs/protocol.md, "Why the
    completion may overtake the append on the wire")."""
    owner, follower = (FlightCache(private_server.url, namespace=namespace) for _ in range(2))
    held: _HeldAppends | None = None
    try:
        for fc in (owner, follower):
            await fc.get("warm-up")  # listeners subscribed before any waiter exists
        held = _HeldAppends(owner, complete_after_append=append_first)
        hold = held
        start = asyncio.Event()

        async def produce() -> AsyncIterator[int]:
            await start.wait()
            yield 0  # the first append: sent at once
            await hold.first_back.wait()
            yield 1  # the second append: held on its way out
            yield 2
            await hold.held.wait()
            yield 3  # queued behind the held append: rides the completion

        own = asyncio.ensure_future(collect(owner.stream("q", produce)))
        await wait_for_flight(owner, "q")
        followed = follower.stream("q", produce)
        assert await followed.opened() == "COALESCED"
        start.set()
        await asyncio.wait_for(hold.completing.wait(), 10)
        mine = await asyncio.wait_for(own, 10)
        if not append_first:  # the owner's callers had it all while the append was held
            assert hold.answers == [1] and not hold.release.is_set()
            hold.release.set()
        assert mine == [0, 1, 2, 3]
        assert await asyncio.wait_for(collect(followed), 10) == [0, 1, 2, 3]
        await wait_until(lambda: len(hold.answers) == 2, 10, "the held append's answer")
        entries = await _stream_entries(private_server, namespace, "q")
    finally:
        if held is not None:
            held.release.set()
        for fc in (owner, follower):
            await fc.aclose()
    assert entries == ["chunk:0", "chunk:1", "chunk:2", "chunk:3", "done:4"]
    # completion first: the held append came after the end and was refused, quietly
    assert held.answers == ([1, 1] if append_first else [1, 0])
    assert owner.stats["fenced_writes"] == 0
