"""Redis/Valkey Cluster: the protocol on a real cluster of 3 masters with a replica each."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from redis.cluster import RedisCluster

from flightcache import FlightCache
from flightcache._backends.embedded import (
    CLUSTER_MAX_PORT,
    EmbeddedCluster,
    cli_binary,
    free_port,
)
from flightcache._keys import KeySpace

from .helpers.flights import wait_until
from .helpers.procs import Fleet, markers, wait_for

pytestmark = pytest.mark.timeout(90)


def test_cluster_nodes_draw_only_ports_whose_bus_port_exists(cluster: EmbeddedCluster) -> None:
    """A cluster node listens on its port + 10000 too, and refuses a port above 55535; the
    kernel hands out ports up to 60999, so a node drawn at random failed to start one time
    in five, and a cluster whose node failed five draws in a row did not start at all. Ports
    are drawn at most 55535 for cluster nodes (200 draws here), as the fixture's show."""
    drawn = [free_port(highest=CLUSTER_MAX_PORT) for _ in range(200)]
    assert max(drawn) <= CLUSTER_MAX_PORT
    assert all(server.port <= CLUSTER_MAX_PORT for server in cluster.servers)


async def test_a_stampede_on_a_cluster_runs_the_loader_once_per_key(
    cluster: EmbeddedCluster, namespace: str
) -> None:
    """3 nodes x 30 keys (over every master's slots) x 5 callers: one loader run per key, and
    for every key the two other nodes followed that run while it was under way."""
    caches = [FlightCache(cluster.url, namespace=namespace) for _ in range(3)]
    runs: dict[str, int] = {}
    gate = asyncio.Event()

    def loader_for(key: str) -> Any:
        async def loader() -> str:
            runs[key] = runs.get(key, 0) + 1
            await gate.wait()  # held until every other node follows this flight
            return key.upper()

        return loader

    try:
        keys = [f"key-{i}" for i in range(30)]  # spread over every master's slots
        calls = [fc.do(k, loader_for(k)) for fc in caches for k in keys for _ in range(5)]
        gathered = asyncio.gather(*calls)
        follows = lambda: sum(fc.stats["follows"] for fc in caches)  # noqa: E731
        await wait_until(lambda: follows() >= 2 * len(keys), 30, "2 followers per key")
        gate.set()
        results = await gathered
        assert results == [k.upper() for _fc in caches for k in keys for _ in range(5)]
        assert runs == dict.fromkeys(keys, 1)
        assert follows() == 2 * len(keys)  # each key: one owner, two nodes following it
        assert sum(fc.stats["hits"] for fc in caches) == 0  # no node came late to a hit
        assert all(fc.stats["coalesced"] == 4 * len(keys) for fc in caches)
        info = await caches[0].inspect("key-0")
        assert info.state == "cached"
    finally:
        gate.set()
        for fc in caches:
            await fc.aclose()


async def test_streams_and_invalidation_work_across_cluster_nodes(
    cluster: EmbeddedCluster, namespace: str
) -> None:
    a = FlightCache(cluster.url, namespace=namespace)
    b = FlightCache(cluster.url, namespace=namespace, cluster=False)  # the URL says cluster
    try:

        async def produce() -> Any:
            for n in range(5):
                await asyncio.sleep(0.02)
                yield n

        own = asyncio.ensure_future(_collect(a.stream("s", produce)))
        await asyncio.sleep(0.05)
        assert await _collect(b.stream("s", produce)) == await own == list(range(5))

        await a.set("k", "old")
        assert await b.get("k") == "old"  # leased in b's near cache
        result = await a.invalidate("k")
        assert result.how == "acked" and result.acked >= 1
        assert await b.get("k") != "old"
    finally:
        await a.aclose()
        await b.aclose()


async def _collect(stream: Any) -> list[Any]:
    return [c async for c in stream]


