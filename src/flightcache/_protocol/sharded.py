"""Client-side sharding over a list of standalone servers, by a consistent-hash ring.

Each flight lives on one server, the one the ring (ketama-compatible, so other clients
agree) assigns to its digest: all its keys share that server, so its scripts run there
unchanged. ``owner-seq``, node liveness and the invalidation channel live on the first
server of the list, the designated one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from .._backends.redis import RedisConnection
from .._backends.ring import HashRing
from .._errors import ConfigError, FlightError
from .._keys import FlightKeys
from .._types import CallOptions, FlightInfo
from .base import Flights, Opening
from .jobs import Job


def shard_name(url: str) -> str:
    """The ring's name for a server: ``host:port`` (what ketama clients hash), or the
    socket path of a ``unix://`` URL."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return parts.path
    try:
        port = parts.port or 6379
    except ValueError as exc:
        raise ConfigError(f"bad port in a shard URL: {exc}") from exc
    return f"{parts.hostname}:{port}"


class ShardedFlights:
    """The flight protocol over several servers: each key goes to its ring's server."""

    def __init__(self, shards: list[tuple[RedisConnection, Flights]]) -> None:
        names = [shard_name(conn.url) for conn, _ in shards]
        if len(set(names)) != len(names):
            raise ConfigError(f"the shard list names a server twice: {names}")
        self.ring = HashRing(names)
        self._by_name = {name: pair for name, pair in zip(names, shards, strict=True)}
        self.shards = shards

    def conn_for(self, fk: FlightKeys) -> RedisConnection:
        return self._by_name[self.ring.node_for(fk.digest)][0]

    def _flights(self, fk: FlightKeys) -> Flights:
        return self._by_digest(fk.digest)

    def _by_digest(self, digest: str) -> Flights:
        return self._by_name[self.ring.node_for(digest)][1]

    async def lookup(self, fk: FlightKeys) -> bytes | None:
        return await self._flights(fk).lookup(fk)

    async def lookup_full(self, fk: FlightKeys) -> tuple[bytes | None, int, bool, int]:
        return await self._flights(fk).lookup_full(fk)

    def prepare(self, fk: FlightKeys) -> Any:
        return self._flights(fk).prepare(fk)

    async def begin(self, fk: FlightKeys, opts: CallOptions, handle: Any) -> Opening:
        return await self._flights(fk).begin(fk, opts, handle)

    async def begin_many(
        self, fks: Sequence[FlightKeys], opts: Sequence[CallOptions], handles: Sequence[Any]
    ) -> list[Opening | FlightError]:
        """Each server's keys sent together, the servers at once."""
        groups: dict[str, list[int]] = {}
        for i, fk in enumerate(fks):
            groups.setdefault(self.ring.node_for(fk.digest), []).append(i)

        async def one(name: str, at: list[int]) -> list[Opening | FlightError]:
            flights = self._by_name[name][1]
            return await flights.begin_many(
                [fks[i] for i in at], [opts[i] for i in at], [handles[i] for i in at]
            )

        answers = await asyncio.gather(*(one(name, at) for name, at in groups.items()))
        out: list[Opening | FlightError | None] = [None] * len(fks)
        for at, openings in zip(groups.values(), answers, strict=True):
            for i, opening in zip(at, openings, strict=True):
                out[i] = opening
        return [o for o in out if o is not None]

    async def abandon(self, fk: FlightKeys, opts: CallOptions, handle: Any) -> None:
        await self._flights(fk).abandon(fk, opts, handle)

    def release(self, handle: Any) -> None:
        if handle is not None:
            self._by_digest(handle.digest).release(handle)

    async def resolve(
        self, fk: FlightKeys, job: Job, opts: CallOptions, handle: Any = None
    ) -> bytes:
        return await self._flights(fk).resolve(fk, job, opts, handle)

    async def inspect(self, fk: FlightKeys) -> FlightInfo:
        return await self._flights(fk).inspect(fk)
