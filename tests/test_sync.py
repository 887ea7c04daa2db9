"""FlightCacheSync against a real server: threads, blocking loaders, mixed sync and async
processes, invalidation across doors, fork, the in-loop rule, close, @flight on both doors,
and disabled().

Async tests reach the sync client through ``asyncio.to_thread``: calling it from the test's
own event-loop thread is the documented ConfigError.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from flightcache import (
    MISSING,
    NOT_FOUND,
    ConfigError,
    EmbeddedServer,
    FlightCache,
    FlightCacheSync,
    FlightError,
    FlightTimeout,
)

from .helpers.flights import wait_for_flight, wait_until

SYNC_WORKER = Path(__file__).with_name("helpers") / "sync_worker.py"
SRC = Path(__file__).resolve().parents[1] / "src"
OUR_THREADS = ("flightcache-sync-loop", "flightcache-loader")


@pytest.fixture
def make_sync(server: EmbeddedServer, namespace: str) -> Iterator[Callable[..., FlightCacheSync]]:
    """Factory of FlightCacheSync objects on the session server; each is closed after."""
    made: list[FlightCacheSync] = []

    def make(url: str | None = None, **kw: Any) -> FlightCacheSync:
        kw.setdefault("namespace", namespace)
        fcs = FlightCacheSync(url or server.url, **kw)
        made.append(fcs)
        return fcs

    yield make
    for fcs in made:
        fcs.close()


def ours(threads: list[threading.Thread] | None = None) -> list[str]:
    return [t.name for t in threads or threading.enumerate() if t.name.startswith(OUR_THREADS)]


def test_200_threads_asking_at_once_run_the_loader_once(make_sync: Any) -> None:
    fcs = make_sync()
    runs: list[int] = []
    barrier = threading.Barrier(200)
    results: list[Any] = []

    def loader() -> dict[str, Any]:
        runs.append(threading.get_ident())
        time.sleep(0.3)
        return {"answer": 42}

    def ask() -> None:
        barrier.wait()
        results.append(fcs.do("the-question", loader))

    threads = [threading.Thread(target=ask) for _ in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [{"answer": 42}] * 200
    assert len(runs) == 1
    assert runs[0] not in {t.ident for t in threads}  # a worker thread of the engine ran it
    stats = fcs.stats
    assert stats["calls"] == 200 and stats["loader_runs"] == 1 and stats["misses"] == 1
    assert fcs.do("the-question", loader) == {"answer": 42} and len(runs) == 1  # cached


async def test_a_blocking_sync_loader_keeps_its_lease_over_several_leases(
    make_sync: Any, make_cache: Any
) -> None:
    """The loader blocks its thread for 5 leases; the private loop renews the lease, so the
    other process's cache follows it instead of taking the flight over."""
    fcs = make_sync(lease=0.3)
    other: FlightCache = make_cache(lease=0.3)
    runs: list[str] = []

    def slow() -> str:
        runs.append("sync")
        time.sleep(1.5)
        return "from the blocking loader"

    async def rival() -> str:
        runs.append("async")
        return "from the rival"

    owner = asyncio.ensure_future(asyncio.to_thread(fcs.do, "k", slow))
    first = await wait_for_flight(other, "k")
    follower = asyncio.ensure_future(other.do("k", rival))
    tokens = {first.token}
    while not owner.done():
        info = await other.inspect("k")
        if info.token:
            tokens.add(info.token)
            assert info.lease_left_ms is not None and info.lease_left_ms > 0
        await asyncio.sleep(0.1)
    assert await owner == "from the blocking loader"
    assert await follower == "from the blocking loader"
    assert runs == ["sync"]
    assert tokens == {first.token}  # one owner throughout: never taken over
    assert other.stats["takeovers"] == 0 and other.stats["loader_runs"] == 0
    stats = await asyncio.to_thread(lambda: fcs.stats)
    assert stats["lease_lost"] == 0 and stats["loader_runs"] == 1


