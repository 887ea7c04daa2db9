"""The sync client's fast path (``_syncread.py``): a call's first read in the caller's own
thread, the hand-off of a miss to the loop thread with the join's answer, and the threads of
one process sharing one call (``_syncgroup.py``). docs/sync.md, "The fast path".

Real servers, real threads. Each test names what would break it.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from flightcache import (
    MISSING,
    EmbeddedServer,
    FlightCacheSync,
    FlightTimeout,
    RemoteError,
    Tuning,
)
from flightcache._keys import KeySpace
from flightcache._syncgroup import Groups
from flightcache._syncread import FastPath

SLOW_S = 10.0  # generous bound for what must be quick; leases below are 30 s


@pytest.fixture
def make_sync(server: EmbeddedServer, namespace: str) -> Iterator[Callable[..., FlightCacheSync]]:
    made: list[FlightCacheSync] = []

    def make(url: str | None = None, **kw: Any) -> FlightCacheSync:
        kw.setdefault("namespace", namespace)
        fcs = FlightCacheSync(url or server.url, **kw)
        made.append(fcs)
        return fcs

    yield make
    for fcs in made:
        fcs.close()


def fast_of(fcs: FlightCacheSync) -> FastPath:
    engine = fcs._core.current()
    fast = engine.fast_path()
    assert fast is not None, "a plain server's cache, opened, has a fast path"
    return fast


def opened(fcs: FlightCacheSync) -> FlightCacheSync:
    fcs.ping()  # the first call opens the cache on the loop; the fast path needs it open
    return fcs


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``fn`` in a thread; its outcome (value or exception) lands in the list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def test_a_hit_is_served_in_the_callers_thread_while_the_loop_is_busy(make_sync: Any) -> None:
    """The hop to the loop thread is what the fast path removes: with the loop thread held
    up, a hit still comes back (it would wait for the loop otherwise)."""
    fcs = opened(make_sync(near_cache=False))
    assert fcs.do("k", lambda: "v") == "v"
    engine = fcs._core.current()
    release = threading.Event()
    engine.loop.call_soon_threadsafe(release.wait, 30)  # the loop thread blocks here
    try:
        thread, out = in_thread(lambda: (fcs.do("k", lambda: "loader ran"), fcs.get("k")))
        thread.join(SLOW_S)
        assert out == [("v", "v")], "the hit needed the loop thread"
    finally:
        release.set()


def test_a_miss_costs_two_round_trips_and_a_hit_one(make_sync: Any) -> None:
    """The join sent from the caller's thread is the miss's first round trip: the loop goes
    on from its answer (a claim with the token) and sends only complete_flight."""
    fcs = opened(make_sync(near_cache=False))
    fcs.do("warm", lambda: 0)
    before = fcs.stats
    assert fcs.do("k", lambda: 1) == 1
    middle = fcs.stats
    assert fcs.do("k", lambda: 2) == 1
    after = fcs.stats
    assert delta(before, middle) == {"calls": 1, "misses": 1, "loader_runs": 1, "commands": 2}
    assert delta(middle, after) == {"calls": 1, "hits": 1, "commands": 1}


def test_threads_asking_at_once_share_one_join_per_process(make_sync: Any) -> None:
    """50 threads on one fresh key: one join, one loader run, one complete_flight; the
    others wait on the sync door's own group and are woken by the loop thread."""
    fcs = opened(make_sync(near_cache=False))
    fcs.do("warm", lambda: 0)
    release = threading.Event()
    runs: list[int] = []

    def loader() -> str:
        runs.append(1)
        release.wait(SLOW_S)
        return "shared"

    before = fcs.stats
    threads = [in_thread(lambda: fcs.do("k", loader)) for _ in range(50)]
    deadline = time.monotonic() + SLOW_S
    while fcs.stats["coalesced"] - before.get("coalesced", 0) < 49:
        assert time.monotonic() < deadline, "the threads did not all join the one call"
        time.sleep(0.01)
    release.set()
    for thread, _ in threads:
        thread.join(SLOW_S)
    assert [out for _, out in threads] == [["shared"]] * 50
    got = delta(before, fcs.stats)
    assert runs == [1] and got["loader_runs"] == 1 and got["coalesced"] == 49
    assert got["commands"] == 2  # one join, one complete_flight, for 50 threads


