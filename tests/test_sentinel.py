"""Redis Sentinel: ``redis+sentinel://`` on a real topology (a master, a replica and three
sentinels, all private processes on loopback), a failover by SIGKILL, and the URL's errors."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from flightcache import BackendUnavailable, ConfigError, FlightCache
from flightcache._backends.embedded import EmbeddedSentinel, free_port
from flightcache._backends.sentinel import parse_sentinel_url
from flightcache._config import safe_url
from flightcache._keys import KeySpace

from .helpers.flights import wait_until
from .helpers.procs import Fleet, markers, wait_for

pytestmark = pytest.mark.timeout(60)

PASSWORD = "server-s3cret"
SENTINEL_PASSWORD = "sentinel-s3cret"


@pytest.fixture(scope="module")
def topology() -> Iterator[EmbeddedSentinel]:
    """One topology for the module's tests that kill nothing; servers and sentinels each
    want their own password, so both kinds of authentication are exercised."""
    with EmbeddedSentinel(password=PASSWORD, sentinel_password=SENTINEL_PASSWORD) as topo:
        yield topo


def test_a_stampede_through_sentinel_runs_the_loader_once(
    topology: EmbeddedSentinel, namespace: str, tmp_path: Path
) -> None:
    """4 processes x 25 callers through the sentinel URL: one loader run, and the other
    three processes followed it while it ran (held by a gate until they all did)."""
    gate = tmp_path / "gate"
    cfg = {
        "url": topology.url,
        "namespace": namespace,
        "key": "the-question",
        "markers": str(tmp_path),
        "callers": 25,
        "loader_s": 0.2,
        "gate": str(gate),
        "start_at": time.monotonic() + 2.0,
    }
    master = topology.master()
    admin = redis.Redis(host=master.host, port=master.port, password=PASSWORD)
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
    assert len(results) == 100 and all("pid" in r for r in results), results[:3]
    assert len({r["pid"] for r in results}) == 1
    assert len(markers(tmp_path, "start")) == 1
    stats = [rep["stats"] for rep in reports if rep]
    assert sorted(s["loader_runs"] for s in stats) == [0, 0, 0, 1]
    for s in stats:
        assert s["hits"] == 0 and s["fail_open"] == 0, s
        assert s["follows"] == (0 if s["loader_runs"] else 1), s


async def test_killing_the_master_mid_flight_gives_every_caller_one_value(
    namespace: str, tmp_path: Path
) -> None:
    """The master is SIGKILLed 0.5 s into a 4 s loader that 3 processes x 10 callers share.
    The sentinels promote the replica; every caller gets the one value from the one loader
    run (the lease outlasts the failover, so the owner renews it on the new master), the
    flight's result is read back from the new master, and a cache that lived through the
    failover hears invalidations again (its listener followed the master)."""
    topo = await asyncio.to_thread(EmbeddedSentinel().start)
    key = "the-question"
    kw: dict[str, Any] = dict(namespace=namespace, fail_open=False)
    a, b = FlightCache(topo.url, **kw), FlightCache(topo.url, **kw)
    try:
        await a.set("note", "old")
        assert await b.get("note") == "old"  # b leases it in its near cache
        cfg = {
            "url": topo.url,
            "namespace": namespace,
            "key": key,
            "markers": str(tmp_path),
            "callers": 10,
            "loader_s": 4.0,
            # Outlasts the failover (about 2.3 s) by seconds: the owner renews it on the new
            # master. (With a lease of 1-3 s the owner loses it during the outage and runs
            # the loader again: still one value, two runs.)
            "lease": 8.0,
            "start_at": time.monotonic() + 1.5,
        }
        old = topo.master_address()
        with Fleet() as fleet:
            workers = [fleet.start(f"w{i}", **cfg) for i in range(3)]
            await wait_until(lambda: markers(tmp_path, "start"), 20, "the loader to start")
            await asyncio.sleep(0.5)
            master = topo.master()
            os.kill(master.pid, signal.SIGKILL)
            killed = time.monotonic()
            failover = await asyncio.to_thread(topo.wait_for_new_master, old)
            reports = await asyncio.to_thread(lambda: [w.wait(60) for w in workers])
        results = [r for rep in reports if rep for r in rep["results"]]
        assert len(results) == 30
        errors = [r for r in results if "pid" not in r]
        assert not errors, errors[:3]
        pids = {r["pid"] for r in results}
        assert len(pids) == 1
        answered = max(r["t1"] for r in results) - killed
        runs = sum(rep["stats"]["loader_runs"] for rep in reports if rep)
        assert runs == 1, [rep["stats"] for rep in reports if rep]
        print(f"failover {failover:.2f} s; answered {answered:.2f} s after the kill; {runs} run")
        assert answered < 30

        assert topo.master_address() == (topo.servers[1].host, topo.servers[1].port)
        reader = FlightCache(topo.url, namespace=namespace, near_cache=False)
        try:
            assert (await reader.get(key))["pid"] in pids  # stored on the new master
        finally:
            await reader.aclose()

        conn = b._conn
        assert conn is not None
        await wait_until(lambda: conn.listener.subscribed, 15, "b's listener to come back")
        invalidation = await a.invalidate("note")
        assert invalidation.how == "acked" and invalidation.acked >= 1, invalidation
        assert await b.get("note") != "old"
    finally:
        await a.aclose()
        await b.aclose()
        await asyncio.to_thread(topo.stop)


@pytest.mark.parametrize(
    "url,why",
    [
        ("redis+sentinel://:pw-x@127.0.0.1:26379", "no service name"),
        ("redis+sentinel://:pw-x@127.0.0.1:26379/", "no service name"),
        ("redis+sentinel://:pw-x@/svc", "no sentinel addresses"),
        ("redis+sentinel://:pw-x@127.0.0.1:1,/svc", "without a host"),
        ("redis+sentinel://:pw-x@127.0.0.1:port/svc", "must be 1-65535"),
        ("redis+sentinel://:pw-x@127.0.0.1:99999/svc", "must be 1-65535"),
        ("redis+sentinel://:pw-x@127.0.0.1/svc/zero", "the db must be a number"),
        ("redis+sentinel://:pw-x@127.0.0.1/svc/0/more", "/<service>/<db>"),
        ("redis+sentinel://:pw-x@127.0.0.1/svc?db=1", "in the path"),
        ("redis+sentinel://:pw-x@127.0.0.1/svc?colour=blue", "unknown option 'colour'"),
        ("redis+sentinel://:pw-x@127.0.0.1/svc?ssl_ca_certs=/ca.pem", "rediss+sentinel"),
        ("redis+sentinel://:pw-x@127.0.0.1/svc?socket_timeout=soon", "socket_timeout"),
        ("redis+sentinel://127.0.0.1/svc?sentinel_password=pw-x&colour=1", "colour"),
    ],
)
def test_a_bad_sentinel_url_is_a_config_error_without_the_password(url: str, why: str) -> None:
    with pytest.raises(ConfigError, match="bad Redis Sentinel URL") as info:
        FlightCache(url)
    assert why in str(info.value)
    assert "pw-x" not in str(info.value)


def test_sentinel_urls_are_not_sharded_and_not_a_cluster() -> None:
    url = "redis+sentinel://127.0.0.1:26379/svc"
    with pytest.raises(ConfigError, match="list of URLs"):
        FlightCache([url, url])
    with pytest.raises(ConfigError, match="cluster=True"):
        FlightCache(url, cluster=True)


def test_what_a_sentinel_url_says() -> None:
    """Hosts (port 26379 by default, IPv6 in brackets), service, db; the password is the
    servers', ``sentinel_password`` the sentinels'; ``rediss+sentinel://`` is TLS to both,
    with the same ``ssl_*`` options; the listener's URL of a master carries the servers'
    password, db and options but nothing meant for the sentinels."""
    parsed = parse_sentinel_url(
        "redis+sentinel://u:p%40ss@10.0.0.1,10.0.0.2:26380,[::1]:5000/my-svc/3"
        "?sentinel_password=sp&socket_connect_timeout=2"
    )
    assert parsed.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26380), ("::1", 5000))
    assert (parsed.service, parsed.db, parsed.tls) == ("my-svc", 3, False)
    assert parsed.server["username"] == "u" and parsed.server["password"] == "p@ss"
    assert parsed.server["db"] == 3 and parsed.server["socket_connect_timeout"] == 2.0
    assert parsed.sentinel == {"password": "sp"}
    assert parsed.server_url("10.0.0.9", 6379) == (
        "redis://u:p%40ss@10.0.0.9:6379/3?socket_connect_timeout=2"
    )

    tls = parse_sentinel_url(
        "rediss+sentinel://:pw@h1:1,h2:2/svc?ssl_ca_certs=/ca.pem&ssl_cert_reqs=required"
    )
    assert tls.tls and tls.server["ssl"] and tls.server["ssl_ca_certs"] == "/ca.pem"
    assert tls.sentinel == {"ssl": True, "ssl_ca_certs": "/ca.pem", "ssl_cert_reqs": "required"}
    assert tls.server_url("::2", 7000).startswith("rediss://:pw@[::2]:7000/0?ssl_ca_certs=")

    shown = safe_url("rediss+sentinel://u:pw@h1:1,h2:2/svc?sentinel_password=spw")
    assert shown == "rediss+sentinel://u:***@h1:1,h2:2/svc?sentinel_password=***"


async def test_unreachable_sentinels_are_backend_unavailable_without_the_passwords(
    make_cache: Any,
) -> None:
    """Nothing listens where the URL says the sentinels are: calls fail fast with
    BackendUnavailable (no retries against a refused sentinel), naming the URL with both
    passwords masked, and repr shows neither."""
    ports = [free_port(), free_port()]
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    fc = make_cache(
        f"redis+sentinel://:s3cret-pw@{hosts}/svc/0?sentinel_password=s3cret-spw",
        fail_open=False,
    )

    async def loader() -> str:
        return "v"

    t0 = time.monotonic()
    with pytest.raises(BackendUnavailable) as info:
        await fc.get("q")
    assert time.monotonic() - t0 < 5
    with pytest.raises(BackendUnavailable) as info_do:
        await fc.do("q", loader)
    for text in (str(info.value), str(info_do.value), repr(fc)):
        assert "s3cret" not in text, text
    assert f"127.0.0.1:{ports[0]}" in str(info.value) and "No master found" in str(info.value)