async def test_a_sync_process_and_an_async_process_share_one_flight(
    server: EmbeddedServer, namespace: str
) -> None:
    """A real OS process of 20 threads (FlightCacheSync) and this process's 20 coroutines
    (FlightCache) on the same keys: on "sync-first" the sync process starts first and owns
    the flight, on "async-first" this process does; either way one loader run per key and
    every caller in both processes gets the owner's value."""
    async with FlightCache(server.url, namespace=namespace) as fc:
        await fc.ping()
        start = time.monotonic() + 2.0  # the worker's interpreter has started by then
        later = 0.15
        config = {
            "url": server.url,
            "namespace": namespace,
            "threads": 20,
            "loader_s": 0.6,
            "calls": [
                {"key": "sync-first", "at": start},
                {"key": "async-first", "at": start + later},
            ],
        }
        env = dict(os.environ, PYTHONPATH=str(SRC), PYTHONUNBUFFERED="1")
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(SYNC_WORKER),
            json.dumps(config),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        runs: list[str] = []

        async def call(key: str, at: float) -> Any:
            async def loader() -> dict[str, Any]:
                runs.append(key)
                await asyncio.sleep(0.6)
                return {"pid": os.getpid(), "key": key}

            await asyncio.sleep(max(0.0, at - time.monotonic()))
            return await fc.do(key, loader)

        try:
            mine = await asyncio.gather(
                *(call("sync-first", start + later) for _ in range(20)),
                *(call("async-first", start) for _ in range(20)),
            )
            out, err = await asyncio.wait_for(proc.communicate(), 30)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode == 0, err.decode()[-3000:]
        report = json.loads(out.decode().strip().splitlines()[-1])
        assert report["errors"] == []
        assert report["runs"] == ["sync-first"] and runs == ["async-first"]
        sync_owned = {"pid": report["pid"], "key": "sync-first"}
        async_owned = {"pid": os.getpid(), "key": "async-first"}
        assert mine == [sync_owned] * 20 + [async_owned] * 20
        assert report["values"] == {
            "sync-first": [sync_owned] * 20,
            "async-first": [async_owned] * 20,
        }
        assert fc.stats["follows"] >= 1 and report["stats"]["follows"] >= 1  # followed, not hits


async def test_invalidation_from_the_sync_client_reaches_an_async_holders_near_cache(
    make_sync: Any, make_cache: Any
) -> None:
    holder: FlightCache = make_cache(near_lease=5.0)
    fcs: FlightCacheSync = make_sync(near_cache=False)

    async def old() -> str:
        return "old"

    assert await holder.do("k", old) == "old"
    before = holder.stats["commands"]
    assert await holder.do("k", old) == "old"
    assert holder.stats["commands"] == before  # served from its near cache, leased
    live = await asyncio.to_thread(fcs.nodes)
    assert holder.node_id in {n.node_id for n in live}
    t0 = time.monotonic()
    result = await asyncio.to_thread(fcs.invalidate, "k")
    assert result.how == "acked" and result.acked >= 1
    assert time.monotonic() - t0 < 2.5  # by acknowledgement, not the 5 s lease
    assert await holder.get("k") is MISSING  # the holder dropped its copy
    await asyncio.to_thread(fcs.set, "k", "new")
    assert await holder.get("k") == "new"


