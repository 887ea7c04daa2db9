"""Fixtures: private Redis/Valkey servers from the bundled binary, and caches that close.

Set FLIGHTCACHE_SERVER_BIN to another server binary (a Debian ``redis-server``, say) to run
the same suite against Redis instead of Valkey.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from flightcache import EmbeddedServer, FlightCache


@pytest.fixture(scope="session")
def server() -> Iterator[EmbeddedServer]:
    """One private server for the session; tests keep apart by namespace."""
    with EmbeddedServer() as srv:
        yield srv


@pytest.fixture
def private_server() -> Iterator[EmbeddedServer]:
    """A server of this test's own, for tests that count commands or kill things."""
    with EmbeddedServer() as srv:
        yield srv


@pytest.fixture
def namespace() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
async def redis_client(server: EmbeddedServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(server.url)
    yield client
    await client.aclose()


@pytest.fixture
async def make_cache(
    server: EmbeddedServer, namespace: str
) -> AsyncIterator[Callable[..., FlightCache]]:
    """Factory of FlightCache objects on the session server; each is closed after the test."""
    made: list[FlightCache] = []

    def make(url: str | None = None, **kw: Any) -> FlightCache:
        kw.setdefault("namespace", namespace)
        fc = FlightCache(url or server.url, **kw)
        made.append(fc)
        return fc

    yield make
    for fc in made:
        await fc.aclose()


@pytest.fixture(params=["memory", "redis", "cluster"])
def backend_url(request: pytest.FixtureRequest, server: EmbeddedServer) -> str:
    """Behaviour that must hold on every backend runs once per backend: this process only,
    one server, and a Redis/Valkey Cluster (3 masters with a replica each)."""
    if request.param == "memory":
        return "memory://"
    if request.param == "cluster":
        return str(request.getfixturevalue("cluster").url)
    return server.url


@pytest.fixture(scope="session")
def cluster() -> Iterator[Any]:
    """A private Redis/Valkey Cluster (3 masters, 1 replica each) for the session."""
    from flightcache._backends.embedded import EmbeddedCluster

    with EmbeddedCluster(masters=3, replicas=1) as c:
        yield c
