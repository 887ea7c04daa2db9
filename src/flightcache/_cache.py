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
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from typing import Any, ParamSpec, TypeVar, overload

from ._config import check_call, safe_url, seconds
from ._decorator import AsyncFlight, flight_decorator
from ._engine import Engine
from ._errors import ConfigError
from ._keys import FlightKeys, canonical, check_tags, digest_of
from ._leases.nodes import NodeInfo, invalidate_many
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
from ._protocol.context import wants_context
from ._protocol.jobs import Producer
from ._protocol.observed import HIT, CallRecord, ObservedLoaderJob
from ._protocol.streaming import FlightStream
from ._protocol.tags import tagged
from ._types import (
    MISSING,
    NOT_FOUND,
    CacheState,
    CallOptions,
    FlightInfo,
    Invalidation,
    Loader,
)
from .telemetry import Call, flown

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("flightcache.near")

DIGEST_MEMO = 10_000  # string keys whose digests are remembered


class FlightCache(Engine):
    """Runs an expensive async call once per key across every process that shares a server.

    ``url`` picks the backend: ``redis://``, ``rediss://``, ``unix://`` (a Redis/Valkey
    server), ``memory://`` (this process only) or ``embedded://`` (a private server started
    from the bundled binary, stopped on close). Durations are in seconds.
    """

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
        call: Call | None = None  # this call's span, once a tracer provider is configured
        traced = self._traced
        if traced is not None:
            call = traced.call("flightcache.do", digest, current=True)
        try:
            near = self._near
            if near is not None and not refresh:
                data = near.get(digest)
                if data is not None:  # a leased copy: no round trip, no key names
                    self._stats.hits += 1
                    if refresh_ahead and store:
                        fk = self.keyspace.for_digest(digest)
                        self._maybe_refresh(
                            fk, key, loader, refresh_ahead, ttl, lease, timeout, names
                        )
                    if call is not None:
                        call.near = True
                        return call.result(self.envelope.decode(data, key=digest))
                    return self.envelope.decode(data, key=digest)
            if admit is not None and not await admitted(
                admit, key, fail_open=self._settings.fail_open
            ):
                self._stats.rejected += 1
                if call is not None:
                    call.record.role = "rejected"
                    call.not_found = True
                return NOT_FOUND
            fk = self.keyspace.for_digest(digest)
            flights = self._front
            if flights is None or self._state is not CacheState.OPENED:
                flights = await self._ready()
            front: Flights = flights

            opts = self._options(canonical(key), ttl, lease, timeout, refresh, store)
            record = call.record if call is not None else None
            # (a partial, not a closure: a call that waits keeps one object, not nine cells)
            start = functools.partial(
                self._flight, front, fk, opts, loader, not_found, key, record, names
            )
            data, hit = await self._local.call(
                front, fk, opts, track=bool(refresh_ahead), start=start, record=record
            )
            if hit:
                self._stats.hits += 1
                if refresh_ahead and store:
                    self._maybe_refresh(fk, key, loader, refresh_ahead, ttl, lease, timeout, names)
            if call is not None:
                if hit:
                    call.record.role = HIT
                return call.result(self.envelope.decode(data, key=fk.digest))
            return self.envelope.decode(data, key=fk.digest)
        except BaseException as exc:
            if call is not None:
                call.end(exc)
            raise
        finally:
            if call is not None:
                call.end()

    def _flight(
        self,
        front: Flights,
        fk: FlightKeys,
        opts: CallOptions,
        loader: Loader,
        not_found: tuple[type[BaseException], ...],
        key: Any,
        record: CallRecord | None,
        names: tuple[str, ...],
        handle: Any,
    ) -> Coroutine[Any, Any, bytes]:
        """The flight of a ``do`` call that found nothing stored, to run in a task."""
        job = ObservedLoaderJob(
            loader, self.envelope, fk.digest, not_found, key=key, with_context=wants_context(loader)
        )
        job.record = record or CallRecord()
        if names:
            job.tag(names, self._gate())
        work = functools.partial(self._local.fly, front, fk, job, opts, handle)
        return flown(self._stats, self._tel, job.record, work)

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
        traced = self._traced
        if traced is not None:
            call = traced.call("flightcache.stream", fk.digest, current=False)
            return self._local.stream(fk, producer, opts, call)
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