def _fork_and_use(fcs: FlightCacheSync) -> dict[str, Any]:
    """Fork; the child uses ``fcs`` and reports through a pipe, then leaves at once."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+ warns about fork with threads running
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            os.close(read_end)
            report: dict[str, Any] = {"pid": os.getpid()}
            try:
                report["parent_value"] = fcs.get("from-parent")
                report["child_value"] = fcs.do("from-child", os.getpid)
                report["hit_in_child"] = fcs.do("pre-fork", lambda: "not run")
                engine = fcs._core.engine
                fast = engine.fast if engine is not None else None
                report["fast_pid"] = fast.link.pid if fast is not None else None
                report["node_id"] = fcs.node_id
                report["server_url"] = fcs.server_url
                report["threads"] = ours()
                fcs.close()
                report["threads_after_close"] = ours()
                code = 0
            except BaseException as exc:
                report["error"] = repr(exc)
            with os.fdopen(write_end, "w") as pipe:
                pipe.write(json.dumps(report))
        finally:
            os._exit(code)
    os.close(write_end)
    chunks = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ready, _, _ = select.select([read_end], [], [], 1.0)
        if ready:
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    report = json.loads(b"".join(chunks) or b"{}")
    assert os.waitstatus_to_exitcode(status) == 0, report
    return report


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("embedded", [False, True], ids=["server", "embedded"])
def test_a_cache_made_before_fork_works_in_the_child_and_the_parent_goes_on(
    make_sync: Any, embedded: bool
) -> None:
    """A pre-forking server's case: the child gets its own loop thread and connections
    (its own node id), the parent is undisturbed; an embedded:// parent's server is the
    child's server too."""
    fcs: FlightCacheSync = make_sync("embedded://") if embedded else make_sync()
    fcs.set("from-parent", "parent's")
    assert fcs.do("pre-fork", lambda: "parent's hit") == fcs.do("pre-fork", lambda: "no")
    parent_fast = fcs._core.engine.fast if fcs._core.engine is not None else None
    assert parent_fast is not None  # the caller-thread reads, with a pooled connection
    parent_node = fcs.node_id
    loop_threads = ours()
    assert "flightcache-sync-loop" in loop_threads

    report = _fork_and_use(fcs)

    assert report["parent_value"] == "parent's"
    assert report["child_value"] == report["pid"] != os.getpid()
    assert report["node_id"] != parent_node and f":{report['pid']}:" in report["node_id"]
    assert "flightcache-sync-loop" in report["threads"]
    assert report["threads_after_close"] == []
    # The child's caller-thread reads are its own: its pool, its connections.
    assert report["hit_in_child"] == "parent's hit"
    assert report["fast_pid"] == report["pid"]
    if embedded:
        assert report["server_url"] == fcs.server_url is not None
    # The parent goes on with its own loop and connections, and sees the child's write.
    assert fcs.node_id == parent_node
    assert fcs.get("from-child") == report["pid"]
    assert fcs.do("after-fork", lambda: "parent still works") == "parent still works"
    before = fcs.stats
    assert fcs.do("pre-fork", lambda: "no") == "parent's hit"  # its own pooled connection
    assert fcs._core.engine is not None and fcs._core.engine.fast is parent_fast
    assert fcs.stats["hits"] == before["hits"] + 1
    assert ours().count("flightcache-sync-loop") == 1  # the parent's own, still running


async def test_calling_it_inside_a_running_event_loop_raises_config_error(
    make_sync: Any,
) -> None:
    fcs: FlightCacheSync = make_sync()
    with pytest.raises(ConfigError, match="use FlightCache here"):
        fcs.do("k", lambda: 1)
    for call in (lambda: fcs.get("k"), lambda: fcs.ping(), fcs.close):
        with pytest.raises(ConfigError):
            call()
    # The documented way out: a thread.
    assert await asyncio.to_thread(fcs.do, "k", lambda: 1) == 1


def test_an_async_loader_that_calls_the_sync_client_gets_config_error_not_a_deadlock(
    make_sync: Any,
) -> None:
    fcs: FlightCacheSync = make_sync()

    async def loader() -> Any:  # runs on the engine's own loop
        return fcs.get("other")

    t0 = time.monotonic()
    with pytest.raises(ConfigError):
        fcs.do("k", loader)
    assert time.monotonic() - t0 < 5
    assert fcs.do("k2", lambda: fcs.get("other") is MISSING) is True  # a sync loader may


def test_close_stops_the_loop_thread_and_its_workers(
    server: EmbeddedServer, namespace: str
) -> None:
    before = set(threading.enumerate())
    fcs = FlightCacheSync(server.url, namespace=namespace)
    assert ours() == []  # nothing runs before the first call
    assert fcs.do("k", lambda: "v") == "v"

    def chunks() -> Iterator[int]:
        yield from range(3)

    assert list(fcs.stream("s", chunks)) == [0, 1, 2]
    assert "flightcache-sync-loop" in ours() and any(
        n.startswith("flightcache-loader") for n in ours()
    )
    fcs.close()
    assert ours() == []
    assert set(threading.enumerate()) <= before
    with pytest.raises(FlightError, match="closed"):
        fcs.get("k")
    fcs.close()  # twice is fine


