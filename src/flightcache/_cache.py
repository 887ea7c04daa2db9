"""``FlightCache``: the public face of the library (docs/README.md)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect as _inspect
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, ParamSpec, Protocol, TypeVar, overload

from ._backends.embedded import EmbeddedServer
from ._backends.redis import RedisConnection, safe_url
from ._codec import Codec, Envelope, make_codec
from ._errors import BackendUnavailable, ConfigError, FlightError, SerializationError
from ._keys import FlightKeys, KeySpace, canonical, describe_canonical, digest_of
from ._leases.near import Leaser, NearCache
from ._leases.nodes import Invalidation, NodeAgent, NodeInfo
from ._protections.ahead import RefreshAhead
from ._protections.bloom import BloomFilter
from ._protocol.failopen import FailOpen
from ._protocol.flight import RedisFlights, Tuning
from ._protocol.jobs import Job, LoaderJob, Producer, StreamJob
from ._protocol.memory import MemoryFlights
from ._protocol.sharded import ShardedFlights
from ._protocol.streaming import HIT, FlightStream, LocalStream
from ._types import MISSING, NOT_FOUND, CallOptions, FlightInfo, Loader, Stats

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("flightcache.near")

INVALIDATE_CONCURRENCY = 8
SHARD_SCHEMES = ("redis://", "rediss://", "unix://")
DIGEST_MEMO = 10_000  # string keys whose digests are remembered

REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://")


class _Flights(Protocol):
    async def lookup(self, fk: FlightKeys) -> bytes | None: ...

    async def resolve(self, fk: FlightKeys, job: Job, opts: CallOptions) -> bytes: ...

    async def inspect(self, fk: FlightKeys) -> FlightInfo: ...


def _retrieve(fut: asyncio.Future[bytes]) -> None:
    """Mark a shared future's exception as seen: its callers may all have left."""
    if not fut.cancelled():
        fut.exception()


class _Slot:
    """One key's entry in the local single-flight table.

    The future the other local callers wait on is made only when a second caller arrives,
    so an uncontended hit costs no future and no scheduled callback.
    """

    __slots__ = ("_future", "key")

    def __init__(self, key: str) -> None:
        self.key = key  # its key in the table: the digest, with "!" for refresh calls
        self._future: asyncio.Future[bytes] | None = None

    @property
    def waited_on(self) -> bool:
        return self._future is not None

    def wait(self) -> asyncio.Future[bytes]:
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
            self._future.add_done_callback(_retrieve)
        return self._future

    def settle(self, outcome: bytes | BaseException) -> None:
        fut = self._future
        if fut is None or fut.done():
            return  # nobody waits: every caller holding this slot called wait() at once
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)


