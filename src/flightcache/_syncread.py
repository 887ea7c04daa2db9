"""The sync door's fast path: a call's first read in the caller's own thread (docs/sync.md).

On one plain server (``redis://``, ``rediss://``, ``unix://``, and ``embedded://`` once its
server runs), ``FlightCacheSync.do`` sends the same first read the async client sends, the
``join_flight`` script (packed ``EVALSHA``, the engine's own arguments and node id), on a
synchronous connection of this module's pool, from the calling thread. A hit is served
there and then: no thread hop. Anything else is handed, with the join's answer, to the loop
thread, which goes on from that answer exactly as after its own join (follow, own, or, when
no answer came back, the same join sent again with the same claim id): a miss still costs
two round trips on one server. The follower's waiter is made on the loop after the join, so
it is flagged as having missed messages and re-reads the flight's stream from the join's
position before it waits (docs/protocol.md, "The wake channel", point 5).

Everything else (a Cluster, a sharded list, Sentinel, ``memory://``, ``refresh``,
``refresh_ahead``, ``disabled()``, an outage that fail-open is answering) takes the loop
thread as before. The near cache is read here too, without a lock: one ``dict.get`` of an
immutable ``(deadline, bytes)`` pair, atomic under the GIL; nothing is written to it from
this thread (a lease is granted on the loop, by a callback, as of this read's send).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from redis import exceptions as rexc

from ._backends.scripts import pack_command
from ._codec import TAGGED_TAG
from ._errors import FlightError
from ._keys import FlightKeys, canonical, digest_of
from ._protocol.base import Flights, Opening
from ._protocol.context import wants_context
from ._protocol.flight import RedisFlights
from ._protocol.jobs import Job, LoaderJob
from ._protocol.state import FOLLOW, HIT, LUA, Handle, State, state_of
from ._protocol.tags import current
from ._syncgroup import Group, Groups
from ._syncpool import Busy, Counts, Packer, SyncLink
from ._types import MISSING, CacheState, CallOptions, FlightInfo, Loader

if TYPE_CHECKING:
    from ._cache import FlightCache

PLAIN = ("redis://", "rediss://", "unix://")  # one server, addressed directly
SUSPEND_S = 1.0  # after a connection failure here, calls take the loop thread for this long
MEMO = 10_000  # string keys whose digest is remembered (emptied when full)
CALL_MEMO = 2_000  # keys whose flight keys, options and encoded join are (about 4 KB each)
JOIN = LUA["join_flight"]
READ = LUA["read_result"]
# A key's flight keys, a call's options, and its join's arguments as last encoded.
Call = tuple[FlightKeys, CallOptions, list[tuple[Any, bytes]]]
UNTAKEN: Any = object()  # the fast path does not take this call: the loop thread does


class Joined:
    """The engine's ``Flights`` for one call whose first read was answered in the caller's
    thread: ``prepare`` hands out that call's handle (its claim id, the join's answer) and
    ``begin`` returns the answer (the waiter made now, flagged for a re-read of the stream
    from the join's position) instead of sending the join; without an answer, ``begin``
    sends the join with the same claim id."""

    def __init__(self, front: Flights, flights: RedisFlights, handle: Handle) -> None:
        self.front = front
        self.flights = flights
        self.handle = handle

    def attach(self, fk: FlightKeys, handle: Handle) -> None:
        """The waiter of a handle whose join was answered elsewhere: made after that join
        was sent, so any message published in between may be gone: flagged lost, the first
        wait re-reads the stream after the join's position (``Follower._news``)."""
        if handle.state is not None and handle.waiter is None:
            handle.waiter = self.flights.hub.watch(fk.digest)
            handle.waiter.lost()
            handle.waiter.mark = handle.gaps  # (a gap since the send: bound, it joins again)

    def prepare(self, fk: FlightKeys) -> Any:
        return self.handle

    async def begin(self, fk: FlightKeys, opts: CallOptions, handle: Any) -> Opening:
        if isinstance(handle, Handle) and handle.state is not None:
            self.attach(fk, handle)
            return Opening(None, handle=handle)
        return await self.front.begin(fk, opts, handle)  # no answer: the join, same claim id

    async def begin_many(self, fks: Any, opts: Any, handles: Any) -> Any:
        return await self.front.begin_many(fks, opts, handles)

    async def abandon(self, fk: FlightKeys, opts: CallOptions, handle: Any) -> None:
        await self.front.abandon(fk, opts, handle)

    def release(self, handle: Any) -> None:
        self.front.release(handle)

    async def lookup(self, fk: FlightKeys) -> bytes | None:
        return await self.front.lookup(fk)

    async def lookup_full(self, fk: FlightKeys) -> tuple[bytes | None, int, bool, int]:
        return await self.front.lookup_full(fk)

    async def resolve(
        self, fk: FlightKeys, job: Job, opts: CallOptions, handle: Any = None
    ) -> bytes:
        return await self.front.resolve(fk, job, opts, handle)

    async def inspect(self, fk: FlightKeys) -> FlightInfo:
        return await self.front.inspect(fk)


class FastPath:
    """The caller-thread reads of one engine (one ``FlightCache`` on its loop thread)."""

    def __init__(
        self, cache: FlightCache, loop: asyncio.AbstractEventLoop, flights: RedisFlights
    ) -> None:
        parts = cache._parts
        assert parts is not None
        self.cache = cache
        self.loop = loop
        self.flights = flights
        self.failopen = parts.failopen
        self.near = parts.near
        self.leaser = parts.leaser
        self.envelope = cache.envelope
        self.keyspace = cache.keyspace
        settings = cache._settings
        self.link = SyncLink(
            flights.conn.url,
            socket_timeout=settings.socket_timeout,
            max_connections=settings.max_connections,
            name=f"flightcache:{cache.node_id}:sync".replace(" ", "_"),
        )
        self.packer = Packer(JOIN.sha)
        self.groups = Groups()
        self.counts = Counts()
        self._claim_prefix = secrets.token_hex(8) + "-s"
        self._claims = itertools.count(1)  # next() is atomic under the GIL
        self._digests: dict[str, str] = {}
        self._calls: dict[tuple[Any, ...], Call] = {}
        self._suspended_until = 0.0

    @classmethod
    def of(cls, cache: FlightCache, loop: asyncio.AbstractEventLoop) -> FastPath | None:
        """The fast path of an opened cache on one plain server; None for any other."""
        parts = cache._parts
        if parts is None or len(parts.conns) != 1 or len(parts.redis_flights) != 1:
            return None
        flights = parts.redis_flights[0]
        conn = flights.conn
        if conn.cluster is not None or conn.sentinel is not None or not conn.url.startswith(PLAIN):
            return None
        if not flights.token_in_join or cache._front not in (flights, parts.failopen):
            return None
        return cls(cache, loop, flights)

    def close(self) -> None:
        self.link.close()

    # -- when it applies, and what a call reads --------------------------------------------

    def usable(self) -> bool:
        cache = self.cache
        if cache._disabled or cache._state is not CacheState.OPENED or cache._traced:
            return False  # (traced: the engine's do makes the call's span, on the loop)
        if self.failopen is not None and self.failopen.down:
            return False  # fail-open answers calls meanwhile, on the loop
        return time.monotonic() >= self._suspended_until

    def _digest(self, key: Any) -> str:
        if type(key) is str:
            digest = self._digests.get(key)
            if digest is None:
                if len(self._digests) >= MEMO:
                    self._digests.clear()
                digest = self._digests[key] = digest_of(canonical(key))
            return digest
        return digest_of(canonical(key))

    def _call(
        self,
        key: Any,
        digest: str,
        ttl: float | None,
        lease: float | None,
        timeout: float | None,
        store: bool,
    ) -> Call:
        """The flight's keys, the call's options (both immutable) and the encoding of its
        join's arguments, remembered."""
        memo = (digest, ttl, lease, timeout, store)
        known = self._calls.get(memo)
        if known is None:
            if len(self._calls) >= CALL_MEMO:
                self._calls.clear()
            opts = self.cache._options(canonical(key), ttl, lease, timeout, False, store)
            known = self._calls[memo] = (self.keyspace.for_digest(digest), opts, [])
        return known

    def _near(self, digest: str) -> bytes | None:
        """A near-cache copy whose lease holds: a read of one immutable pair, no lock, no
        write (the LRU order and the near cache's own counters are the loop's)."""
        near = self.near
        if near is None:
            return None
        entry = near._entries.get(digest)
        if entry is None or near.clock() >= entry[0]:
            return None
        return entry[1]

    def _join(self, call: Call, claim_id: str) -> tuple[Any, float]:
        """The reply of the call's ``join_flight`` and when it was written (None: no
        answer; the loop sends it again with the same claim id, and maps the failure as for
        any join)."""
        fk, opts, last = call
        keys, args = self.flights._join_call(fk, opts, "always", False, b"", claim_id)
        try:
            return self.link.timed(self.packer.evalsha(keys, args, last))
        except Busy:
            pass
        except (rexc.ConnectionError, rexc.TimeoutError, OSError):
            self._suspended_until = time.monotonic() + SUSPEND_S
        except rexc.RedisError:  # NOSCRIPT, WRONGTYPE, OOM...: the loop's join answers it
            pass
        return None, 0.0

    # -- do ------------------------------------------------------------------------------

    def do(
        self,
        key: Any,
        make_loader: Callable[[], Loader],
        *,
        ttl: float | None,
        lease: float | None,
        timeout: float | None,
        store: bool,
        not_found: tuple[type[BaseException], ...],
        tags: tuple[str, ...],
        bound: float,
    ) -> Any:
        """The call's value, or ``UNTAKEN`` when the loop thread must take the call.
        ``make_loader`` makes the engine's loader, for a call that needs one."""
        if not self.usable():
            return UNTAKEN
        digest = self._digest(key)
        data = self._near(digest)
        if data is not None:
            self.counts.hit()
            return self.envelope.decode(data, key=digest)
        group, lock = self.groups.enter(digest)
        if lock is not None:  # another thread of this process asks already
            self.counts.coalesce()
            return self.envelope.decode(group.wait(lock, bound), key=digest)
        try:
            call = self._call(key, digest, ttl, lease, timeout, store)

            def make_job() -> LoaderJob:
                loader = make_loader()
                job = LoaderJob(
                    loader,
                    self.envelope,
                    digest,
                    not_found,
                    key=key,
                    with_context=wants_context(loader),
                )
                if tags:
                    job.tag(tags, self.cache._gate())
                return job

            data = self._lead(group, call, make_job)
        except BaseException as exc:
            if not group.handed:  # else the loop settles it, for the threads still waiting
                self.groups.settle(group, exc)
            raise
        if data is not None:
            self.groups.settle(group, data)
            return self.envelope.decode(data, key=digest)
        return self.envelope.decode(group.wait(self.groups.waiting(group), bound), key=digest)

    def _lead(self, group: Group, call: Call, make_job: Callable[[], Job]) -> bytes | None:
        """This thread's first read: a hit read here (its bytes), or None: the call was
        handed to the loop thread, which settles ``group``."""
        fk, opts, _ = call
        claim_id = f"{self._claim_prefix}{next(self._claims):x}"
        leaser = self.leaser
        heard: Any = leaser.heard() if leaser is not None else None  # before the send
        gaps = self.flights.hub.gaps  # (read across threads: an int, only ever grows)
        try:
            reply, sent = self._join(call, claim_id)
        except BaseException:  # interrupted (Ctrl-C) mid-read: the join may have claimed
            # The loop sends it again with the same claim id and runs the flight for the
            # other threads of the group (and the cache); this thread leaves.
            self._hand_off(group, self._continue(fk, opts, Handle(fk.digest, claim_id), make_job))
            raise
        self.counts.command()
        if reply is not None and reply[0] == HIT and reply[1][:1] != TAGGED_TAG:
            # The hot path, read without building a State (state_of's HIT, join_flight.lua:
            # {1, value, ttl_left_ms, marked, cost_ms}): served here, as the join's caller
            # on the loop would serve it, and leased there if no invalidation marks it.
            data: bytes = reply[1]
            self.counts.hit()
            if leaser is not None and not reply[3] and reply[2] > 0:
                self.loop.call_soon_threadsafe(
                    leaser.grant, fk.digest, data, sent, int(reply[2]), heard
                )
            return data
        handle = Handle(fk.digest, claim_id)
        handle.gaps = gaps
        if reply is not None:
            state = state_of(reply, claim_id, sent)
            if state.kind == HIT:  # tagged: its tags' versions are read on the loop
                assert state.value is not None
                work = self._tagged(fk, opts, state.value, state, heard, make_job)
                self._hand_off(group, work)
                return None
            handle.state = state
        self._hand_off(group, self._continue(fk, opts, handle, make_job))
        return None

    def _hand_off(self, group: Group, work: Any) -> None:
        """Run ``work`` on the loop; its outcome settles ``group`` from the loop thread."""
        try:
            future = asyncio.run_coroutine_threadsafe(work, self.loop)
        except RuntimeError:  # the loop was closed by another thread's close()
            work.close()
            raise FlightError("this FlightCacheSync is closed") from None
        group.handed = True

        def settle(done: concurrent.futures.Future[bytes]) -> None:
            if done.cancelled():
                self.groups.settle(group, FlightError("this FlightCacheSync is closed"))
            elif (exc := done.exception()) is not None:
                self.groups.settle(group, exc)
            else:
                self.groups.settle(group, done.result())

        future.add_done_callback(settle)

    async def _continue(
        self, fk: FlightKeys, opts: CallOptions, handle: Handle, make_job: Callable[[], Job]
    ) -> bytes:
        """On the loop: the call from its first read's answer on, as ``FlightCache.do``
        goes on from its own join (local single-flight, flight task, leases)."""
        cache = self.cache
        cache._stats.calls += 1
        local = cache._local
        assert cache._front is not None
        joined = Joined(cache._front, self.flights, handle)

        def start(h: Any) -> Any:
            return local.fly(joined, fk, make_job(), opts, h)

        state = handle.state
        if fk.digest in local.slots and (state is None or state.kind != FOLLOW):
            # This call's join claimed the flight (or may have: no answer came back), and
            # another call of this key is under way here (an async one, or a refresh):
            # this one runs its own flight, which that one follows.
            joined.attach(fk, handle)
            try:
                return await start(handle)  # type: ignore[no-any-return]
            finally:
                # Its join took this node out of the flight's waiters, so the call under
                # way no longer hears its events: its waiters re-read the stream now.
                for waiter in list(self.flights.hub._waiters.get(fk.digest, ())):
                    waiter.lost()
        data, hit = await local.call(joined, fk, opts, track=False, start=start)
        if hit:
            cache._stats.hits += 1
        return data

    async def _tagged(
        self,
        fk: FlightKeys,
        opts: CallOptions,
        data: bytes,
        state: State,
        heard: Any,
        make_job: Callable[[], Job],
    ) -> bytes:
        """On the loop: a tagged hit, served if no invalidation of its tags overtook it
        (one read of their versions), else a flight, as ``FlightCache.do`` does."""
        cache = self.cache
        cache._stats.calls += 1
        local = cache._local
        checked = await current(local.tags, data)
        if checked is not None:
            value, tags = checked
            cache._stats.hits += 1
            if self.leaser is not None and state.leasable and state.ttl_left_ms > 0:
                self.leaser.grant(fk.digest, value, state.sent, state.ttl_left_ms, heard, tags)
            return value
        cache._stats.tag_stale += 1
        front = cache._front
        assert front is not None

        def start(h: Any) -> Any:  # a flight whose join finds it stale and refreshes
            return local.fly(front, fk, make_job(), opts, None)

        result, hit = await local.call(front, fk, opts, track=False, start=start)
        if hit:
            cache._stats.hits += 1
        return result

    # -- get -----------------------------------------------------------------------------

    def get(self, key: Any, run: Callable[[Any], Any]) -> Any:
        """``get``'s answer, or ``UNTAKEN``. ``run`` runs a coroutine on the loop (a tagged
        result's versions are read there)."""
        if not self.usable():
            return UNTAKEN
        digest = self._digest(key)
        data = self._near(digest)
        if data is not None:
            self.counts.get(hit=True, command=False)
            return self.envelope.decode(data, key=digest)
        fk = self.keyspace.for_digest(digest)
        leaser = self.leaser
        heard: Any = leaser.heard() if leaser is not None else None  # before the send
        try:
            if leaser is None:
                data = self.link.call(pack_command(b"GET", fk.result))
                sent, ttl_left_ms, leasable = 0.0, 0, False
            else:
                (data, ttl_left, marked, _), sent = self.link.timed(
                    pack_command(b"EVALSHA", READ.sha, 3, fk.result, fk.marker, fk.cost)
                )
                ttl_left_ms, leasable = int(ttl_left), not int(marked)
        except (rexc.ConnectionError, rexc.TimeoutError, OSError):
            self._suspended_until = time.monotonic() + SUSPEND_S
            return UNTAKEN
        except (Busy, rexc.RedisError):
            return UNTAKEN
        tags: tuple[str, ...] = ()
        if data is not None and data[:1] == TAGGED_TAG:
            checked = run(self._versions(data))
            if checked is None:
                self.counts.get(hit=False, command=True)
                return MISSING
            data, tags = checked
        if data is None or self.envelope.is_error(data):
            self.counts.get(hit=False, command=True)
            return MISSING
        if leaser is not None and leasable and ttl_left_ms > 0:
            self.loop.call_soon_threadsafe(
                leaser.grant, fk.digest, data, sent, ttl_left_ms, heard, tags
            )
        self.counts.get(hit=True, command=True)
        return self.envelope.decode(data, key=digest)

    async def _versions(self, data: bytes) -> tuple[bytes, tuple[str, ...]] | None:
        checked = await current(self.cache._local.tags, data)
        if checked is None:
            self.cache._stats.tag_stale += 1
        return checked
