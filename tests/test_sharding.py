"""Client-side sharding over standalone servers by a ketama-compatible hash ring."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from flightcache import ConfigError, EmbeddedServer, FlightCache, HashRing


@pytest.fixture
def shards() -> Iterator[list[EmbeddedServer]]:
    servers = [EmbeddedServer().start() for _ in range(3)]
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()


async def test_each_flight_lives_on_its_rings_server_and_owner_seq_on_the_first(
    shards: list[EmbeddedServer], namespace: str
) -> None:
    urls = [s.url for s in shards]
    caches = [FlightCache(urls, namespace=namespace) for _ in range(2)]
    runs: dict[str, int] = {}

    def loader_for(key: str) -> Any:
        async def load() -> str:
            runs[key] = runs.get(key, 0) + 1
            await asyncio.sleep(0.05)
            return key[::-1]

        return load

    clients = [aioredis.Redis.from_url(u) for u in urls]
    try:
        keys = [f"k{i}" for i in range(60)]
        results = await asyncio.gather(
            *(fc.do(k, loader_for(k)) for fc in caches for k in keys for _ in range(3))
        )
        assert results == [k[::-1] for _fc in caches for k in keys for _ in range(3)]
        assert runs == dict.fromkeys(keys, 1)
        ring = HashRing([f"127.0.0.1:{s.port}" for s in shards])
        for k in keys:
            fk = caches[0].keyspace.flight(k)
            home = ring.node_for(fk.digest)
            for server, client in zip(shards, clients, strict=True):
                here = bool(await client.exists(fk.result))
                assert here == (home == f"127.0.0.1:{server.port}"), (k, home)
        assert all([await c.dbsize() > 0 for c in clients])  # every shard holds some
        assert await clients[0].get(f"{namespace}:owner-seq") is not None
        for c in clients[1:]:
            assert await c.get(f"{namespace}:owner-seq") is None
        # Invalidation and streams work across shards too.
        assert await caches[1].get("k3") == "3k"
        assert (await caches[0].invalidate("k3")).how == "acked"
        assert await caches[1].get("k3") != "3k"

        async def produce() -> Any:
            for n in range(3):
                yield n

        assert [c async for c in caches[1].stream("s", produce)] == [0, 1, 2]
    finally:
        for c in clients:
            await c.aclose()
        for fc in caches:
            await fc.aclose()


def test_a_shard_list_must_name_standalone_servers_once() -> None:
    with pytest.raises(ConfigError, match="standalone"):
        FlightCache(["memory://"])
    with pytest.raises(ConfigError, match="twice"):
        FlightCache(["redis://127.0.0.1:7001/0", "redis://127.0.0.1:7001/0"])
    with pytest.raises(ConfigError):
        FlightCache([])
