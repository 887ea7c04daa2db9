"""``FlightCache``: the public face of the library (docs/README.md).

A façade: it checks each call's arguments and hands the work to the rooms that own it.
``_config.py`` checks the settings; ``_wiring.py`` builds the parts the URL names (its
scheme is looked up in ``_config.SCHEMES``); ``_protocol/local.py`` runs this process's
single-flight tables, flights and streams over the backend's ``Flights``; ``_leases/``
keeps near-cache leases, node liveness and invalidations; ``_protections/`` refresh-ahead
and Bloom filters.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Sequence
from typing import Any, ParamSpec, TypeVar, overload

from ._backends.embedded import EmbeddedServer
from ._backends.redis import RedisConnection
from ._codec import Codec, Envelope
from ._config import Settings, Tuning, check_call, safe_url, seconds
from ._decorator import AsyncFlight, flight_decorator
from ._errors import ConfigError, FlightError
from ._keys import FlightKeys, KeySpace, canonical, check_tags, digest_of
from ._leases.near import NearCache
from ._leases.nodes import NodeAgent, NodeInfo, invalidate_many
from ._protections.ahead import RefreshAhead
from ._protections.bloom import BloomFilter, admitted
from ._protocol.base import Flights
from ._protocol.batch import (
    MISSING_MODES,
    BatchLoad,
    BatchLoader,
    batch_arity,
    load_many,
    uncached_many,
)
from ._protocol.context import FlightContext, invoke, wants_context
from ._protocol.failopen import FailOpen
from ._protocol.jobs import LoaderJob, Producer
from ._protocol.local import LocalFlights
from ._protocol.streaming import FlightStream
from ._protocol.tags import MemoryTags, RedisTags, TagGate, tagged
from ._types import (
    MISSING,
    NOT_FOUND,
    CacheState,
    CallOptions,
    FlightInfo,
    Invalidation,
    Loader,
    Stats,
)
from ._wiring import Parts, Shared, parts_for, server_parts

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("flightcache.near")

DIGEST_MEMO = 10_000  # string keys whose digests are remembered


class FlightCache:
    """Runs an expensive async call once per key across every process that shares a server.

    ``url`` picks the backend: ``redis://``, ``rediss://``, ``unix://`` (a Redis/Valkey
    server), ``memory://`` (this process only) or ``embedded://`` (a private server started
    from the bundled binary, stopped on close). Durations are in seconds.
    """

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

    async def do(
        self,
        key: Any,
        loader: Loader,
        *,
        ttl: float | None = None,
        lease: float | None = None,
        timeout: float | None = None,
        refresh: bool = False,
        store: bool = True,
        refresh_ahead: bool | float = False,
        not_found: tuple[type[BaseException], ...] = (),
        admit: BloomFilter | None = None,
        tags: Iterable[str] | None = None,
    ) -> Any:
        """The value for ``key``: cached, or from the one running flight, or from ``loader()``.

        ``loader`` runs at most once per flight across all processes sharing the server. A
        caller that is cancelled stops waiting; the flight goes on for the others. With
        ``refresh=True`` a stored value does not count: the call joins a running flight or
        starts one, whose value replaces the stored one. With ``store=False`` the value
        goes to the flight's callers and is not stored (coalesced, not cached). With
        ``refresh_ahead`` (True, or the XFetch ``beta``: higher refreshes earlier) a hot value
        is recomputed in the background shortly before it expires, by one flight, while
        every caller keeps getting the current value. A loader that returns ``NOT_FOUND``,
        or raises one of the ``not_found`` exception types, gives every caller ``NOT_FOUND``,
        cached for ``not_found_ttl``. With ``admit`` (a ``BloomFilter``), a key the filter
        has never seen is answered ``NOT_FOUND`` at once: one round trip, no loader. With
        ``tags``, the stored value carries them: ``invalidate_tags`` of any of them makes
        it unreadable everywhere.
        """
        if not callable(loader):
            raise ConfigError(f"loader must be an async callable, not {loader!r}")
        if ttl is not None or lease is not None or timeout is not None:
            check_call(ttl, lease, timeout)
        names = check_tags(tags) if tags is not None else ()
        if refresh_ahead is not False and (
            not isinstance(refresh_ahead, (bool, int, float)) or refresh_ahead <= 0
        ):
            raise ConfigError(
                f"refresh_ahead must be True or an XFetch beta > 0: {refresh_ahead!r}"
            )
        if self._disabled:
            return await self._uncached(loader, not_found)
        digest = self._digest(key)
        self._stats.calls += 1
        near = self._near
        if near is not None and not refresh:
            data = near.get(digest)
            if data is not None:  # a leased copy: no round trip, no key names
                self._stats.hits += 1
                if refresh_ahead and store:
                    fk = self.keyspace.for_digest(digest)
                    self._maybe_refresh(fk, key, loader, refresh_ahead, ttl, lease, timeout, names)
                return self.envelope.decode(data, key=digest)
        if admit is not None and not await admitted(admit, key, fail_open=self._settings.fail_open):
            self._stats.rejected += 1
            return NOT_FOUND
        fk = self.keyspace.for_digest(digest)
        flights = self._front
        if flights is None or self._state is not CacheState.OPENED:
            flights = await self._ready()
        front: Flights = flights

        opts = self._options(canonical(key), ttl, lease, timeout, refresh, store)

        def start(handle: Any) -> Coroutine[Any, Any, bytes]:
            job = LoaderJob(
                loader,
                self.envelope,
                fk.digest,
                not_found,
                key=key,
                with_context=wants_context(loader),
            )
            if names:
                job.tag(names, self._gate())
            return self._local.fly(front, fk, job, opts, handle)

        data, hit = await self._local.call(front, fk, opts, track=bool(refresh_ahead), start=start)
        if hit:
            self._stats.hits += 1
            if refresh_ahead and store:
                self._maybe_refresh(fk, key, loader, refresh_ahead, ttl, lease, timeout, names)
        return self.envelope.decode(data, key=fk.digest)

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

    async def do_many(
        self,
        keys: Iterable[Any],
        loader: BatchLoader,
        *,
        ttl: float | None = None,
        lease: float | None = None,
        timeout: float | None = None,
        store: bool = True,
        missing: str = "not_found",
    ) -> list[Any]:
        """The values of many keys, in their order, with one loader call for those nobody has.

        Stored keys are served and keys in flight in any process are followed; the others
        are claimed, each a flight of its own (token, lease, timeout), and handed together
        to one ``loader(keys)`` call, which returns ``{key: value}``. A key it leaves out
        gets ``NOT_FOUND`` (cached for ``not_found_ttl``), or with ``missing="raise"`` a
        ``KeyError`` (nothing cached). A loader that declares a second parameter also gets
        each key's ``FlightContext``, in the order of the keys. If the loader raises, the
        keys of that call fail; the first error in the order of ``keys`` is raised once
        every key settled, and the values of the others are stored all the same.
        """
        if not callable(loader):
            raise ConfigError(f"loader must be an async callable taking the keys: {loader!r}")
        if missing not in MISSING_MODES:
            raise ConfigError(f"missing must be one of {MISSING_MODES}: {missing!r}")
        if ttl is not None or lease is not None or timeout is not None:
            check_call(ttl, lease, timeout)
        keys = list(keys)
        batch = BatchLoad(
            loader, self.envelope, missing=missing, with_contexts=batch_arity(loader) == 2
        )
        if self._disabled:
            return await uncached_many(batch, keys)
        digests = [self._digest(key) for key in keys]
        flights = self._front
        if flights is None or self._state is not CacheState.OPENED:
            flights = await self._ready()
        return await load_many(
            keys,
            digests,
            batch,
            flights=flights,
            local=self._local,
            near=self._near,
            keyspace=self.keyspace,
            options=lambda key: self._options(canonical(key), ttl, lease, timeout, store=store),
            stats=self._stats,
        )

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

    def stream(
        self,
        key: Any,
        producer: Producer,
        *,
        ttl: float | None = None,
        lease: float | None = None,
        timeout: float | None = None,
        refresh: bool = False,
        store: bool = True,
    ) -> FlightStream:
        """``async for chunk in fc.stream(key, producer)``: one producer run for everyone.

        ``producer`` is a zero-argument async generator. Its owner's chunks reach every
        caller live, in every process, including callers that join late; the finished
        sequence is cached and a hit replays it. If the owner dies mid-stream a new owner
        starts over: a caller that had no chunk yet goes on with it, one that had chunks
        gets ``StreamRestarted``. ``timeout`` bounds the whole production; ``refresh`` is
        as for ``do``, and so is ``store``.
        """
        if not callable(producer):
            raise ConfigError(
                f"producer must be a zero-argument async generator function: {producer!r}"
            )
        if ttl is not None or lease is not None or timeout is not None:
            check_call(ttl, lease, timeout)
        if self._disabled:
            refresh, store = True, False
        canon = canonical(key)
        fk = self.keyspace.for_digest(digest_of(canon))
        opts = self._options(canon, ttl, lease, timeout, refresh, store)
        self._stats.streams += 1
        return self._local.stream(fk, producer, opts)

    async def get(self, key: Any) -> Any:
        """The cached value for ``key``, or ``MISSING``; never runs anything."""
        digest = self._digest(key)
        self._stats.gets += 1
        if self._disabled:
            return MISSING
        data = self._near.get(digest) if self._near is not None else None
        if data is None:
            flights = self._front
            if flights is None or self._state is not CacheState.OPENED:
                flights = await self._ready()
            data = await self._local.lookup(flights, self.keyspace.for_digest(digest))
        if data is None or self.envelope.is_error(data):
            return MISSING
        self._stats.get_hits += 1
        return self.envelope.decode(data, key=digest)

    async def invalidate(self, key: Any) -> Invalidation:
        """Delete the stored result; return when no node can still serve the old one.

        Every live node drops its near-cache copy and acknowledges; the call returns when
        all have (``how == "acked"``) or when the longest lease any of them could hold has
        lapsed (``how == "lease"``), whichever is first. Reads during the call are served
        without a lease. An unknown key is not an error (``how == "absent"``).
        """
        return await self._replace(self.keyspace.flight(key), None, 0)

    async def invalidate_many(self, keys: Iterable[Any]) -> list[Invalidation]:
        """``invalidate`` for each key, concurrently."""
        return await invalidate_many(self._replace, [self.keyspace.flight(key) for key in keys])

    async def set(
        self,
        key: Any,
        value: Any,
        *,
        ttl: float | None = None,
        tags: Iterable[str] | None = None,
        if_token: int | None = None,
    ) -> Invalidation:
        """Store ``value`` (computed elsewhere); return when no node serves the old one.

        ``tags`` as for ``do``. With ``if_token`` (a loader's ``FlightContext.token``), the
        value is written only while that token is the owner's of the key's running
        flight, checked in the same server call that writes: otherwise nothing is written
        and ``LeaseLost`` (with ``.token``) is raised, so an owner that lost its flight
        cannot overwrite the new owner's work.
        """
        if ttl is not None:
            seconds("ttl", ttl)
        if if_token is not None and (isinstance(if_token, bool) or not isinstance(if_token, int)):
            raise ConfigError(f"if_token must be a fencing token (an int): {if_token!r}")
        names = check_tags(tags) if tags is not None else ()
        fk = self.keyspace.flight(key)
        data = self.envelope.encode(value, key=fk.digest)
        ttl_ms = int((self.ttl if ttl is None else ttl) * 1000) or 1
        if names:  # the versions before the write: an invalidation after it makes it stale
            await self._ready()
            data = tagged(await self._gate().read(names), data)
        return await self._replace(fk, data, ttl_ms, if_token)

    async def invalidate_tags(self, tags: Iterable[str]) -> Invalidation:
        """Make every result stored with one of ``tags`` unreadable, everywhere; return when
        no node can still serve one (as ``invalidate``: every live node with a near cache
        dropped its copies and acknowledged, or the longest lease lapsed).

        One counter per tag on the server, whatever number of results carry it; a flight
        that started before still delivers to its callers, but what it stores is stale.
        """
        names = check_tags(tags)
        await self._ready()
        gate = self._gate()
        if self._agent is None:  # memory://: this process is the only reader
            await gate.bump(names)
            return Invalidation("acked", 0, 0, 0.0)
        return await self._agent.invalidate_tags(names, lambda: gate.bump(names))

    async def _replace(
        self, fk: FlightKeys, data: bytes | None, ttl_ms: int, if_token: int | None = None
    ) -> Invalidation:
        await self._ready()
        assert self._parts is not None
        return await self._parts.replacer.replace(fk, data, ttl_ms, if_token)

    async def ping(self) -> float:
        """One round trip to the server, in seconds (0 for ``memory://``). It never fails
        open: an unreachable server raises ``BackendUnavailable``, for health checks."""
        await self._ready()
        assert self._parts is not None
        return await self._parts.ping()

    async def nodes(self) -> list[NodeInfo]:
        """The live nodes of this namespace (their liveness lease holds), by the server."""
        await self._ready()
        return await self._agent.live() if self._agent is not None else []

    async def inspect(self, key: Any) -> FlightInfo:
        """State of ``key``: cached, running (owner, token, lease left, followers) or vacant."""
        fk = self.keyspace.flight(key)
        return await (await self._ready()).inspect(fk)

    @overload
    def flight(self, fn: Callable[P, Awaitable[R]], /) -> Callable[P, Coroutine[Any, Any, R]]: ...

    @overload
    def flight(self, fn: Callable[P, R], /) -> Callable[P, Coroutine[Any, Any, R]]: ...

    @overload
    def flight(
        self,
        fn: None = None,
        /,
        *,
        ttl: float | None = None,
        lease: float | None = None,
        timeout: float | None = None,
    ) -> AsyncFlight: ...

    def flight(
        self,
        fn: Callable[..., Any] | None = None,
        /,
        *,
        ttl: float | None = None,
        lease: float | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Decorator: the key is the function's module and name plus its canonical arguments.

        ``async def`` and ``def`` functions alike become coroutine functions with the same
        parameters and return type; a ``def`` body runs in a worker thread.
        """
        decorate = flight_decorator(self.do, ttl=ttl, lease=lease, timeout=timeout)
        return decorate(fn) if fn is not None else decorate

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """``with fc.disabled():`` caching off while the block runs, for tests.

        ``do`` (and so ``@flight``) calls its loader every time, reads nothing and stores
        nothing, without touching the server; ``get`` returns ``MISSING``; ``stream`` runs
        its producer for each call that finds no running flight of its key and stores
        nothing. ``set`` and ``invalidate`` work as usual. Blocks nest; the switch is the
        cache's, for every caller.
        """
        self._disabled += 1
        try:
            yield
        finally:
            self._disabled -= 1

    async def aclose(self) -> None:
        """Stop every flight of this process (owners give their flights back) and disconnect."""
        if self._closed:
            return
        self._state = CacheState.CLOSED
        if self._near is not None:
            self._near.clear()  # a closed cache answers nothing, not even from its copies
        await self._local.aclose()
        async with self._start_lock:  # a start under way finishes, and undoes itself
            pass
        if self._parts is not None:
            await self._parts.aclose()
        if self._server is not None:
            await asyncio.to_thread(self._server.stop)

    async def __aenter__(self) -> FlightCache:
        await self._ready()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"FlightCache({safe_url(self.url)!r}, namespace={self.namespace!r})"