def test_a_follower_whose_wake_message_came_before_its_waiter_reads_the_stream(
    make_sync: Any,
) -> None:
    """The gap argument (docs/protocol.md, the wake channel, point 5): the join in the
    caller's thread put this node in the flight's waiters, but its waiter is made on the
    loop after the join. Here the owner's `done` reaches this node (and is dropped: no
    waiter yet) before the hand-off; the waiter, flagged lost, re-reads the stream from the
    join's position and has the value at once, not at the lease re-check 30 s later."""
    owner = opened(make_sync(lease=30.0, near_cache=False))
    fcs = opened(make_sync(lease=30.0, near_cache=False))
    fast = fast_of(fcs)
    release = threading.Event()
    owning, owner_out = in_thread(lambda: owner.do("k", lambda: release.wait(SLOW_S) and "own"))
    deadline = time.monotonic() + SLOW_S
    while fcs.inspect("k").token is None:
        assert time.monotonic() < deadline, "the owner never claimed"
        time.sleep(0.01)

    hub = fast.flights.hub
    joined = threading.Event()
    hand_off = fast._hand_off

    def late_hand_off(group: Any, work: Any) -> None:  # the loop is told only after done
        heard = hub.heard
        joined.set()
        until = time.monotonic() + SLOW_S
        while hub.heard == heard and time.monotonic() < until:
            time.sleep(0.005)
        hand_off(group, work)

    fast._hand_off = late_hand_off  # type: ignore[method-assign]
    started = time.monotonic()
    following, out = in_thread(lambda: fcs.do("k", lambda: "follower's loader ran"))
    assert joined.wait(SLOW_S), "the follower's join did not hand off"
    release.set()
    owning.join(SLOW_S)
    following.join(SLOW_S)
    assert owner_out == ["own"]
    assert out == ["own"], "the follower missed the done published before its waiter"
    assert time.monotonic() - started < 25.0  # well before the 30 s lease re-check
    stats = fcs.stats
    assert stats["loader_runs"] == 0 and stats["follows"] == 1


def test_a_claim_made_while_a_loop_call_of_the_key_follows_is_run_and_heard(
    make_sync: Any, server: EmbeddedServer, namespace: str
) -> None:
    """A loop-thread call of the key (refresh_ahead takes the loop) follows an owner that
    vanishes (its meta deleted: a lapsed lease, 30 s early); a fast-path call then claims
    the vacant flight. It runs its own flight (its join took the node out of the waiters
    list), and the loop call, told to re-read its stream, takes that value at once."""
    owner = opened(make_sync(lease=30.0, near_cache=False))
    fcs = opened(make_sync(lease=30.0, near_cache=False))
    fast = fast_of(fcs)
    release = threading.Event()
    owning, _ = in_thread(lambda: owner.do("k", lambda: release.wait(SLOW_S) and "old owner"))
    deadline = time.monotonic() + SLOW_S
    while fcs.inspect("k").token is None:
        assert time.monotonic() < deadline, "the owner never claimed"
        time.sleep(0.01)
    looping, loop_out = in_thread(lambda: fcs.do("k", lambda: "loop ran", refresh_ahead=True))
    digest = KeySpace(namespace).flight("k").digest
    slots = fcs._core.current().cache._local.slots
    while digest not in slots or fcs.inspect("k").followers < 1:
        assert time.monotonic() < deadline, "the loop call never followed"
        time.sleep(0.01)
    raw = redis.Redis.from_url(server.url)
    try:
        raw.delete(KeySpace(namespace).flight("k").meta)  # the owner is gone, as if lapsed
    finally:
        raw.close()
    started = time.monotonic()
    claiming, fast_out = in_thread(lambda: fcs.do("k", lambda: "new owner"))
    claiming.join(SLOW_S)
    looping.join(SLOW_S)
    release.set()
    owning.join(SLOW_S)
    assert fast_out == ["new owner"]
    assert loop_out == ["new owner"]
    assert time.monotonic() - started < 25.0  # not the 30 s re-check
    assert fast.groups.__len__() == 0


