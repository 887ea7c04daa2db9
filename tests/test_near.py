"""The lease-based near cache, invalidation with acknowledgements, and node liveness."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from flightcache import MISSING, EmbeddedServer, FlightCache

from .helpers.procs import SRC
from .helpers.proxy import CuttableProxy

NEAR_WORKER = Path(__file__).parent / "helpers" / "near_worker.py"


class Holder:
    """A near_worker process: a node that reads keys on request."""

    def __init__(self, url: str, namespace: str, **cfg: Any) -> None:
        env = dict(os.environ, PYTHONPATH=str(SRC))
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(NEAR_WORKER),
                json.dumps({"url": url, "namespace": namespace, **cfg}),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        line = self._line(20)
        assert line.startswith("ready "), line
        self.node_id = line.split()[1]

    def _line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        # The worker answers each request with one line; a bounded wait for it.
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while time.monotonic() < deadline:
                if sel.select(timeout=deadline - time.monotonic()):
                    return self.proc.stdout.readline().strip()
        finally:
            sel.close()
        raise AssertionError(f"worker {self.proc.pid} did not answer in {timeout} s")

    def read(self, key: str, timeout: float = 15) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"read {key}\n")
        self.proc.stdin.flush()
        return json.loads(self._line(timeout))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=10)


@contextmanager
def holders(n: int, url: str, namespace: str, **cfg: Any) -> Iterator[list[Holder]]:
    made: list[Holder] = []
    try:
        for _ in range(n):
            made.append(Holder(url, namespace, **cfg))
        yield made
    finally:
        for h in made:
            if h.proc.poll() is None:
                os.kill(h.proc.pid, signal.SIGCONT)
            h.close()


async def test_a_leased_value_is_served_without_a_round_trip_until_its_lease_ends(
    make_cache: Any,
) -> None:
    fc = make_cache(near_lease=0.5, skew_margin=0.05)
    runs: list[int] = []

    async def loader() -> str:
        runs.append(1)
        return "v"

    assert await fc.do("k", loader) == "v"
    before = fc.stats["commands"]
    for _ in range(200):
        assert await fc.do("k", loader) == "v"
        assert await fc.get("k") == "v"
    assert fc.stats["commands"] == before  # 400 answers, no command
    await asyncio.sleep(0.5)  # past lease - skew
    assert await fc.do("k", loader) == "v"
    assert fc.stats["commands"] == before + 1  # one read, which leases it again
    assert len(runs) == 1


async def test_a_lease_never_outlives_the_value_and_a_short_ttl_warns(
    make_cache: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fc = make_cache(near_lease=5.0)
    runs: list[int] = []

    async def loader() -> int:
        runs.append(1)
        return len(runs)

    with caplog.at_level(logging.WARNING, logger="flightcache.near"):
        assert await fc.do("k", loader, ttl=0.3) == 1
        assert await fc.do("k", loader, ttl=0.3) == 1
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "shorter than near_lease" in caplog.records[0].message
    await asyncio.sleep(0.45)  # the value expired on the server (ttl + jitter)
    assert await fc.do("k", loader, ttl=0.3) == 2  # not the leased copy: it ended with it


@pytest.mark.timeout(60)
async def test_invalidate_makes_every_holder_drop_the_old_value_by_acknowledgement(
    server: EmbeddedServer, namespace: str
) -> None:
    fc = FlightCache(server.url, namespace=namespace, near_lease=5.0)
    try:
        await fc.set("k", "old")
        with holders(3, server.url, namespace, near_lease=5.0) as hs:
            for h in hs:
                assert h.read("k")["value"] == "old"
                again = h.read("k")
                assert again["value"] == "old" and again["commands"] == 0  # leased
            t0 = time.monotonic()
            result = await fc.invalidate("k")
            took = time.monotonic() - t0
            assert result.how == "acked" and result.nodes == 3 and result.acked == 3
            assert took < 1.0  # well under the 5 s lease
            for h in hs:
                probe = h.read("k")
                assert probe["value"] != "old", probe
    finally:
        await fc.aclose()


@pytest.mark.timeout(60)
async def test_a_paused_holder_makes_invalidate_wait_out_the_lease(
    server: EmbeddedServer, namespace: str
) -> None:
    lease, skew = 1.5, 0.25
    fc = FlightCache(server.url, namespace=namespace, near_lease=lease, skew_margin=skew)
    try:
        await fc.set("k", "old")
        with holders(2, server.url, namespace, near_lease=lease, skew_margin=skew) as hs:
            for h in hs:
                assert h.read("k")["value"] == "old"
            os.kill(hs[0].proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                result = await fc.invalidate("k")
                took = time.monotonic() - t0
            finally:
                os.kill(hs[0].proc.pid, signal.SIGCONT)
            assert result.how == "lease" and result.nodes == 2 and result.acked == 1
            assert lease + skew - 0.05 <= took <= lease + skew + 1.0
            assert hs[0].read("k")["value"] != "old"  # its lease ran out while it slept
            assert hs[1].read("k")["value"] != "old"
    finally:
        await fc.aclose()


@pytest.mark.timeout(60)
async def test_a_holder_cut_off_from_the_server_stops_serving_by_its_lease_end(
    server: EmbeddedServer, namespace: str
) -> None:
    lease = 1.5
    proxy = CuttableProxy("127.0.0.1", server.port).start()
    fc = FlightCache(server.url, namespace=namespace, near_lease=lease)
    try:
        await fc.set("k", "old")
        with holders(
            1, f"redis://127.0.0.1:{proxy.port}/0", namespace, near_lease=lease, socket_timeout=1.0
        ) as (h,):
            first = h.read("k")
            assert first["value"] == "old"
            proxy.cut()
            await fc.invalidate("k")
            remaining = first["t"] + lease - time.monotonic()
            if remaining > 0:
                await asyncio.sleep(remaining)
            probe = h.read("k")
            assert probe.get("value") != "old", probe  # an error, never the old value
    finally:
        await fc.aclose()
        proxy.close()


@pytest.mark.timeout(60)
async def test_a_killed_node_leaves_the_live_set_within_its_ttl_and_one_heartbeat(
    server: EmbeddedServer, namespace: str
) -> None:
    node_ttl = 1.2
    fc = FlightCache(server.url, namespace=namespace)
    try:
        with holders(1, server.url, namespace, node_ttl=node_ttl) as (h,):
            assert h.node_id in {n.node_id for n in await fc.nodes()}
            os.kill(h.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            while h.node_id in {n.node_id for n in await fc.nodes()}:
                assert time.monotonic() - killed < 10
                await asyncio.sleep(0.05)
            gone = time.monotonic() - killed
            assert gone <= node_ttl + node_ttl / 3 + 0.3, gone
    finally:
        await fc.aclose()


async def test_nodes_report_themselves_and_a_closed_cache_leaves_at_once(
    make_cache: Any,
) -> None:
    a, b = make_cache(), make_cache(near_cache=False)
    await a.get("x")
    await b.get("x")
    live = {n.node_id: n for n in await a.nodes()}
    assert {a.node_id, b.node_id} <= set(live)
    assert live[a.node_id].lease_ms == 5000 and live[b.node_id].lease_ms == 0
    assert live[a.node_id].pid == os.getpid()
    await b.aclose()
    assert b.node_id not in {n.node_id for n in await a.nodes()}


async def test_invalidating_an_unknown_key_is_a_no_op(backend_url: str, make_cache: Any) -> None:
    fc = make_cache(backend_url)
    result = await fc.invalidate("never-stored")
    assert result.how == "absent" and result.waited_s < 1.0
    assert [r.how for r in await fc.invalidate_many(["a", "b"])] == ["absent", "absent"]


async def test_set_replaces_the_value_in_every_near_cache(make_cache: Any) -> None:
    a, b = make_cache(), make_cache()

    async def never() -> str:
        raise AssertionError("the loader must not run")

    await a.set("k", "old", ttl=60)
    assert await b.do("k", never) == "old"
    result = await a.set("k", "new", ttl=60)
    assert result.how == "acked"
    assert await b.do("k", never) == "new"
    assert await b.get("k") == "new"


async def test_reads_during_an_invalidation_are_served_but_not_leased(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    fc = make_cache()
    await fc.set("k", "v")
    fk = fc.keyspace.flight("k")
    await redis_client.set(fk.marker, "someone-invalidating", px=2000)
    other = make_cache()
    assert await other.get("k") == "v"
    assert await other.get("k") == "v"
    assert len(other._near) == 0 and other.stats["commands"] >= 2  # served, never leased
    await redis_client.delete(fk.marker)
    assert await other.get("k") == "v"
    assert len(other._near) == 1


async def test_a_value_computed_during_an_invalidation_is_delivered_but_not_stored(
    make_cache: Any,
) -> None:
    owner = make_cache()
    gate = asyncio.Event()

    async def slow() -> str:
        await gate.wait()
        return "computed from stale inputs"

    task = asyncio.ensure_future(owner.do("k", slow))
    await asyncio.sleep(0.1)
    assert (await owner.invalidate("k")).how == "absent"  # nothing stored yet...
    gate.set()
    assert await task == "computed from stale inputs"  # ...the callers get their answer
    reader = make_cache(near_cache=False)
    assert await reader.get("k") is MISSING  # but it was not stored
    assert await owner.get("k") is MISSING  # nor leased


async def test_the_status_command_lists_live_nodes(server: EmbeddedServer, namespace: str) -> None:
    fc = FlightCache(server.url, namespace=namespace)
    try:
        await fc.get("x")
        out = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "flightcache",
                "status",
                "--redis",
                server.url,
                "--namespace",
                namespace,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        assert "live nodes  1" in out.stdout
        assert fc.node_id in out.stdout
    finally:
        await fc.aclose()


async def test_set_and_invalidate_in_one_process(make_cache: Any) -> None:
    fc = make_cache("memory://")
    assert (await fc.set("k", "v")).how == "acked"
    assert await fc.get("k") == "v"
    assert (await fc.invalidate("k")).how == "acked"
    assert await fc.get("k") is MISSING
