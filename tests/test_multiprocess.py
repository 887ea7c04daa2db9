"""Multi-process behaviour with real OS processes, real servers, SIGKILL and SIGSTOP."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from flightcache import EmbeddedServer, FlightCache
from flightcache._keys import KeySpace

from .helpers.monitor import CommandLog
from .helpers.procs import Fleet, markers, wait_for

pytestmark = pytest.mark.timeout(90)


def base(server: EmbeddedServer, namespace: str, tmp_path: Path, **kw: Any) -> dict[str, Any]:
    cfg = {
        "url": server.url,
        "namespace": namespace,
        "key": "the-question",
        "markers": str(tmp_path),
    }
    cfg.update(kw)
    return cfg


def values(reports: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    return [r for rep in reports if rep for r in rep["results"]]


def marker_pid(path: Path) -> int:
    return int(path.name.rsplit("-", 1)[1])


def test_stampede_4_processes_x_50_callers_runs_the_loader_once(
    server: EmbeddedServer, namespace: str, tmp_path: Path
) -> None:
    """200 callers in 4 processes arrive together: one loader run, and every process took
    part in that one flight while it ran (three followed it; none came late and merely hit
    the stored result, which would make "one run" prove nothing)."""
    gate = tmp_path / "gate"
    cfg = base(
        server,
        namespace,
        tmp_path,
        callers=50,
        loader_s=0.2,
        gate=str(gate),
        start_at=time.monotonic() + 2.0,
    )
    admin = redis.Redis.from_url(server.url)
    waiters = KeySpace(namespace).flight("the-question").waiters
    with Fleet() as fleet:
        workers = [fleet.start(f"w{i}", **cfg) for i in range(4)]
        # The loader keeps its value until the other three processes queue behind it, so a
        # process that starts slowly on a loaded machine is waited for, not turned into a hit.
        wait_for(lambda: admin.llen(waiters) == 3, 30, "three processes to follow", 0.02)
        gate.touch()
        reports = [w.wait(30) for w in workers]
    admin.close()
    results = values(reports)
    assert len(results) == 200
    assert all("pid" in r for r in results), [r for r in results if "pid" not in r][:3]
    assert len(markers(tmp_path, "start")) == 1
    assert len({r["pid"] for r in results}) == 1
    assert all(rep is not None for rep in reports)
    stats = [rep["stats"] for rep in reports if rep]
    assert sorted(s["loader_runs"] for s in stats) == [0, 0, 0, 1]
    for s in stats:
        assert s["hits"] == 0, s  # nobody came late to a stored result
        assert s["coalesced"] == 49, s  # one request to the server per process
        assert s["follows"] == (0 if s["loader_runs"] else 1), s  # the others followed
    owner_pid = next(rep["pid"] for rep in reports if rep and rep["stats"]["loader_runs"])
    loader_end = float((tmp_path / f"end-{owner_pid}").read_text())
    assert all(r["t0"] < loader_end for r in results)  # every call began before the value


def test_owner_killed_mid_flight_survivors_get_a_value_from_one_takeover(
    server: EmbeddedServer, namespace: str, tmp_path: Path
) -> None:
    lease, loader_s = 1.0, 1.0
    cfg = base(
        server,
        namespace,
        tmp_path,
        callers=10,
        loader_s=loader_s,
        lease=lease,
        start_at=time.monotonic() + 1.5,
    )
    with Fleet() as fleet:
        workers = [fleet.start(f"w{i}", **cfg) for i in range(3)]
        first = wait_for(lambda: markers(tmp_path, "start"), 15, "the first loader to start")
        time.sleep(0.3)  # mid-flight
        owner_pid = marker_pid(first[0])
        killed_at = time.monotonic()
        os.kill(owner_pid, signal.SIGKILL)
        reports = [w.wait(30) for w in workers if w.pid != owner_pid]
    results = values(reports)
    assert len(results) == 20
    assert all("pid" in r for r in results), results[:3]
    assert {r["pid"] for r in results} != {owner_pid}
    assert len({r["pid"] for r in results}) == 1
    # One takeover: the lease lapses, the loader runs once more. The bound is generous (a
    # loaded 2-core machine); the tight figure is the benchmark's. Without a takeover the
    # survivors would wait out the wait bound, 2 x (30 + 1) + 1 = 63 s.
    latest = max(r["t1"] for r in results)
    assert latest - killed_at <= 3 * (lease + loader_s), latest - killed_at
    assert len(markers(tmp_path, "start")) == 2
    assert sum(rep["stats"]["takeovers"] for rep in reports if rep) == 1


@pytest.mark.parametrize("bound", [False, True], ids=["own-lease", "session"])
def test_paused_owner_is_fenced_and_its_callers_get_the_new_owners_value(
    server: EmbeddedServer, namespace: str, tmp_path: Path, bound: bool
) -> None:
    """With its flight's own lease, or bound to its session (docs/protocol.md, "Sessions"): the
    paused owner's lease lapses, the other process takes the flight over, and the paused one,
    resumed, is fenced and returns the new owner's value."""
    lease = 1.0
    cfg = base(
        server,
        namespace,
        tmp_path,
        callers=5,
        loader_s=1.5,
        lease=lease,
        start_at=time.monotonic() + 2.5,
        warm_s=0.6 if bound else 0,  # (a session starts after lease/3 of owning)
    )
    admin = redis.Redis.from_url(server.url)
    meta = KeySpace(namespace).flight("the-question").meta
    with Fleet() as fleet:
        workers = [fleet.start(f"w{i}", **cfg) for i in range(2)]
        first = wait_for(lambda: markers(tmp_path, "start"), 15, "the first loader to start")
        stale_pid = marker_pid(first[0])
        assert (admin.hget(meta, "se") is not None) is bound
        time.sleep(0.2)
        os.kill(stale_pid, signal.SIGSTOP)
        try:
            wait_for(lambda: len(markers(tmp_path, "start")) == 2, 10, "a takeover")
            time.sleep(lease)  # paused for well over a lease in all
        finally:
            os.kill(stale_pid, signal.SIGCONT)
        reports = {w.pid: w.wait(30) for w in workers}
    new_pid = next(pid for pid in reports if pid != stale_pid)
    stale = reports[stale_pid]
    assert stale is not None
    assert [r.get("pid") for r in stale["results"]] == [new_pid] * 5
    assert [m.name for m in markers(tmp_path, "cancelled")] == [f"cancelled-{stale_pid}"]
    assert [m.name for m in markers(tmp_path, "end")] == [f"end-{new_pid}"]
    assert stale["stats"]["lease_lost"] == 1
    fc_value = asyncio.run(_get(server.url, namespace, "the-question"))
    assert fc_value["pid"] == new_pid
    admin.close()