def test_a_stored_error_is_raised_as_the_async_client_raises_it(make_sync: Any) -> None:
    """The join returns an error record as a hit; the fast path decodes it as the engine
    does: RemoteError, for error_ttl."""
    fcs = opened(make_sync(near_cache=False, error_ttl=30.0))
    other = opened(make_sync(near_cache=False, error_ttl=30.0))

    def failing() -> Any:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        fcs.do("k", failing)
    before = other.stats
    with pytest.raises(RemoteError, match="boom"):
        other.do("k", lambda: "not run")
    assert delta(before, other.stats)["hits"] == 1
    assert other.get("k") is MISSING and fcs.get("k") is MISSING  # as FlightCache.get


def test_a_tagged_hit_is_checked_and_a_stale_one_runs_the_loader(make_sync: Any) -> None:
    fcs = opened(make_sync(near_cache=False))
    assert fcs.do("k", lambda: "v1", tags=["t"]) == "v1"
    assert fcs.do("k", lambda: "not run", tags=["t"]) == "v1"
    assert fcs.get("k") == "v1"
    fcs.invalidate_tags(["t"])
    assert fcs.get("k") is MISSING
    assert fcs.do("k", lambda: "v2", tags=["t"]) == "v2"
    assert fcs.stats["tag_stale"] >= 2


def test_a_near_cache_copy_read_in_the_callers_thread_is_dropped_by_an_invalidation(
    make_sync: Any,
) -> None:
    """With a near cache, a hit read here is leased (on the loop, as of the read's send)
    and served from then on with no round trip; an invalidation from another node drops it
    before its call returns."""
    holder = opened(make_sync(near_cache=True))
    writer = opened(make_sync(near_cache=True))
    writer.set("k", "old")
    assert holder.do("k", lambda: "not run") == "old"  # the fast path's join: leased
    deadline = time.monotonic() + SLOW_S
    while fast_of(holder)._near(fast_of(holder)._digest("k")) is None:
        assert time.monotonic() < deadline, "the hit was never leased"
        time.sleep(0.01)
    before = holder.stats["commands"]
    assert holder.do("k", lambda: "not run") == "old"
    assert holder.get("k") == "old"
    assert holder.stats["commands"] == before  # no round trip
    assert writer.set("k", "new").how == "acked"
    assert holder.do("k", lambda: "not run") == "new"
    assert holder.get("k") == "new"


def test_backends_other_than_one_plain_server_take_the_loop(
    make_sync: Any, server: EmbeddedServer, private_server: EmbeddedServer
) -> None:
    for url in ("memory://", [server.url, private_server.url]):
        fcs = opened(make_sync(url))
        assert fcs._core.current().fast_path() is None
        assert fcs.do("k", lambda: "v") == "v"
        assert fcs.do("k", lambda: "not run") == "v"
    fcs = opened(make_sync(private_server.url))
    assert fcs._core.current().fast_path() is not None
    assert fcs.do("k", lambda: "v") == "v"
    with fcs.disabled():  # disabled() is the engine's: the loop thread takes the call
        assert fcs.do("k", lambda: "uncached") == "uncached"


def test_an_unreachable_server_falls_open_through_the_loop(make_sync: Any) -> None:
    """The server dies: the fast path's join fails, the call goes to the loop thread, which
    fails open (the loader runs here); later calls skip the fast path while fail-open
    answers them, and use it again once the server is back."""
    server = EmbeddedServer().start()
    try:
        # failover_s: how long a call retries before it fails open (10 s by default).
        fcs = opened(make_sync(server.url, near_cache=False, tuning=Tuning(failover_s=0.5)))
        assert fcs.do("k", lambda: "v") == "v"
        server.stop()
        started = time.monotonic()
        assert fcs.do("k2", lambda: "alone") == "alone"
        assert fcs.do("k3", lambda: "alone too") == "alone too"
        assert time.monotonic() - started < 30.0
        assert fcs.stats["fail_open"] >= 1
    finally:
        server.stop()


def test_a_frozen_server_bounds_the_callers_read_by_socket_timeout(make_sync: Any) -> None:
    """The caller's thread reads on a blocking socket bounded by the kernel's timeouts
    (SO_RCVTIMEO, socket_timeout): a server that stops answering fails the read there, and
    the call goes to the loop thread, which fails open; nothing hangs."""
    server = EmbeddedServer().start()
    try:
        fcs = opened(
            make_sync(
                server.url, near_cache=False, socket_timeout=1.0, tuning=Tuning(failover_s=1.0)
            )
        )
        assert fcs.do("k", lambda: "v") == fcs.do("k", lambda: "not run") == "v"
        os.kill(server.pid, signal.SIGSTOP)
        try:
            thread, out = in_thread(lambda: fcs.do("k2", lambda: "alone"))
            thread.join(30.0)
            assert out == ["alone"], "the caller's read was not bounded"
        finally:
            os.kill(server.pid, signal.SIGCONT)
    finally:
        server.stop()


