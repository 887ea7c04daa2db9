"""``FlightCacheSync``: the blocking front door, over the one async engine (docs/sync.md).

One engine, two doors. A ``FlightCacheSync`` runs an ordinary ``FlightCache`` on an event
loop of its own, in a daemon thread it owns; each blocking method hands its call to that
loop and waits for the answer on a ``concurrent.futures.Future`` (the waiting thread holds
no GIL). There is no second protocol implementation: sync and async processes share
flights, results and near-cache invalidations, and threads of one process coalesce in the
engine's single-flight table exactly as coroutines do. On one plain server, ``do`` and
``get`` first read in the calling thread (``_syncread.py``: the engine's own join, on a
sync connection pool), and hop to the loop only when that read is not a hit.

- A plain loader runs in a worker thread of the engine's pool, with a copy of the caller's
  context variables, while the loop renews its lease: a sync loader may block. A thread
  cannot be stopped: when its flight is taken from it (lease lost, hard timeout, close) its
  callers are answered without it, the thread runs on, and the fencing token refuses its
  late write. An ``async def`` loader runs on the private loop.
- Called from a thread that runs an event loop it raises ``ConfigError``: it would block
  that loop, and on its own loop (an async loader calling it) it would deadlock. Use
  ``FlightCache`` there, or ``await asyncio.to_thread(fcs.do, ...)``.
- After ``os.fork()`` a child gets a loop thread and connections of its own on its first
  call (``os.register_at_fork`` and a weak registry); the parent's are left alone, never
  used and never closed by the child. A child of an ``embedded://`` cache whose server the
  parent started connects to that server.
- Every wait is bounded: the engine's own bound for the call plus a margin, then
  ``FlightTimeout``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import weakref
from collections.abc import (
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Sequence,
)
from typing import Any, ParamSpec, TypeVar, cast, overload

from ._cache import FlightCache
from ._codec import Codec, Envelope
from ._config import Settings, Tuning, check_call, safe_url
from ._decorator import SyncFlight, flight_decorator
from ._errors import ConfigError
from ._keys import KeySpace, check_tags
from ._leases.nodes import NodeInfo
from ._loopthread import (
    LONGEST_LEASE_S,
    MARGIN_S,
    _Core,
    _Engine,
    _listed,
    _loader_for,
    _not_in_a_loop,
    _producer_for,
)
from ._protections.bloom import BloomFilter
from ._protocol.batch import BatchLoader
from ._protocol.streaming import FlightStream
from ._syncread import UNTAKEN
from ._types import FlightInfo, Invalidation, Stats

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class FlightStreamSync:
    """``for chunk in fcs.stream(key, producer)``; ``source`` is HIT, MISS or COALESCED.

    The blocking twin of ``FlightStream``: each chunk is waited for on the engine's loop.
    Leaving the loop early (``close()``, or ``with``) stops this caller only.
    """

    def __init__(self, engine: _Engine, stream: FlightStream, bound: float) -> None:
        self._engine = engine
        self._stream = stream
        self._bound = bound

    @property
    def source(self) -> str | None:
        return self._stream.source

    def opened(self) -> str:
        """Wait until the source is known (before the first chunk), and return it."""
        return self._engine.run(self._stream.opened(), self._bound)

    def __iter__(self) -> FlightStreamSync:
        return self

    def __next__(self) -> Any:
        try:
            return self._engine.run(self._stream.__anext__(), self._bound)
        except StopAsyncIteration:
            raise StopIteration from None

    def ready(self) -> list[Any]:
        """The chunks that have arrived and were not iterated yet, without waiting for more
        (read on the engine's loop, which owns the stream)."""

        async def take() -> list[Any]:
            return self._stream.ready()

        return self._engine.run(take(), self._bound)

    def close(self) -> None:
        self._engine.run(self._stream.aclose(), self._bound)

    def __enter__(self) -> FlightStreamSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FlightCacheSync:
    """``FlightCache`` for threads, WSGI apps, Celery tasks and scripts: the same arguments,
    the same methods without ``await``, the same protocol and keys.

    It runs a ``FlightCache`` on a private event loop in a daemon thread of its own, started
    on first use; ``close()`` (or ``with``) stops it. Loaders are plain callables, run in a
    worker thread while the loop renews their lease (``async def`` loaders run on the
    loop). It must not be called from a thread that runs an event loop (``ConfigError``):
    use ``FlightCache`` there. It survives ``os.fork()``: each child makes its own loop
    thread and connections. See docs/sync.md for the cost of a call.
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
        options: dict[str, Any] = {
            "namespace": namespace,
            "ttl": ttl,
            "lease": lease,
            "timeout": timeout,
            "error_ttl": error_ttl,
            "max_value_bytes": max_value_bytes,
            "codec": codec,
            "socket_timeout": socket_timeout,
            "max_connections": max_connections,
            "near_cache": near_cache,
            "near_lease": near_lease,
            "near_max_entries": near_max_entries,
            "near_max_bytes": near_max_bytes,
            "skew_margin": skew_margin,
            "node_ttl": node_ttl,
            "cluster": cluster,
            "fail_open": fail_open,
            "not_found_ttl": not_found_ttl,
            "tuning": tuning,
        }
        settings = Settings.from_args(url, **options)  # checked here, in the caller's thread
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
        failover_s = (tuning or Tuning()).failover_s
        self._margin = MARGIN_S + settings.socket_timeout + failover_s
        self._admin_bound = self._margin + settings.socket_timeout
        self._replace_bound = (
            self._admin_bound + max(LONGEST_LEASE_S, settings.near_lease) + settings.skew_margin
        )

        def make(server_url: str | None) -> FlightCache:
            return FlightCache(server_url or url, **options)

        self._core = _Core(make, max(8, settings.max_connections), self._admin_bound)
        self._finalizer = weakref.finalize(self, self._core.close)

    # -- the engine ----------------------------------------------------------------------

    def _engine(self) -> _Engine:
        _not_in_a_loop()
        return self._core.current()

    def _call_bound(self, timeout: float | None, lease: float | None) -> float:
        """The engine's own wait bound for a call (``CallOptions.wait_bound_s``) + margin."""
        timeout_s = self.timeout if timeout is None else timeout
        lease_s = self.lease if lease is None else lease
        return 2 * (timeout_s + lease_s) + 1.0 + self._margin

    # -- public API ----------------------------------------------------------------------

    @property
    def stats(self) -> dict[str, int]:
        """Counters of this process's engine (hits, misses, loader runs, takeovers, ...);
        a forked child starts from zero."""
        engine = self._core.engine
        if engine is None or engine.pid != os.getpid():
            return Stats().snapshot()
        if threading.current_thread() is engine.thread:  # an async loader reads them
            stats = engine.cache.stats
        else:
            stats = engine.call(lambda: engine.cache.stats, self._admin_bound)
        return engine.fast.counts.into(stats) if engine.fast is not None else stats

    @property
    def server_url(self) -> str | None:
        """The URL of the private server of an ``embedded://`` cache, once started."""
        engine = self._core.engine
        if engine is not None and engine.pid == os.getpid() and engine.cache.server_url:
            return engine.cache.server_url
        return self._core.server_url

    @property
    def node_id(self) -> str:
        """This process's node id in the namespace (its engine's; starts the engine)."""
        return self._engine().cache.node_id

    def do(
        self,
        key: Any,
        loader: Callable[[], Any],
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

        As ``FlightCache.do``; ``loader`` is a zero-argument callable (an ``async def``
        one is run on the engine's loop). A plain loader runs in a worker thread, with a
        copy of the caller's context variables, while the loop renews its lease. If its
        flight is taken from it (lease lost to a takeover, hard ``timeout``), callers get
        the outcome without it; the thread runs on until the loader returns and its late
        write is refused by the fencing token. ``admit`` is not available here yet (a
        ``BloomFilter``'s API is async).
        """
        if not callable(loader):
            raise ConfigError(f"loader must be a zero-argument callable, not {loader!r}")
        if admit is not None:
            raise ConfigError("admit= needs a BloomFilter, whose API is async: use FlightCache")
        if ttl is not None or lease is not None or timeout is not None:
            check_call(ttl, lease, timeout)
        engine = self._engine()
        context = contextvars.copy_context()
        fast = engine.fast_path()
        if fast is not None and not refresh and refresh_ahead is False:
            value = fast.do(
                key,
                lambda: _loader_for(loader, context),
                ttl=ttl,
                lease=lease,
                timeout=timeout,
                store=store,
                not_found=not_found,
                tags=check_tags(tags) if tags is not None else (),
                bound=self._call_bound(timeout, lease),
            )
            if value is not UNTAKEN:
                return value
        job = _loader_for(loader, context)
        call = engine.cache.do(
            key,
            job,
            ttl=ttl,
            lease=lease,
            timeout=timeout,
            refresh=refresh,
            store=store,
            refresh_ahead=refresh_ahead,
            not_found=not_found,
            tags=_listed(tags),
        )
        return engine.run(call, self._call_bound(timeout, lease))

    def do_many(
        self,
        keys: Iterable[Any],
        loader: Callable[..., Any],
        *,
        ttl: float | None = None,
        lease: float | None = None,
        timeout: float | None = None,
        store: bool = True,
        missing: str = "not_found",
    ) -> list[Any]:
        """The values of many keys, in their order, with one loader call for those nobody has.

        As ``FlightCache.do_many``; ``loader(keys)`` returns ``{key: value}``. A plain
        loader runs in a worker thread (with the keys' ``FlightContext``s as a second
        argument when it declares one), an ``async def`` one on the engine's loop.
        """
        if not callable(loader):
            raise ConfigError(f"loader must be a callable taking the keys: {loader!r}")
        engine = self._engine()
        keys = list(keys)  # an iterator is read in the caller's thread
        job = cast("BatchLoader", _loader_for(loader, contextvars.copy_context()))
        call = engine.cache.do_many(
            keys, job, ttl=ttl, lease=lease, timeout=timeout, store=store, missing=missing
        )
        return engine.run(call, self._call_bound(timeout, lease))

    def stream(
        self,
        key: Any,
        producer: Callable[[], Any],
        *,
        ttl: float | None = None,
        lease: float | None = None,
        timeout: float | None = None,
        refresh: bool = False,
        store: bool = True,
    ) -> FlightStreamSync:
        """``for chunk in fcs.stream(key, producer)``: one producer run for everyone.

        As ``FlightCache.stream``; ``producer`` is a zero-argument generator function (an
        async generator function runs on the engine's loop). A plain generator is stepped
        in a thread of its own, one chunk at a time, and closed when its flight ends.
        """
        if not callable(producer):
            raise ConfigError(f"producer must be a zero-argument generator function: {producer!r}")
        if ttl is not None or lease is not None or timeout is not None:
            check_call(ttl, lease, timeout)
        engine = self._engine()
        job = _producer_for(producer, contextvars.copy_context(), engine.pool)

        def open_stream() -> FlightStream:
            return engine.cache.stream(
                key, job, ttl=ttl, lease=lease, timeout=timeout, refresh=refresh, store=store
            )

        stream = engine.call(open_stream, self._admin_bound)
        return FlightStreamSync(engine, stream, self._call_bound(timeout, lease))

    def get(self, key: Any) -> Any:
        """The cached value for ``key``, or ``MISSING``; never runs anything."""
        engine = self._engine()
        fast = engine.fast_path()
        if fast is not None:
            value = fast.get(key, lambda coro: engine.run(coro, self._admin_bound))
            if value is not UNTAKEN:
                return value
        return engine.run(engine.cache.get(key), self._admin_bound)

    def invalidate(self, key: Any) -> Invalidation:
        """Delete the stored result; return when no node can still serve the old one."""
        engine = self._engine()
        return engine.run(engine.cache.invalidate(key), self._replace_bound)

    def invalidate_many(self, keys: Iterable[Any]) -> list[Invalidation]:
        """``invalidate`` for each key, concurrently."""
        engine = self._engine()
        keys = list(keys)  # an iterator is read in the caller's thread
        return engine.run(engine.cache.invalidate_many(keys), self._replace_bound)

    def set(
        self,
        key: Any,
        value: Any,
        *,
        ttl: float | None = None,
        tags: Iterable[str] | None = None,
        if_token: int | None = None,
    ) -> Invalidation:
        """Store ``value`` (computed elsewhere); return when no node serves the old one.
        ``tags`` as for ``do``; with ``if_token``, only while that token owns the key's
        flight (``LeaseLost``)."""
        engine = self._engine()
        call = engine.cache.set(key, value, ttl=ttl, tags=_listed(tags), if_token=if_token)
        return engine.run(call, self._replace_bound)

    def invalidate_tags(self, tags: Iterable[str]) -> Invalidation:
        """Make every result stored with one of ``tags`` unreadable, everywhere; return when
        no node can still serve one (as ``FlightCache.invalidate_tags``)."""
        engine = self._engine()
        return engine.run(engine.cache.invalidate_tags(_listed(tags)), self._replace_bound)

    def ping(self) -> float:
        """One round trip to the server, in seconds (0 for ``memory://``); never fails open."""
        engine = self._engine()
        return engine.run(engine.cache.ping(), self._admin_bound)

    def nodes(self) -> list[NodeInfo]:
        """The live nodes of this namespace (their liveness lease holds), by the server."""
        engine = self._engine()
        return engine.run(engine.cache.nodes(), self._admin_bound)

    def inspect(self, key: Any) -> FlightInfo:
        """State of ``key``: cached, running (owner, token, lease left, followers) or vacant."""
        engine = self._engine()
        return engine.run(engine.cache.inspect(key), self._admin_bound)

    @overload
    def flight(self, fn: Callable[P, Awaitable[R]], /) -> Callable[P, R]: ...

    @overload
    def flight(self, fn: Callable[P, R], /) -> Callable[P, R]: ...

    @overload
    def flight(
        self,
        fn: None = None,
        /,
        *,
        ttl: float | None = None,
        lease: float | None = None,
        timeout: float | None = None,
    ) -> SyncFlight: ...

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

        ``def`` and ``async def`` functions alike become plain functions with the same
        parameters and return type (an ``async def`` body runs on the engine's loop).
        """
        decorate = flight_decorator(self.do, ttl=ttl, lease=lease, timeout=timeout, blocking=True)
        return decorate(fn) if fn is not None else decorate

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """``with fcs.disabled():`` caching off while the block runs, for tests (as
        ``FlightCache.disabled``: loaders run every time, nothing is read or stored)."""
        engine = self._engine()
        switch = engine.cache.disabled()
        engine.call(switch.__enter__, self._admin_bound)
        try:
            yield
        finally:
            engine.call(lambda: switch.__exit__(None, None, None), self._admin_bound)

    def close(self) -> None:
        """Stop every flight of this process (owners give theirs back), disconnect, and
        stop the loop thread. A loader thread still running is left to finish."""
        _not_in_a_loop()
        self._finalizer()

    def __enter__(self) -> FlightCacheSync:
        engine = self._engine()
        engine.run(engine.cache.__aenter__(), self._admin_bound)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FlightCacheSync({safe_url(self.url)!r}, namespace={self.namespace!r})"