def test_errors_are_the_async_clients_types(make_sync: Any) -> None:
    fcs: FlightCacheSync = make_sync(error_ttl=0)

    class Upstream(Exception):
        pass

    def failing() -> Any:
        raise Upstream("no")

    with pytest.raises(Upstream):
        fcs.do("fails", failing)

    def missing() -> Any:
        raise KeyError("nope")

    assert fcs.do("absent", missing, not_found=(KeyError,)) is NOT_FOUND
    with pytest.raises(ConfigError):
        fcs.do("k", "not callable")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        fcs.do("k", lambda: 1, ttl=-1)
    with pytest.raises(ConfigError):
        FlightCacheSync("ftp://nowhere")  # the settings are checked at once


def test_a_loader_past_its_timeout_is_abandoned_at_once(make_sync: Any) -> None:
    """The caller gets FlightTimeout on time; the thread runs on, and what it returns late
    is stored nowhere."""
    fcs: FlightCacheSync = make_sync()
    done = threading.Event()

    def stuck() -> str:
        time.sleep(1.0)
        done.set()
        return "late"

    t0 = time.monotonic()
    with pytest.raises(FlightTimeout):
        fcs.do("slow", stuck, timeout=0.2)
    assert time.monotonic() - t0 < 0.9
    assert done.wait(5)
    time.sleep(0.1)
    assert fcs.get("slow") != "late"