def test_a_thread_that_left_on_its_bound_does_not_break_the_wake_chain() -> None:
    """Waiting threads are woken a few ahead, each by one before it; those that left
    (their bound passed) are skipped, so the threads after them still wake."""
    groups = Groups()
    group, leader = groups.enter("d")
    assert leader is None
    outs: list[Any] = []

    def wait(bound: float) -> None:
        joined, waiter = groups.enter("d")
        assert joined is group and waiter is not None
        try:
            outs.append(group.wait(waiter, bound))
        except FlightTimeout:
            outs.append("left")

    threads = []
    for i, bound in enumerate((SLOW_S, 0.05, 0.05, 0.05, SLOW_S)):
        thread = threading.Thread(target=wait, args=(bound,), daemon=True)
        thread.start()
        threads.append(thread)
        deadline = time.monotonic() + SLOW_S
        while len(group.waiters) < i + 1:
            assert time.monotonic() < deadline
            time.sleep(0.001)
    for thread in threads[1:4]:
        thread.join(SLOW_S)
    assert outs == ["left"] * 3
    groups.settle(group, b"v")
    for thread in threads:
        thread.join(SLOW_S)
    assert outs == ["left"] * 3 + [b"v", b"v"]
    assert len(groups) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's struct timeval")
def test_a_unix_socket_server_has_the_fast_path_with_kernel_timeouts(
    make_sync: Any, tmp_path: Any
) -> None:
    path = str(tmp_path / "valkey.sock")
    server = EmbeddedServer(extra_args=("--unixsocket", path, "--unixsocketperm", "700"))
    server.start()
    try:
        fcs = opened(make_sync(f"unix://{path}?db=0", near_cache=False, socket_timeout=2.5))
        fast = fast_of(fcs)
        before = fcs.stats
        assert fcs.do("k", lambda: "v") == fcs.do("k", lambda: "not run") == "v"
        assert delta(before, fcs.stats)["commands"] == 3  # join + complete; join
        (conn,) = fast.link._idle
        sock = conn._sock
        assert sock.gettimeout() is None  # blocking: no poll before each send and receive
        limit = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)
        assert struct.unpack("ll", limit) == (2, 500_000)
    finally:
        server.stop()


def test_a_leader_interrupted_mid_read_leaves_the_call_to_the_loop_for_the_others(
    make_sync: Any,
) -> None:
    """Ctrl-C in the thread whose join is on the wire (it ran: it claimed) stops that
    thread only: the loop sends the join again with the same claim id, finds the claim,
    runs the loader once, and the other threads of the group get its value."""
    fcs = opened(make_sync(near_cache=False))
    fast = fast_of(fcs)
    digest = fast._digest("k")
    real = fast.link.timed
    interrupted: list[bool] = []

    def timed(packed: bytes) -> Any:
        answer = real(packed)
        if not interrupted:
            interrupted.append(True)
            deadline = time.monotonic() + SLOW_S
            while not fast.groups._groups[digest].waiters:  # another thread waits on it
                assert time.monotonic() < deadline
                time.sleep(0.005)
            raise KeyboardInterrupt
        return answer

    fast.link.timed = timed  # type: ignore[method-assign]
    runs: list[int] = []

    def loader() -> str:
        runs.append(1)
        return "v"

    leading, leader_out = in_thread(lambda: fcs.do("k", loader))
    deadline = time.monotonic() + SLOW_S
    while len(fast.groups) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    waiting, waiter_out = in_thread(lambda: fcs.do("k", loader))
    leading.join(SLOW_S)
    waiting.join(SLOW_S)
    assert len(leader_out) == 1 and isinstance(leader_out[0], KeyboardInterrupt)
    assert waiter_out == ["v"], "the interrupt reached the other thread of the group"
    assert runs == [1]
    assert fcs.do("k", lambda: "not run") == "v"
