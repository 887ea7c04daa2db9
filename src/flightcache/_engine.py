"""The engine under ``FlightCache``: its settings, lifecycle and parts, and the private
steps its public calls share (docs/README.md).

A façade: it checks each call's arguments and hands the work to the rooms that own it.
``_config.py`` checks the settings; ``_wiring.py`` builds the parts the URL names (its
scheme is looked up in ``_config.SCHEMES``); ``_protocol/local.py`` runs this process's
single-flight tables, flights and streams over the backend's ``Flights``; ``_leases/``
keeps near-cache leases, node liveness and invalidations; ``_protections/`` refresh-ahead
and Bloom filters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import socket
from collections.abc import Sequence
from typing import Any, ParamSpec, TypeVar

from ._backends.embedded import EmbeddedServer
from ._backends.redis import RedisConnection
from ._codec import Codec, Envelope
from ._config import Settings, Tuning
from ._errors import FlightError
from ._keys import FlightKeys, KeySpace, canonical, digest_of
from ._leases.near import NearCache
from ._leases.nodes import NodeAgent
from ._protections.ahead import RefreshAhead
from ._protocol.base import Flights
from ._protocol.context import FlightContext, invoke, wants_context
from ._protocol.failopen import FailOpen
from ._protocol.jobs import LoaderJob
from ._protocol.local import LocalFlights
from ._protocol.tags import MemoryTags, RedisTags, TagGate
from ._types import (
    NOT_FOUND,
    CacheState,
    CallOptions,
    Invalidation,
    Loader,
    Stats,
)
from ._wiring import Parts, Shared, parts_for, server_parts
from .telemetry import Telemetry, attach, watch

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("flightcache.near")

DIGEST_MEMO = 10_000  # string keys whose digests are remembered


class Engine:
    """What a ``FlightCache`` is made of: settings checked once, the parts its URL builds
    (opened on first use, closed once), this process's single-flight tables, and the steps
    several public calls share. The public calls and their argument checks are
    ``FlightCache``'s (``_cache.py``)."""

    def __init__(
        self,
        url: str | Sequence[str] = "embedded://",
        *,
        namespace: str = "flightcache",
        ttl: float = 3600.0,
        lease: float = 3.0,
        timeout: float = 60.0,
        error_ttl: float = 1.0,
        max_value_bytes: int = 8 * 1024 * 1024,
        codec: str | Codec = "json",
        socket_timeout: float = 10.0,
        max_connections: int = 64,
        near_cache: bool = True,
        near_lease: float = 5.0,
        near_max_entries: int = 10_000,
        near_max_bytes: int = 64 * 1024 * 1024,
        skew_margin: float = 0.25,
        node_ttl: float = 6.0,
        cluster: bool = False,
        fail_open: bool = True,
        not_found_ttl: float = 60.0,
        tuning: Tuning | None = None,
    ) -> None:
        settings = Settings.from_args(
            url,
            namespace=namespace,
            ttl=ttl,
            lease=lease,
            timeout=timeout,
            error_ttl=error_ttl,
            max_value_bytes=max_value_bytes,
            codec=codec,
            socket_timeout=socket_timeout,
            max_connections=max_connections,
            near_cache=near_cache,
            near_lease=near_lease,
            near_max_entries=near_max_entries,
            near_max_bytes=near_max_bytes,
            skew_margin=skew_margin,
            node_ttl=node_ttl,
            cluster=cluster,
            fail_open=fail_open,
            not_found_ttl=not_found_ttl,
            tuning=tuning,
        )
        self._settings = settings
        self.url = settings.url
        self.namespace = settings.namespace
        self.keyspace = KeySpace(settings.namespace)
        self.ttl = settings.ttl
        self.lease = settings.lease
        self.timeout = settings.timeout
        self.error_ttl = settings.error_ttl
        self.not_found_ttl = settings.not_found_ttl
        self.envelope = Envelope(settings.codec, settings.max_value_bytes)
        self.skew_margin = settings.skew_margin
        self.near_lease = settings.near_lease
        self.node_ttl = settings.node_ttl
        self.node_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._stats = Stats()
        self._traced: Telemetry | None = None  # _tel, once it has a tracer (telemetry.py)
        self._tel: Telemetry | None = attach(self)  # spans and metrics
        self._shared = Shared(
            settings, self.keyspace, self.envelope, self._stats, self.node_id, tuning or Tuning()
        )
        self._state = CacheState.UNOPENED
        self._start_lock = asyncio.Lock()
        self._ahead = RefreshAhead()
        self._local = LocalFlights(self._stats, self.envelope, self._ready, self._ahead)
        self._digests: dict[str, str] = {}
        self._warned_ttls: set[int] = set()
        self._disabled = 0  # disabled() blocks open: caching is off while > 0
        self._server: EmbeddedServer | None = None  # embedded://, once started
        self._parts: Parts | None = None
        # The parts' pieces this façade (and tests) use directly; set by _use().
        self._front: Flights | None = None  # what calls go through
        self._flights: Flights | None = None
        self._failopen: FailOpen | None = None
        self._conn: RedisConnection | None = None  # the designated server
        self._near: NearCache | None = None
        self._agent: NodeAgent | None = None
        parts = parts_for(self._shared)  # embedded://: none until its server has started
        if parts is not None:
            self._use(parts)

    @property
    def _closed(self) -> bool:
        return self._state is CacheState.CLOSED

    def _use(self, parts: Parts) -> None:
        self._parts = parts
        self._front, self._flights, self._failopen = parts.front, parts.flights, parts.failopen
        self._conn, self._near, self._agent = parts.designated, parts.near, parts.agent
        self._local.leases = parts.leaser
        self._local.tags = (
            RedisTags(parts.designated, self.keyspace, fail_open=self._settings.fail_open)
            if parts.designated is not None
            else MemoryTags()
        )

    async def _ready(self) -> Flights:
        """What calls go through, once connected (an embedded server started first)."""
        if self._state is CacheState.OPENED:
            assert self._front is not None
            return self._front
        if self._closed:
            raise FlightError("this FlightCache is closed")
        async with self._start_lock:
            if self._parts is None and self._state is CacheState.UNOPENED:  # embedded://
                server = EmbeddedServer()
                await asyncio.to_thread(server.start)
                if self._closed:  # nobody else will stop it
                    await asyncio.to_thread(server.stop)
                else:
                    self._server = server
                    self._use(server_parts(self._shared, [server.url]))
            if self._state is CacheState.UNOPENED and self._parts is not None:
                await self._parts.open()
                if self._state is CacheState.UNOPENED:  # else aclose() waits to undo it
                    self._state = CacheState.OPENED
                    watch(self)  # for a tracer provider the app configures later
        if self._state is not CacheState.OPENED or self._front is None:
            raise FlightError("this FlightCache is closed")
        return self._front

    async def _designated(self) -> RedisConnection | None:
        """The designated server, once connected; None for ``memory://`` (BloomFilter)."""
        await self._ready()
        return self._conn

    @property
    def _inflight(self) -> dict[str, Any]:  # tests look into the single-flight table
        return self._local.slots

    @property
    def _tasks(self) -> set[asyncio.Task[Any]]:
        return self._local.tasks

    # -- public API ----------------------------------------------------------------------

    @property
    def stats(self) -> dict[str, int]:
        """Counters since this cache was made (hits, misses, loader runs, takeovers, ...)."""
        return self._stats.snapshot()

    @property
    def server_url(self) -> str | None:
        """The URL of the private server of an ``embedded://`` cache, once started."""
        return self._server.url if self._server else None

    def _options(
        self,
        canon: bytes,
        ttl: float | None,
        lease: float | None,
        timeout: float | None,
        refresh: bool = False,
        store: bool = True,
    ) -> CallOptions:
        ttl_s = self.ttl if ttl is None else ttl
        if self._near is not None and store and ttl_s < self.near_lease:
            self._warn_short_ttl(ttl_s)
        return self._settings.call_options(canon, ttl, lease, timeout, refresh, store)

    def _digest(self, key: Any) -> str:
        """The key's digest; remembered for string keys, the hot path's common case."""
        if type(key) is str:
            digest = self._digests.get(key)
            if digest is None:
                if len(self._digests) >= DIGEST_MEMO:
                    self._digests.clear()
                digest = self._digests[key] = digest_of(canonical(key))
            return digest
        return digest_of(canonical(key))

    def _warn_short_ttl(self, ttl_s: float) -> None:
        if int(ttl_s * 1000) not in self._warned_ttls and len(self._warned_ttls) < 100:
            self._warned_ttls.add(int(ttl_s * 1000))
            log.warning(
                "ttl %gs is shorter than near_lease %gs: near-cache leases of these values "
                "are clamped to the time each has left on the server",
                ttl_s,
                self.near_lease,
            )

    def _gate(self) -> TagGate:
        """Where tags' versions are read (set once the cache is connected)."""
        gate = self._local.tags
        assert gate is not None
        return gate

    async def _uncached(self, loader: Loader, not_found: tuple[type[BaseException], ...]) -> Any:
        """``do`` under ``disabled()``: the loader's value, through the codec as every
        caller of a flight gets it (a value the codec cannot take fails here too)."""
        self._stats.calls += 1
        self._stats.loader_runs += 1
        context = FlightContext(None, "", 0, 1) if wants_context(loader) else None
        try:
            value = await invoke(loader, context)
        except not_found:
            return NOT_FOUND
        if value is NOT_FOUND:
            return NOT_FOUND
        return self.envelope.decode(self.envelope.encode(value))

    def _maybe_refresh(
        self,
        fk: FlightKeys,
        key: Any,
        loader: Loader,
        beta: bool | float,
        ttl: float | None,
        lease: float | None,
        timeout: float | None,
        tags: tuple[str, ...] = (),
    ) -> None:
        left_ms = self._ahead.due(fk.digest, 1.0 if beta is True else float(beta))
        if left_ms is None or self._closed:
            return
        opts = self._options(canonical(key), ttl, lease, timeout, refresh=True)
        # Skip the work if, by the time the join runs, someone else refreshed the value.
        margin_ms = max(50, opts.ttl_ms // 10)
        opts = dataclasses.replace(opts, refresh_below_ms=left_ms + margin_ms)
        job = LoaderJob(
            loader, self.envelope, fk.digest, key=key, with_context=wants_context(loader)
        )
        if tags:
            job.tag(tags, self._gate())
        self._local.refresh(fk, job, opts)

    async def _replace(
        self, fk: FlightKeys, data: bytes | None, ttl_ms: int, if_token: int | None = None
    ) -> Invalidation:
        await self._ready()
        assert self._parts is not None
        if if_token is not None:  # a Cluster's claim confirmed beside its loader: wait for it
            for flights in self._parts.redis_flights:
                await flights.confirmed(if_token)
        return await self._parts.replacer.replace(fk, data, ttl_ms, if_token)