def test_stream_over_a_plain_generator(make_sync: Any) -> None:
    fcs: FlightCacheSync = make_sync()
    produced: list[int] = []
    closed = threading.Event()

    def tokens() -> Iterator[str]:
        try:
            for i in range(5):
                produced.append(i)
                time.sleep(0.02)
                yield f"t{i}"
        finally:
            closed.set()

    results: list[list[str]] = []

    def read() -> None:
        results.append(list(fcs.stream("story", tokens)))

    threads = [threading.Thread(target=read) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [[f"t{i}" for i in range(5)]] * 5
    assert produced == [0, 1, 2, 3, 4] and closed.wait(5)
    with fcs.stream("story", tokens) as replay:
        assert replay.opened() == "HIT" and list(replay) == [f"t{i}" for i in range(5)]
    with fcs.stream("story", tokens) as replay:  # a hit has every chunk at once
        assert next(replay) == "t0"
        assert replay.ready() == [f"t{i}" for i in range(1, 5)]
        assert replay.ready() == [] and list(replay) == []


def test_flight_decorator_on_the_sync_client_takes_def_and_async_def(make_sync: Any) -> None:
    fcs: FlightCacheSync = make_sync()
    where: list[str] = []

    @fcs.flight(ttl=60)
    def plain(text: str, times: int = 1) -> str:
        where.append(threading.current_thread().name)
        return text * times

    @fcs.flight
    async def coroutine(text: str) -> str:
        where.append(threading.current_thread().name)
        await asyncio.sleep(0)
        return text.upper()

    assert plain("ab") == "ab" and plain(text="ab", times=1) == "ab" and plain("ab", 2) == "abab"
    assert coroutine("x") == "X" and coroutine(text="x") == "X"
    assert where[0].startswith("flightcache-loader") and where[2] == "flightcache-sync-loop"
    assert len(where) == 3  # equal calls were hits
    assert not inspect.iscoroutinefunction(plain) and not inspect.iscoroutinefunction(coroutine)
    assert str(inspect.signature(plain)) == "(text: 'str', times: 'int' = 1) -> 'str'"
    assert plain.__name__ == "plain"


async def test_flight_decorator_on_the_async_client_takes_def_and_async_def(
    make_cache: Any,
) -> None:
    fc: FlightCache = make_cache()
    loop_thread = threading.current_thread()
    where: list[threading.Thread] = []

    @fc.flight(ttl=60)
    def blocking(n: int) -> int:
        where.append(threading.current_thread())
        time.sleep(0.05)  # would stall the event loop if it ran there
        return n * 2

    @fc.flight
    async def native(n: int) -> int:
        where.append(threading.current_thread())
        return n * 3

    assert inspect.iscoroutinefunction(blocking) and inspect.iscoroutinefunction(native)
    assert await blocking(2) == 4 and await blocking(n=2) == 4 and await native(2) == 6
    assert where[0] is not loop_thread and where[1] is loop_thread
    assert str(inspect.signature(blocking)) == "(n: 'int') -> 'int'"
    with pytest.raises(ConfigError):

        @fc.flight
        def numbers() -> Iterator[int]:
            yield 1


async def test_disabled_turns_caching_off_on_the_async_client(make_cache: Any) -> None:
    fc: FlightCache = make_cache()
    runs: list[int] = []

    async def loader() -> tuple[int, int]:
        runs.append(1)
        return (len(runs), 0)

    with fc.disabled():
        assert await fc.do("k", loader) == [1, 0]  # through the codec, as callers get it
        assert await fc.do("k", loader) == [2, 0]
        assert await fc.get("k") is MISSING
    assert (await fc.inspect("k")).state == "vacant"  # nothing was stored
    assert await fc.do("k", loader) == [3, 0]
    assert await fc.do("k", loader) == [3, 0]  # caching is back


def test_disabled_turns_caching_off_on_the_sync_client(make_sync: Any) -> None:
    fcs: FlightCacheSync = make_sync()
    runs: list[int] = []

    @fcs.flight
    def answer() -> int:
        runs.append(1)
        return len(runs)

    with fcs.disabled():
        assert [answer(), answer()] == [1, 2]
        with fcs.disabled():  # nests
            assert answer() == 3
        assert answer() == 4
    assert answer() == 5 and answer() == 5


def test_the_memory_backend_serves_threads_without_a_server() -> None:
    with FlightCacheSync("memory://") as fcs:
        runs: list[int] = []
        barrier = threading.Barrier(20)

        def ask(out: list[Any]) -> None:
            barrier.wait()
            out.append(fcs.do("k", lambda: runs.append(1) or "v"))

        out: list[Any] = []
        threads = [threading.Thread(target=ask, args=(out,)) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert out == ["v"] * 20 and runs == [1]
        assert fcs.ping() == 0


async def test_a_sync_follower_thread_wakes_with_the_async_owners_value(
    make_sync: Any, make_cache: Any
) -> None:
    """The sync client follows a flight an async cache owns, in the same process."""
    owner: FlightCache = make_cache()
    fcs: FlightCacheSync = make_sync()
    release = asyncio.Event()

    async def held() -> str:
        await release.wait()
        return "owner's"

    flight = asyncio.ensure_future(owner.do("k", held))
    await wait_for_flight(owner, "k")
    followers = [
        asyncio.ensure_future(asyncio.to_thread(fcs.do, "k", lambda: "mine")) for _ in range(3)
    ]
    await wait_until(lambda: any(n.startswith("flightcache-sync") for n in ours()), 5, "engine")
    await asyncio.sleep(0.2)
    release.set()
    assert await flight == "owner's"
    assert await asyncio.gather(*followers) == ["owner's"] * 3
    stats = await asyncio.to_thread(lambda: fcs.stats)
    assert stats["loader_runs"] == 0 and stats["follows"] >= 1


def test_a_client_left_open_is_closed_as_the_interpreter_exits() -> None:
    """No close(), no with: at exit the client still closes its engine, before the
    interpreter's thread pools stop, so an embedded:// client stops its private server."""
    script = (
        "from flightcache import FlightCacheSync\n"
        "fcs = FlightCacheSync('embedded://', namespace='exit')\n"
        "fcs.do('k', lambda: 'v')\n"
        "print(fcs.server_url, flush=True)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(SRC))
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - t0 < 15
    assert "failed" not in proc.stderr, proc.stderr
    url = proc.stdout.strip()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(OSError):  # the private server is gone with its client
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