async def _get(url: str, namespace: str, key: str) -> Any:
    async with FlightCache(url, namespace=namespace) as fc:
        return await fc.get(key)


# Set-up, not waiting: HELLO, CLIENT SETNAME/SETINFO, loading the scripts, the listener.
HANDSHAKE = {"HELLO", "CLIENT", "SCRIPT", "SUBSCRIBE"}


def _addresses_of(admin: redis.Redis, node: str) -> set[str]:
    return {c["addr"] for c in admin.client_list() if node in c.get("name", "")}


@pytest.mark.parametrize("wait_s,lease", [(2.0, 3.0), (4.0, 1.0)])
def test_a_waiting_process_sends_a_bounded_number_of_commands_however_many_callers(
    private_server: EmbeddedServer, namespace: str, tmp_path: Path, wait_s: float, lease: float
) -> None:
    """1 and 1,000 callers in a follower process cost the server the same commands, bounded
    by one join per lease period (the wake-up itself costs no command); no polling."""
    admin = redis.Redis.from_url(private_server.url)
    log = CommandLog(private_server.host, private_server.port)
    counts = {}
    for callers in (1, 1000):
        key = f"q-{callers}"
        gate = tmp_path / f"gate-{callers}"
        # No near cache (no listener connection) and a node lease that needs no renewal
        # during the test: what is counted is the flight's own commands.
        cfg = base(
            private_server,
            namespace,
            tmp_path,
            key=key,
            loader_s=0.0,
            lease=lease,
            gate=str(gate),
            near_cache=False,
            node_ttl=600.0,
        )
        waiters = f"{namespace}:waiters:{{{FlightCache('memory://').keyspace.flight(key).digest}}}"
        with Fleet() as fleet:
            owner = fleet.start("owner", **cfg, callers=1)
            wait_for((tmp_path / f"start-{owner.pid}").exists, 15, "the owner to start its loader")
            follower = fleet.start("follower", **cfg, callers=callers, hold=True)
            wait_for(lambda: admin.llen(waiters) == 1, 15, "the follower to queue")  # noqa: B023
            time.sleep(wait_s)  # the follower waits this long on a live owner
            gate.touch()
            report = follower.read_report()  # the process holds its connections open
            assert report["stats"]["follows"] == 1
            assert {r.get("pid") for r in report["results"]} == {owner.pid}
            sent = log.sent_by(_addresses_of(admin, report["node"]))
            counts[callers] = sum(n for cmd, n in sent.items() if cmd not in HANDSHAKE)
            follower.wait(15)
            owner.wait(15)
    log.close()
    admin.close()
    # Registering the node (SET, SADD) and a warm-up GET, then the join, then one join (the
    # lease re-check) per lease period; the wake-up arrives on the subscription, no command.
    periods = wait_s / lease
    assert counts[1] <= 3 + 1 + (periods + 1), counts
    assert counts[1000] <= counts[1] + 2, counts


