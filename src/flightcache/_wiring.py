"""What a cache's URL builds: the parts one ``FlightCache`` talks to, and their lifecycle.

``memory://`` is one ``MemoryFlights``, this process alone. A server (``redis://``,
``rediss://``, ``unix://``, ``redis+cluster://``, a list of them, or the private server of
``embedded://`` once it has started) is its connections, the flights over them (spread by
the ring when there are several), fail-open in front of them, and this process's node in
the namespace: its liveness, its invalidation listener, its near cache and the leases on
the copies there. Which URL is which kind is ``_config.SCHEMES``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ._backends.redis import RedisConnection
from ._codec import Envelope
from ._config import Settings, Tuning, safe_url
from ._errors import BackendUnavailable
from ._keys import FlightKeys, KeySpace
from ._leases.near import Leaser, NearCache
from ._leases.nodes import NodeAgent, Replacer
from ._protocol.base import Flights
from ._protocol.failopen import FailOpen
from ._protocol.flight import RedisFlights
from ._protocol.memory import MemoryFlights
from ._protocol.sharded import ShardedFlights
from ._types import Stats

log = logging.getLogger("flightcache.near")


@dataclass(frozen=True, slots=True)
class Shared:
    """What every part of one cache shares."""

    settings: Settings
    keyspace: KeySpace
    envelope: Envelope
    stats: Stats
    node_id: str
    tuning: Tuning


@dataclass(eq=False)
class Parts:
    """The parts of one cache's backend."""

    flights: Flights  # the backend's own flights
    front: Flights  # what calls go through: fail-open in front of a server's flights
    replacer: Replacer  # what invalidate and set go through
    conns: list[RedisConnection] = field(default_factory=list)  # the designated one first
    failopen: FailOpen | None = None
    agent: NodeAgent | None = None
    near: NearCache | None = None
    leaser: Leaser | None = None
    opened: bool = False  # open() finished: the node is live and listening
    redis_flights: list[RedisFlights] = field(default_factory=list)  # one per server

    @property
    def designated(self) -> RedisConnection | None:
        """The server holding owner-seq, node liveness and the invalidation channel."""
        return self.conns[0] if self.conns else None

    async def open(self) -> None:
        for conn in self.conns:
            try:
                await conn.open()
            except BackendUnavailable as exc:  # calls fail open or raise, later
                log.info("could not connect yet: %s", exc)
        if self.agent is not None:
            await self.agent.start()  # live, and listening for invalidations
        self.opened = True

    async def ping(self) -> float:
        """One round trip to the designated server, in seconds (0 without a server)."""
        conn = self.designated
        if conn is None:
            return 0.0
        client = conn.client
        started = time.monotonic()
        await conn.run(lambda: client.ping())
        return time.monotonic() - started

    async def aclose(self) -> None:
        if self.agent is not None and self.opened:
            await self.agent.aclose()  # leaves the live set: invalidations stop waiting for it
        for flights in self.redis_flights:
            await flights.aclose()  # the lease renewer
        for conn in self.conns:
            await conn.aclose()


def memory_parts(shared: Shared) -> Parts:
    memory = MemoryFlights(shared.envelope, shared.stats, ttl_jitter=shared.tuning.ttl_jitter)
    return Parts(flights=memory, front=memory, replacer=memory)


def server_parts(shared: Shared, urls: list[str]) -> Parts:
    """One server, or several (sharded): the first is the designated one."""
    settings = shared.settings
    conns = [
        RedisConnection(
            url,
            stats=shared.stats,
            socket_timeout=settings.socket_timeout,
            max_connections=settings.max_connections,
            client_name=f"flightcache:{shared.node_id}".replace(" ", "_"),
        )
        for url in urls
    ]
    designated = conns[0]
    shards = [
        (
            conn,
            RedisFlights(
                conn,
                shared.keyspace,
                shared.envelope,
                shared.stats,
                shared.node_id,
                shared.tuning,
                seq_conn=designated,
                session_lease_s=settings.lease,
            ),
        )
        for conn in conns
    ]

    def fail_open(flights: Flights, url: str) -> FailOpen:
        return FailOpen(
            flights,
            shared.envelope,
            shared.stats,
            enabled=settings.fail_open,
            url=safe_url(url),
            local_ttl_s=settings.near_lease,
        )

    flights: Flights
    front: Flights
    failopen: FailOpen | None = None
    conn_for: Callable[[FlightKeys], RedisConnection] | None = None
    if len(shards) == 1:
        flights = shards[0][1]
        front = failopen = fail_open(flights, urls[0])
    else:  # each shard fails open on its own: one down server is not an outage of all
        sharded = ShardedFlights(
            [(conn, fail_open(f, url)) for (conn, f), url in zip(shards, urls, strict=True)]
        )
        flights = front = sharded
        conn_for = sharded.conn_for
    near = None
    if settings.near_cache:
        near = NearCache(max_entries=settings.near_max_entries, max_bytes=settings.near_max_bytes)
    agent = NodeAgent(
        designated,
        shared.keyspace,
        shared.node_id,
        near,
        near_lease_s=settings.near_lease,
        skew_margin_s=settings.skew_margin,
        node_ttl_s=settings.node_ttl,
        owned=lambda: shared.stats.owning,
        conn_for=conn_for,
    )
    leaser = None
    if near is not None:
        leaser = Leaser(
            near,
            lease_s=settings.near_lease,
            skew_margin_s=settings.skew_margin,
            heard=lambda: agent.seq,
            live_until=lambda: agent.live_until,
        )
    parts = Parts(flights, front, agent, conns, failopen, agent, near, leaser)
    parts.redis_flights = [f for _, f in shards]
    return parts


def parts_for(shared: Shared) -> Parts | None:
    """The parts the settings' URL names; None for ``embedded://``, whose parts are
    :func:`server_parts` of its private server once that has started."""
    if shared.settings.servers:
        return server_parts(shared, list(shared.settings.servers))
    if shared.settings.scheme.kind == "memory":
        return memory_parts(shared)
    return None