def test_four_processes_on_a_cluster_run_the_loader_once(
    cluster: EmbeddedCluster, namespace: str, tmp_path: Path
) -> None:
    """4 processes x 50 callers on a cluster: one loader run, and the other three processes
    followed it while it ran (none came late to a stored result)."""
    gate = tmp_path / "gate"
    cfg = {
        "url": cluster.url,
        "namespace": namespace,
        "key": "the-question",
        "markers": str(tmp_path),
        "callers": 50,
        "loader_s": 0.2,
        "gate": str(gate),
        "start_at": time.monotonic() + 2.0,
    }
    first = cluster.servers[0]
    admin = RedisCluster(host=first.host, port=first.port)
    waiters = KeySpace(namespace).flight("the-question").waiters
    try:
        with Fleet() as fleet:
            workers = [fleet.start(f"w{i}", **cfg) for i in range(4)]
            wait_for(lambda: admin.llen(waiters) == 3, 30, "three processes to follow", 0.02)
            gate.touch()
            reports = [w.wait(30) for w in workers]
    finally:
        admin.close()
    results = [r for rep in reports if rep for r in rep["results"]]
    assert len(results) == 200 and all("pid" in r for r in results), results[:3]
    assert len({r["pid"] for r in results}) == 1
    assert len(markers(tmp_path, "start")) == 1
    stats = [rep["stats"] for rep in reports if rep]
    assert len(stats) == 4
    assert sorted(s["loader_runs"] for s in stats) == [0, 0, 0, 1]
    for s in stats:
        assert s["hits"] == 0, s
        assert s["follows"] == (0 if s["loader_runs"] else 1), s


def _master_of(cluster: EmbeddedCluster, key: str) -> Any:
    cli = cli_binary(cluster.binary)
    first = cluster.servers[0]
    slot = int(
        subprocess.run(
            [cli, "-p", str(first.port), "cluster", "keyslot", key],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    )
    nodes = subprocess.run(
        [cli, "-p", str(first.port), "cluster", "nodes"], capture_output=True, text=True, timeout=5
    ).stdout
    for line in nodes.splitlines():
        fields = line.split()
        if "master" not in fields[2] or "fail" in fields[2]:
            continue
        for part in fields[8:]:
            lo, _, hi = part.partition("-")
            if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
                return next(s for s in cluster.servers if s.port == port)
    raise AssertionError(f"no master serves slot {slot}")


@pytest.mark.timeout(120)
def test_killing_the_master_of_a_flight_mid_flight_still_answers_everyone(
    namespace: str, tmp_path: Path
) -> None:
    """A master is SIGKILLed while its flight runs; its replica takes over (the flight's
    meta may be lost with it); every caller still gets one value and nothing hangs."""
    with EmbeddedCluster(masters=3, replicas=1) as cluster:
        key = "the-question"
        digest = FlightCache("memory://").keyspace.flight(key).digest
        master = _master_of(cluster, f"{{{digest}}}")
        cfg = {
            "url": cluster.url,
            "namespace": namespace,
            "key": key,
            "markers": str(tmp_path),
            "callers": 10,
            "loader_s": 2.0,
            "lease": 1.0,
            "start_at": time.monotonic() + 1.5,
        }
        with Fleet() as fleet:
            workers = [fleet.start(f"w{i}", **cfg) for i in range(3)]
            wait_for(lambda: markers(tmp_path, "start"), 20, "the first loader to start")
            os.kill(master.pid, signal.SIGKILL)
            killed = time.monotonic()
            assert master.proc is not None
            master.proc.wait(5)
            reports = [w.wait(60) for w in workers]
        results = [r for rep in reports if rep for r in rep["results"]]
        assert len(results) == 30
        errors = [r for r in results if "pid" not in r]
        assert not errors, errors[:3]
        assert len({r["pid"] for r in results}) == 1
        assert max(r["t1"] for r in results) - killed < 30


async def test_a_bloom_filter_works_on_a_cluster(cluster: EmbeddedCluster, namespace: str) -> None:
    from flightcache import BloomFilter

    fc = FlightCache(cluster.url, namespace=namespace)
    try:
        filters = [BloomFilter(fc, f"f{i}", capacity=1000, error_rate=0.01) for i in range(3)]
        for i, bf in enumerate(filters):  # names hash to different slots
            await bf.add_many([f"{i}:{n}" for n in range(100)])
        for i, bf in enumerate(filters):
            assert all(await bf.contains_many([f"{i}:{n}" for n in range(100)]))
            assert sum(await bf.contains_many([f"{i}:x{n}" for n in range(1000)])) < 50
    finally:
        await fc.aclose()