def test_sixteen_followers_take_over_with_at_most_three_incr(
    private_server: EmbeddedServer, namespace: str, tmp_path: Path
) -> None:
    lease = 1.0
    cfg = base(private_server, namespace, tmp_path, loader_s=1.0, lease=lease, callers=1)
    admin = redis.Redis.from_url(private_server.url)
    with Fleet() as fleet:
        owner = fleet.start("owner", **{**cfg, "loader_s": 60.0})  # runs until it is killed
        wait_for(lambda: markers(tmp_path, "start"), 15, "the owner to start its loader")
        followers = [fleet.start(f"f{i}", **cfg) for i in range(16)]
        meta = f"{namespace}:meta:{{{FlightCache('memory://').keyspace.flight('the-question').digest}}}"
        waiters = meta.replace(":meta:", ":waiters:")
        wait_for(lambda: admin.llen(waiters) == 16, 30, "16 followers to queue", interval=0.05)
        before = admin.info("commandstats")
        owner.kill()
        reports = [w.wait(30) for w in followers]
        after = admin.info("commandstats")

    def incr(stats: dict[str, Any]) -> int:
        return sum(
            int(stats.get(k, {}).get("calls", 0)) for k in ("cmdstat_incr", "cmdstat_incrby")
        )

    results = values(reports)
    assert len(results) == 16 and all("pid" in r for r in results), results[:3]
    assert len({r["pid"] for r in results}) == 1
    assert incr(after) - incr(before) <= 3
    assert len(markers(tmp_path, "start")) == 2
    admin.close()


def test_wall_clock_jumps_in_the_owner_change_nothing(
    server: EmbeddedServer, namespace: str, tmp_path: Path
) -> None:
    """time.time() jumps an hour forward and back every 100 ms in the owner; leases, renewals,
    TTLs and the follower's wait do not notice."""
    lease = 0.6
    cfg = base(server, namespace, tmp_path, loader_s=2.0, lease=lease, callers=3, ttl=60)
    with Fleet() as fleet:
        owner = fleet.start("owner", **cfg, clock_jump=True)
        wait_for(lambda: markers(tmp_path, "start"), 15, "the owner to start its loader")
        follower = fleet.start("follower", **cfg)
        reports = [owner.wait(30), follower.wait(30)]
    results = values(reports)
    assert len(results) == 6 and {r.get("pid") for r in results} == {owner.pid}
    assert len(markers(tmp_path, "start")) == 1
    assert reports[0]["stats"]["lease_lost"] == 0
    client = redis.Redis.from_url(server.url)
    digest = FlightCache("memory://").keyspace.flight("the-question").digest
    ttl_ms = client.pttl(f"{namespace}:result:{{{digest}}}")
    client.close()
    assert 50_000 <= ttl_ms <= 66_000