def _seconds(name: str, value: Any, *, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > minimum:
        raise ConfigError(f"{name} must be a number of seconds greater than {minimum:g}: {value!r}")
    return float(value)


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
        shards: list[str] = []
        if isinstance(url, (list, tuple)):  # client-side sharding over standalone servers
            shards = [str(u) for u in url]
            if not shards or not all(u.startswith(SHARD_SCHEMES) for u in shards):
                raise ConfigError(
                    "a list of URLs shards over standalone servers: give one or more "
                    "redis://, rediss:// or unix:// URLs"
                )
            url = ",".join(safe_url(u) for u in shards)
        if not isinstance(url, str):
            raise ConfigError(f"url must be a string, not {type(url).__name__}")
        if cluster:
            if not url.startswith(("redis://", "redis+cluster://")):
                raise ConfigError("cluster=True needs a redis:// URL of one cluster node")
            url = "redis+cluster://" + url.split("://", 1)[1]
        self.url = url
        self.namespace = namespace
        self.keyspace = KeySpace(namespace)
        self.ttl = _seconds("ttl", ttl)
        self.lease = _seconds("lease", lease, minimum=0.05)
        self.timeout = _seconds("timeout", timeout)
        if isinstance(error_ttl, bool) or not isinstance(error_ttl, (int, float)) or error_ttl < 0:
            raise ConfigError(f"error_ttl must be a number of seconds >= 0: {error_ttl!r}")
        self.error_ttl = float(error_ttl)
        self.not_found_ttl = _seconds("not_found_ttl", not_found_ttl)
        if (
            isinstance(max_value_bytes, bool)
            or not isinstance(max_value_bytes, int)
            or max_value_bytes < 2
        ):
            raise ConfigError(f"max_value_bytes must be an int >= 2: {max_value_bytes!r}")
        self.envelope = Envelope(make_codec(codec), max_value_bytes)
        self.node_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._stats = Stats()
        self._tuning = tuning or Tuning()
        self._socket_timeout = _seconds("socket_timeout", socket_timeout)
        if isinstance(max_connections, bool) or not isinstance(max_connections, int):
            raise ConfigError(f"max_connections must be an int >= 2: {max_connections!r}")
        if max_connections < 2:
            raise ConfigError(f"max_connections must be an int >= 2: {max_connections!r}")
        self._max_connections = max_connections
        if isinstance(skew_margin, bool) or not isinstance(skew_margin, (int, float)):
            raise ConfigError(f"skew_margin must be a number of seconds >= 0: {skew_margin!r}")
        if skew_margin < 0:
            raise ConfigError(f"skew_margin must be a number of seconds >= 0: {skew_margin!r}")
        self.skew_margin = float(skew_margin)
        self.near_lease = _seconds("near_lease", near_lease, minimum=self.skew_margin)
        self.node_ttl = _seconds("node_ttl", node_ttl, minimum=0.05)
        for name, bound in (
            ("near_max_entries", near_max_entries),
            ("near_max_bytes", near_max_bytes),
        ):
            if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
                raise ConfigError(f"{name} must be an int >= 1: {bound!r}")
        self._near_settings = (near_cache, near_max_entries, near_max_bytes)
        self._near: NearCache | None = None
        self._agent: NodeAgent | None = None
        self._leaser: Leaser | None = None
        self._redis_flights: RedisFlights | ShardedFlights | None = None
        self._fail_open = fail_open
        self._failopen: FailOpen | None = None
        self._started = False
        self._warned_ttls: set[int] = set()
        self._ahead = RefreshAhead()
        self._digests: dict[str, str] = {}
        self._inflight: dict[str, _Slot] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._streams: dict[str, LocalStream] = {}
        self._server: EmbeddedServer | None = None
        self._conn: RedisConnection | None = None
        self._flights: _Flights | None = None
        self._closed = False
        self._start_lock = asyncio.Lock()
        self._conns: list[RedisConnection] = []
        if shards:
            self._connect(shards)
        elif url.startswith("memory://"):
            self._flights = MemoryFlights(
                self.envelope, self._stats, ttl_jitter=self._tuning.ttl_jitter
            )
        elif url.startswith(REDIS_SCHEMES):
            self._connect([url])
        elif not url.startswith("embedded://"):
            raise ConfigError(
                f"unsupported URL {safe_url(url)!r}: use redis://, rediss://, unix://, "
                "redis+cluster://, memory:// or embedded://"
            )

    def _connect(self, urls: list[str]) -> None:
        """One server, or several (sharded): the first is the designated one, holding
        owner-seq, node liveness and the invalidation channel."""
        self._conns = [
            RedisConnection(
                url,
                stats=self._stats,
                socket_timeout=self._socket_timeout,
                max_connections=self._max_connections,
                client_name=f"flightcache:{self.node_id}".replace(" ", "_"),
            )
            for url in urls
        ]
        self._conn = designated = self._conns[0]
        shards = [
            (
                conn,
                RedisFlights(
                    conn,
                    self.keyspace,
                    self.envelope,
                    self._stats,
                    self.node_id,
                    self._tuning,
                    seq_conn=designated,
                ),
            )
            for conn in self._conns
        ]
        conn_for: Callable[[FlightKeys], RedisConnection] | None = None
        if len(shards) == 1:
            self._flights = self._redis_flights = shards[0][1]
        else:
            sharded = ShardedFlights(shards)
            self._flights = self._redis_flights = sharded
            conn_for = sharded.conn_for
        self._failopen = FailOpen(
            self.envelope,
            self._stats,
            enabled=self._fail_open,
            url=",".join(safe_url(u) for u in urls),
            local_ttl_s=self.near_lease,
        )
        enabled, max_entries, max_bytes = self._near_settings
        if enabled:
            self._near = NearCache(max_entries=max_entries, max_bytes=max_bytes)
        self._agent = NodeAgent(
            self._conn,
            self.keyspace,
            self.node_id,
            self._near,
            near_lease_s=self.near_lease,
            skew_margin_s=self.skew_margin,
            node_ttl_s=self.node_ttl,
            owned=lambda: self._stats.owning,
            conn_for=conn_for,
        )
        if self._near is not None:
            agent = self._agent
            self._leaser = Leaser(
                self._near,
                lease_s=self.near_lease,
                skew_margin_s=self.skew_margin,
                heard=lambda: agent.seq,
                live_until=lambda: agent.live_until,
            )

    async def _ready(self) -> _Flights:
        if self._started and not self._closed:
            assert self._flights is not None
            return self._flights
        if self._closed:
            raise FlightError("this FlightCache is closed")
        async with self._start_lock:
            if self._flights is None and not self._closed:  # embedded://: start it once
                server = EmbeddedServer()
                await asyncio.to_thread(server.start)
                if self._closed:  # closed while it started: nobody else will stop it
                    await asyncio.to_thread(server.stop)
                else:
                    self._server = server
                    self._connect([server.url])
            if not self._started and not self._closed:
                for conn in self._conns:
                    try:
                        await conn.open()
                    except BackendUnavailable as exc:  # calls fail open or raise, later
                        log.info("could not connect yet: %s", exc)
                if self._agent is not None:
                    await self._agent.start()  # live, and listening for invalidations
                self._started = True
        if self._closed or self._flights is None:
            raise FlightError("this FlightCache is closed")
        return self._flights

    # -- public API ----------------------------------------------------------------------

    @property
    def stats(self) -> dict[str, int]:
        """Counters since this cache was made (hits, misses, loader runs, takeovers, ...)."""
        return self._stats.snapshot()

    @property
    def server_url(self) -> str | None:
        """The URL of the private server of an ``embedded://`` cache, once started."""
        return self._server.url if self._server else None

    def _check_call(self, ttl: float | None, lease: float | None, timeout: float | None) -> None:
        if ttl is not None:
            _seconds("ttl", ttl)
        if lease is not None:
            _seconds("lease", lease, minimum=0.05)
        if timeout is not None:
            _seconds("timeout", timeout)

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
        return CallOptions(
            ttl_ms=int((self.ttl if ttl is None else ttl) * 1000) or 1,
            lease_ms=int((self.lease if lease is None else lease) * 1000),
            timeout_s=float(self.timeout if timeout is None else timeout),
            error_ttl_ms=int(self.error_ttl * 1000),
            not_found_ttl_ms=int(self.not_found_ttl * 1000),
            key_text=describe_canonical(canon),
            refresh=refresh,
            store=store,
        )

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
        has never seen is answered ``NOT_FOUND`` at once: one round trip, no loader.
        """
        if not callable(loader):
            raise ConfigError(f"loader must be a zero-argument async callable, not {loader!r}")
        if ttl is not None or lease is not None or timeout is not None:
            self._check_call(ttl, lease, timeout)
        if refresh_ahead is not False and (
            not isinstance(refresh_ahead, (bool, int, float)) or refresh_ahead <= 0
        ):
            raise ConfigError(
                f"refresh_ahead must be True or an XFetch beta > 0: {refresh_ahead!r}"
            )
        digest = self._digest(key)
        self._stats.calls += 1
        near = self._near
        if near is not None and not refresh:
            data = near.get(digest)
            if data is not None:  # a leased copy: no round trip, no key names
                self._stats.hits += 1
                if refresh_ahead and store:
                    fk = self.keyspace.for_digest(digest)
                    self._maybe_refresh(fk, key, loader, refresh_ahead, ttl, lease, timeout)
                return self.envelope.decode(data, key=digest)
        if admit is not None and not await self._admitted(admit, key):
            self._stats.rejected += 1
            return NOT_FOUND
        fk = self.keyspace.for_digest(digest)
        flights = self._flights
        if flights is None or not self._started or self._closed:
            flights = await self._ready()
        # A refresh must not ride on a plain call's lookup (it would get the stored value):
        # refresh calls coalesce among themselves, under a table key of their own.
        table_key = fk.digest + "!" if refresh else fk.digest
        slot = self._inflight.get(table_key)
        if slot is not None:  # local single-flight: this process already asks the server
            self._stats.coalesced += 1
            return self.envelope.decode(await asyncio.shield(slot.wait()), key=fk.digest)
        slot = _Slot(table_key)
        self._inflight[table_key] = slot
        # Hit path: one read in the caller's own task (no task, no future).
        try:
            data = None if refresh else await self._lookup(flights, fk, bool(refresh_ahead))
        except asyncio.CancelledError:
            if slot.waited_on:  # others wait for this lookup: the flight goes on for them
                opts = self._options(canonical(key), ttl, lease, timeout, refresh, store)
                job = LoaderJob(loader, self.envelope, fk.digest, not_found)
                self._start_flight(flights, fk, job, opts, slot)
            else:  # nobody else asked: no loader runs for nobody
                self._settle(slot, asyncio.CancelledError())
            raise
        except BaseException as exc:
            self._settle(slot, exc)
            raise
        if data is not None:
            self._stats.hits += 1
            self._settle(slot, data)
            if refresh_ahead and store:
                self._maybe_refresh(fk, key, loader, refresh_ahead, ttl, lease, timeout)
            return self.envelope.decode(data, key=fk.digest)
        job = LoaderJob(loader, self.envelope, fk.digest, not_found)
        canon = canonical(key)
        opts = self._options(canon, ttl, lease, timeout, refresh, store)
        outcome = slot.wait()  # made before the flight can settle the slot
        self._start_flight(flights, fk, job, opts, slot)
        return self.envelope.decode(await asyncio.shield(outcome), key=fk.digest)

    def _start_flight(
        self, flights: _Flights, fk: FlightKeys, job: Job, opts: CallOptions, slot: _Slot
    ) -> None:
        """Run the flight in a task of its own, so no caller's cancellation can stop it."""
        if self._closed:
            self._settle(slot, FlightError("the FlightCache was closed", key=fk.digest))
            return
        task = asyncio.ensure_future(self._resolve(flights, fk, job, opts))
        self._tasks.add(task)
        heard = self._agent.seq if self._agent is not None else 0

        def finish(t: asyncio.Task[bytes]) -> None:
            self._tasks.discard(t)
            if t.cancelled():
                closed = FlightError("the FlightCache was closed", key=fk.digest)
                self._settle(slot, closed)
            elif (exc := t.exception()) is not None:
                self._settle(slot, exc)
            else:
                result = t.result()
                if job.lease is not None:
                    sent, ttl_ms = job.lease
                    self._ahead.saw(fk.digest, sent, ttl_ms, job.cost_ms)
                    if self._leaser is not None:
                        self._leaser.grant(fk.digest, result, sent, ttl_ms, heard)
                self._settle(slot, result)

        task.add_done_callback(finish)

    async def _admitted(self, admit: BloomFilter, key: Any) -> bool:
        try:
            return await admit.contains(key)
        except BackendUnavailable:
            if not self._fail_open:
                raise
            return True  # fail-open: a filter out of reach admits (the loader decides)

    def _maybe_refresh(
        self,
        fk: FlightKeys,
        key: Any,
        loader: Loader,
        beta: bool | float,
        ttl: float | None,
        lease: float | None,
        timeout: float | None,
    ) -> None:
        left_ms = self._ahead.due(fk.digest, 1.0 if beta is True else float(beta))
        if left_ms is None or self._closed:
            return
        opts = self._options(canonical(key), ttl, lease, timeout, refresh=True)
        # Skip the work if, by the time the join runs, someone else refreshed the value.
        margin_ms = max(50, opts.ttl_ms // 10)
        opts = dataclasses.replace(opts, refresh_below_ms=left_ms + margin_ms)
        self._ahead.running.add(fk.digest)
        self._stats.refreshes_ahead += 1
        task = asyncio.ensure_future(self._refresh_in_background(fk, loader, opts))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _refresh_in_background(
        self, fk: FlightKeys, loader: Loader, opts: CallOptions
    ) -> None:
        try:
            flights = await self._ready()
            job = LoaderJob(loader, self.envelope, fk.digest)
            heard = self._agent.seq if self._agent is not None else 0
            result = await self._resolve(flights, fk, job, opts)
            if job.lease is not None:
                sent, ttl_ms = job.lease
                self._ahead.saw(fk.digest, sent, ttl_ms, job.cost_ms)
                if self._leaser is not None:
                    self._leaser.grant(fk.digest, result, sent, ttl_ms, heard)
            else:  # the join found the value refreshed by another process
                self._ahead.settled(fk.digest)
        except Exception as exc:  # the current value stays; a caller will try again
            log.info("refresh-ahead of %s failed: %r", fk.digest, exc)
        finally:
            self._ahead.running.discard(fk.digest)

    async def _lookup(self, flights: _Flights, fk: FlightKeys, track: bool = False) -> bytes | None:
        """The stored result; with a near cache, also leased when it may be. While the
        server is down (fail-open), this process's own fallback store answers."""
        fo = self._failopen
        if fo is not None and fo.enabled and fo.skip_server():
            return await fo.local.lookup(fk)
        try:
            leaser, redis_flights = self._leaser, self._redis_flights
            if redis_flights is None or (leaser is None and not track):
                data = await flights.lookup(fk)
                if track and data is not None and isinstance(flights, MemoryFlights):
                    self._ahead.saw(fk.digest, time.monotonic(), flights.ttl_left_ms(fk), None)
            else:
                heard = leaser.heard() if leaser is not None else 0
                sent = time.monotonic()
                data, ttl_left_ms, leasable, cost_ms = await redis_flights.lookup_full(fk)
                if data is not None and leasable and leaser is not None:
                    leaser.grant(fk.digest, data, sent, ttl_left_ms, heard)
                if data is not None and track:
                    self._ahead.saw(fk.digest, sent, ttl_left_ms, cost_ms)
        except BackendUnavailable as exc:
            if fo is None or not fo.enabled:
                raise
            fo.failed(exc)
            return await fo.local.lookup(fk)
        if fo is not None and fo.down:
            fo.worked()
        return data

    async def _resolve(
        self, flights: _Flights, fk: FlightKeys, job: Job, opts: CallOptions
    ) -> bytes:
        """The flight through the server, or, while it is down (fail-open), in this process."""
        fo = self._failopen
        if fo is None or not fo.enabled:
            return await flights.resolve(fk, job, opts)
        if not fo.skip_server():
            try:
                result = await flights.resolve(fk, job, opts)
            except BackendUnavailable as exc:
                fo.failed(exc)
            else:
                fo.worked()
                return result
        self._stats.fail_open += 1
        result = await fo.local.resolve(fk, job, opts)
        job.lease = None  # this process's own answer: nothing the server could lease
        return result

    def _settle(self, slot: _Slot, outcome: bytes | BaseException) -> None:
        if self._inflight.get(slot.key) is slot:
            del self._inflight[slot.key]
        slot.settle(outcome)

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
            self._check_call(ttl, lease, timeout)
        canon = canonical(key)
        fk = self.keyspace.for_digest(digest_of(canon))
        opts = self._options(canon, ttl, lease, timeout, refresh, store)
        self._stats.streams += 1
        table_key = fk.digest + "!" if refresh else fk.digest

        def attach() -> tuple[LocalStream, bool]:
            local = self._streams.get(table_key)
            if local is not None:  # local single-flight for streams
                self._stats.coalesced += 1
                return local, True
            local = LocalStream(fk.digest, table_key)
            if self._closed:
                local.fail(FlightError("this FlightCache is closed", key=fk.digest))
                return local, False
            self._streams[table_key] = local
            task = asyncio.ensure_future(self._run_stream(fk, producer, opts, local))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return local, False

        return FlightStream(attach)

    async def _run_stream(
        self, fk: FlightKeys, producer: Producer, opts: CallOptions, local: LocalStream
    ) -> None:
        try:
            flights = await self._ready()
            data = None if opts.refresh else await self._lookup(flights, fk)
            if data is not None:
                self._stats.hits += 1
                local.opened(HIT)
                local.complete(self._stream_chunks(data, fk))
                return
            job = StreamJob(producer, self.envelope, fk.digest, local)
            data = await self._resolve(flights, fk, job, opts)
            local.opened(HIT)  # no-op unless the join itself found the result
            local.complete(None if data == b"" else self._stream_chunks(data, fk))
        except asyncio.CancelledError:
            local.fail(FlightError("the FlightCache was closed", key=fk.digest))
            raise
        except BaseException as exc:
            local.fail(exc)
        finally:
            if self._streams.get(local.table_key) is local:
                del self._streams[local.table_key]

    def _stream_chunks(self, data: bytes, fk: FlightKeys) -> list[Any]:
        if not self.envelope.is_stream(data) and not self.envelope.is_error(data):
            raise ConfigError("this key holds a value stored by do(), not a stream", key=fk.digest)
        chunks = self.envelope.decode(data, key=fk.digest)  # an error record raises here
        if not isinstance(chunks, list):
            raise SerializationError("a stored stream is not a list of chunks", key=fk.digest)
        return chunks

    async def get(self, key: Any) -> Any:
        """The cached value for ``key``, or ``MISSING``; never runs anything."""
        digest = self._digest(key)
        self._stats.gets += 1
        data = self._near.get(digest) if self._near is not None else None
        if data is None:
            flights = self._flights
            if flights is None or not self._started or self._closed:
                flights = await self._ready()
            data = await self._lookup(flights, self.keyspace.for_digest(digest))
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
        fk = self.keyspace.flight(key)
        return await self._replace(fk, None, 0)

    async def invalidate_many(self, keys: Iterable[Any]) -> list[Invalidation]:
        """``invalidate`` for each key, concurrently."""
        fks = [self.keyspace.flight(key) for key in keys]
        # Each waits on a blocking connection: at most a few at once, so a paused holder
        # cannot take every connection this process's followers need.
        gate = asyncio.Semaphore(INVALIDATE_CONCURRENCY)

        async def one(fk: FlightKeys) -> Invalidation:
            async with gate:
                return await self._replace(fk, None, 0)

        return list(await asyncio.gather(*(one(fk) for fk in fks)))

    async def set(self, key: Any, value: Any, *, ttl: float | None = None) -> Invalidation:
        """Store ``value`` (computed elsewhere); return when no node serves the old one."""
        if ttl is not None:
            _seconds("ttl", ttl)
        fk = self.keyspace.flight(key)
        data = self.envelope.encode(value, key=fk.digest)
        return await self._replace(fk, data, int((self.ttl if ttl is None else ttl) * 1000) or 1)

    async def _replace(self, fk: FlightKeys, data: bytes | None, ttl_ms: int) -> Invalidation:
        flights = await self._ready()
        if self._agent is None:  # memory://: this process is the only node
            assert isinstance(flights, MemoryFlights)
            return flights.replace(fk, data, ttl_ms)
        return await self._agent.invalidate(fk, data, ttl_ms)

    async def ping(self) -> float:
        """One round trip to the server, in seconds (0 for ``memory://``). It never fails
        open: an unreachable server raises ``BackendUnavailable``, for health checks."""
        await self._ready()
        if self._conn is None:
            return 0.0
        client = self._conn.client
        started = time.monotonic()
        await self._conn.run(lambda: client.ping())
        return time.monotonic() - started

    async def nodes(self) -> list[NodeInfo]:
        """The live nodes of this namespace (their liveness lease holds), by the server."""
        await self._ready()
        return await self._agent.live() if self._agent is not None else []

    async def inspect(self, key: Any) -> FlightInfo:
        """State of ``key``: cached, running (owner, token, lease left, followers) or vacant."""
        fk = self.keyspace.flight(key)
        return await (await self._ready()).inspect(fk)

    @overload
    def flight(self, fn: Callable[P, Awaitable[R]], /) -> Callable[P, Awaitable[R]]: ...

    @overload
    def flight(
        self,
        fn: None = None,
        /,
        *,
        ttl: float | None = None,
        lease: float | None = None,
        timeout: float | None = None,
    ) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]: ...

    def flight(
        self,
        fn: Callable[P, Awaitable[R]] | None = None,
        /,
        *,
        ttl: float | None = None,
        lease: float | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Decorator: the key is the function's module and name plus its canonical arguments."""

        def decorate(func: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
            if not _inspect.iscoroutinefunction(func):
                raise ConfigError(f"@flight needs an async function, not {func!r}")
            signature = _inspect.signature(func)
            name = f"{func.__module__}.{func.__qualname__}"

            @functools.wraps(func)
            async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                key = {"fn": name, "args": bound.arguments}
                result: R = await self.do(
                    key, lambda: func(*args, **kwargs), ttl=ttl, lease=lease, timeout=timeout
                )
                return result

            return wrapper

        return decorate(fn) if fn is not None else decorate

    async def aclose(self) -> None:
        """Stop every flight of this process (owners give their flights back) and disconnect."""
        if self._closed:
            return
        self._closed = True
        if self._near is not None:
            self._near.clear()  # a closed cache answers nothing, not even from its copies
        while self._tasks:  # a call that was mid-lookup may not start a flight any more
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._tasks.difference_update(tasks)
        async with self._start_lock:  # an embedded server still starting is stopped there
            pass
        if self._agent is not None and self._started:
            await self._agent.aclose()  # leaves the live set: invalidations stop waiting for it
        for conn in self._conns:
            await conn.aclose()
        if self._server is not None:
            await asyncio.to_thread(self._server.stop)

    async def __aenter__(self) -> FlightCache:
        await self._ready()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"FlightCache({safe_url(self.url)!r}, namespace={self.namespace!r})"
