"""This process's side of every flight: one lookup and one flight per key at a time.

Callers in one process that ask for the same key share one server round trip and one
flight (local single-flight). The first caller looks the key up in its own task (a hit
costs no task and no future); on a miss the flight runs in a task of its own, so that no
caller's cancellation can stop it for the others, and every caller of the key waits on its
slot's future. Refresh calls coalesce among themselves, under a table key of their own
(``<digest>!``): a refresh must not ride on a plain call's lookup. ``stream`` does the same
for streams, with one ``LocalStream`` per key.

A read may be leased into the near cache (``Leases``: the ``Leaser`` of ``_leases/near.py``)
and its expiry noted for refresh-ahead (``Expiries``: ``RefreshAhead`` of
``_protections/ahead.py``); both are handed in, so this room imports neither.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol

from .._codec import TAGGED_TAG, Envelope
from .._errors import FlightError
from .._keys import FlightKeys
from .._types import CallOptions, Stats
from .base import Flights
from .jobs import Job, LoaderJob
from .localstreams import LocalStreams
from .observed import COALESCED, CallRecord
from .streaming import LocalStream
from .tags import TagGate, current, untag

STALE_ROUNDS = 5  # flights in a row whose tags were invalidated before one is current

log = logging.getLogger("flightcache.near")


class Leases(Protocol):
    """Grants near-cache leases on values read from the server."""

    def heard(self) -> Any:
        """What the node knew when a read was sent (invalidations heard, its liveness),
        handed back to ``grant`` with the reply."""
        ...

    def grant(
        self,
        digest: str,
        data: bytes,
        sent: float,
        ttl_left_ms: int,
        heard: Any,
        tags: tuple[str, ...] = (),
    ) -> None: ...


class Expiries(Protocol):
    """Keeps the expiry and cost of values read, for refresh-ahead."""

    running: set[str]  # the digests being refreshed now

    def saw(self, digest: str, sent: float, ttl_left_ms: int, cost_ms: int | None) -> None: ...

    def settled(self, digest: str) -> None:
        """Another process refreshed the value already."""
        ...


class _Slot:
    """One key's entry in the local single-flight table.

    Each caller that waits for the slot's outcome gets a future of its own (made only then,
    so an uncontended hit costs no future and no scheduled callback): a caller cancelled
    cancels only its own, and the outcome reaches each of the others with one wake-up (no
    shield around a shared future, which costs three more callbacks per caller).
    """

    __slots__ = ("_waiters", "key")

    def __init__(self, key: str) -> None:
        self.key = key  # its key in the table: the digest, with "!" for refresh calls
        self._waiters: list[asyncio.Future[bytes]] = []

    @property
    def waited_on(self) -> bool:
        """Whether a caller still waits for the outcome."""
        return any(not fut.done() for fut in self._waiters)

    def wait(self) -> asyncio.Future[bytes]:
        """A future of the caller's own for the slot's outcome."""
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        return fut

    def settle(self, outcome: bytes | BaseException) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if fut.done():
                continue  # its caller left (cancelled)
            if isinstance(outcome, BaseException):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)


class LocalFlights(LocalStreams):
    """The single-flight tables of one cache, and the tasks that run its flights.

    ``ready`` gives the cache's ``Flights`` once it is connected (or raises if closed);
    ``leases`` is set when the cache connects with a near cache.
    """

    def __init__(
        self,
        stats: Stats,
        envelope: Envelope,
        ready: Callable[[], Awaitable[Flights]],
        expiries: Expiries,
    ) -> None:
        self.stats = stats
        self.envelope = envelope
        self.ready = ready
        self.expiries = expiries
        self.leases: Leases | None = None
        self.tags: TagGate | None = None  # set when the cache connects
        self.slots: dict[str, _Slot] = {}
        self.streams: dict[str, LocalStream] = {}
        self.tasks: set[asyncio.Task[Any]] = set()
        self.closed = False

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` in a task of its own, cancelled (and awaited) by :meth:`aclose`."""
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def aclose(self) -> None:
        """Cancel every flight, stream and refresh of this process, and wait for them."""
        self.closed = True
        while self.tasks:  # a call that was mid-lookup may not start a flight any more
            tasks = list(self.tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.tasks.difference_update(tasks)

    # -- reads and flights ---------------------------------------------------------------

    async def lookup(self, flights: Flights, fk: FlightKeys, track: bool = False) -> bytes | None:
        """The stored result (never a flight: ``get``); with a near cache, also leased when
        it may be, and with ``track``, its expiry noted for refresh-ahead."""
        leases = self.leases
        if leases is None and not track:
            data = await flights.lookup(fk)
            if data is not None and data[:1] == TAGGED_TAG:
                checked = await self._current(data)
                return checked[0] if checked is not None else None
            return data
        heard = leases.heard() if leases is not None else 0
        sent = time.monotonic()
        data, ttl_left_ms, leasable, cost_ms = await flights.lookup_full(fk)
        tags: tuple[str, ...] = ()
        if data is not None and data[:1] == TAGGED_TAG:
            checked = await self._current(data)
            if checked is None:
                return None
            data, tags = checked
        self._saw(fk, data, sent, ttl_left_ms, leasable, cost_ms, heard, track, tags)
        return data

    async def _current(self, data: bytes) -> tuple[bytes, tuple[str, ...]] | None:
        """A tagged result's value and tags if no invalidation of its tags overtook it."""
        checked = await current(self.tags, data)
        if checked is None:
            self.stats.tag_stale += 1
        return checked

    def _saw(
        self,
        fk: FlightKeys,
        data: bytes | None,
        sent: float,
        ttl_left_ms: int,
        leasable: bool,
        cost_ms: int,
        heard: Any,
        track: bool,
        tags: tuple[str, ...] = (),
    ) -> None:
        """A result read from the server: leased into the near cache when it may be, and
        with ``track``, its expiry noted for refresh-ahead."""
        if data is None:
            return
        if leasable and self.leases is not None:
            self.leases.grant(fk.digest, data, sent, ttl_left_ms, heard, tags)
        if track:
            self.expiries.saw(fk.digest, sent, ttl_left_ms, cost_ms)

    def fly(
        self, flights: Flights, fk: FlightKeys, job: Job, opts: CallOptions, handle: Any = None
    ) -> Coroutine[Any, Any, bytes]:
        """The flight of a value, to run: what the server leased with the result is kept.

        Invalidations heard are counted now, before the flight's first read, so no lease is
        granted on a value that an invalidation may have overtaken.
        """
        heard = self.leases.heard() if self.leases is not None else 0
        return self._fly(flights, fk, job, opts, heard, handle)

    async def _fly(
        self,
        flights: Flights,
        fk: FlightKeys,
        job: Job,
        opts: CallOptions,
        heard: Any,
        handle: Any = None,
    ) -> bytes:
        result = await flights.resolve(fk, job, opts, handle)
        tags: tuple[str, ...] = ()
        if result[:1] == TAGGED_TAG:
            result, tags = await self._fresh(flights, fk, job, opts, result)
        if job.lease is not None:
            sent, ttl_ms = job.lease
            self.expiries.saw(fk.digest, sent, ttl_ms, job.cost_ms)
            if self.leases is not None:
                self.leases.grant(fk.digest, result, sent, ttl_ms, heard, tags)
        return result

    async def _fresh(
        self, flights: Flights, fk: FlightKeys, job: Job, opts: CallOptions, result: bytes
    ) -> tuple[bytes, tuple[str, ...]]:
        """A tagged flight result's value and tags, if no invalidation of its tags overtook
        it; else the flight again with the stored result not counting (``refresh``), until
        one is current. This process's own run is current for its callers: its versions
        were read after they asked. Its lease counts from that read (unknown: no lease)."""
        for _ in range(STALE_ROUNDS):
            if isinstance(job, LoaderJob) and result is job.made:
                if job.versions_read is None:
                    job.lease = None
                elif job.lease is not None:
                    job.lease = (min(job.lease[0], job.versions_read), job.lease[1])
                return untag(result)[1], job.tags
            checked = await self._current(result)
            if checked is not None:
                return checked
            job.lease = None
            opts = dataclasses.replace(opts, refresh=True)
            result = await flights.resolve(fk, job, opts, None)
            if result[:1] != TAGGED_TAG:
                return result, ()
        raise FlightError(
            f"the tags of this key were invalidated during {STALE_ROUNDS} reads in a row",
            key=fk.digest,
        )

    def refresh(self, fk: FlightKeys, job: LoaderJob, opts: CallOptions) -> None:
        """Recompute the value of ``fk`` in the background (refresh-ahead)."""
        self.expiries.running.add(fk.digest)
        self.stats.refreshes_ahead += 1
        self.spawn(self._refresh(fk, job, opts))

    async def _refresh(self, fk: FlightKeys, job: LoaderJob, opts: CallOptions) -> None:
        try:
            flights = await self.ready()
            await self.fly(flights, fk, job, opts)
            if job.lease is None:  # the join found the value refreshed by another process
                self.expiries.settled(fk.digest)
        except Exception as exc:  # the current value stays; a caller will try again
            log.info("refresh-ahead of %s failed: %r", fk.digest, exc)
        finally:
            self.expiries.running.discard(fk.digest)

    async def call(
        self,
        flights: Flights,
        fk: FlightKeys,
        opts: CallOptions,
        *,
        track: bool,
        start: Callable[[Any], Coroutine[Any, Any, bytes]],
        record: CallRecord | None = None,
    ) -> tuple[bytes, bool]:
        """The result for ``fk``, and whether it is a hit of this caller's own first read.

        Joins the read or flight of this key already under way in this process, else sends
        the call's first read (``Flights.begin``: on a server, the join itself, which may
        claim the flight), and when nothing is stored runs ``start(handle)`` in a task.
        ``record``: a traced call's, told when it joins another caller's.
        """
        table_key = fk.digest + "!" if opts.refresh else fk.digest
        slot = self.slots.get(table_key)
        if slot is not None:  # local single-flight: this process already asks the server
            self.stats.coalesced += 1
            if record is not None:
                record.role = COALESCED
            return await slot.wait(), False
        slot = _Slot(table_key)
        self.slots[table_key] = slot
        # The first read in the caller's own task (a hit costs no task and no future).
        handle = flights.prepare(fk)
        heard = self.leases.heard() if self.leases is not None else 0
        sent = time.monotonic()
        try:
            opening = await flights.begin(fk, opts, handle)
        except asyncio.CancelledError:
            if slot.waited_on:  # others wait for this read: the flight goes on for them
                self._start(slot, fk, functools.partial(start, handle))
            else:  # nobody else asked: no loader runs for nobody, a claim is given back
                self._settle(slot, asyncio.CancelledError())
                self.spawn(flights.abandon(fk, opts, handle))
            raise
        except BaseException as exc:
            self._settle(slot, exc)
            raise
        data = opening.data
        tags: tuple[str, ...] = ()
        if data is not None and data[:1] == TAGGED_TAG:
            try:
                checked = await self._current(data)
            except asyncio.CancelledError:
                if slot.waited_on:  # others wait: a flight settles it for them
                    self._start(slot, fk, functools.partial(start, None))
                else:
                    self._settle(slot, asyncio.CancelledError())
                raise
            except BaseException as exc:
                self._settle(slot, exc)
                raise
            if checked is None:  # stale: a flight, whose join finds it stale and refreshes
                outcome = slot.wait()
                self._start(slot, fk, functools.partial(start, None))
                return await outcome, False
            data, tags = checked
        if data is not None:
            self._saw(
                fk,
                data,
                sent,
                opening.ttl_left_ms,
                opening.leasable,
                opening.cost_ms,
                heard,
                track,
                tags,
            )
            self._settle(slot, data)
            return data, True
        outcome = slot.wait()  # made before the flight can settle the slot
        self._start(slot, fk, functools.partial(start, opening.handle))
        return await outcome, False

    async def call_many(
        self,
        flights: Flights,
        fks: Sequence[FlightKeys],
        opts: Sequence[CallOptions],
        start: Callable[[int, Any], Coroutine[Any, Any, bytes]],
    ) -> tuple[list[bytes | BaseException], int]:
        """``call`` for several distinct keys (``do_many``): each key's outcome (its result,
        or the error that ended its call) and the number of hits of this call's own reads.

        Keys another call of this process asks for already are waited for; the first reads
        of the others are sent together (``Flights.begin_many``), and each key that found
        nothing stored gets a flight task of its own from ``start(i, handle)``, ``i`` its
        index in ``fks`` (``opts`` has each key's options, in the same order).
        """
        outcomes: dict[int, asyncio.Future[bytes]] = {}
        mine: list[tuple[int, _Slot]] = []
        for i, fk in enumerate(fks):
            table_key = fk.digest + "!" if opts[i].refresh else fk.digest
            slot = self.slots.get(table_key)
            if slot is not None:  # local single-flight: this process asks already
                self.stats.coalesced += 1
                outcomes[i] = slot.wait()
                continue
            slot = self.slots[table_key] = _Slot(table_key)
            mine.append((i, slot))
        handles = [flights.prepare(fks[i]) for i, _ in mine]
        heard = self.leases.heard() if self.leases is not None else 0
        sent = time.monotonic()
        try:
            openings = await flights.begin_many(
                [fks[i] for i, _ in mine], [opts[i] for i, _ in mine], handles
            )
        except asyncio.CancelledError:
            for (i, slot), handle in zip(mine, handles, strict=True):
                if slot.waited_on:  # others wait for this read: the flight goes on for them
                    self._start(slot, fks[i], functools.partial(start, i, handle))
                else:
                    self._settle(slot, asyncio.CancelledError())
                    self.spawn(flights.abandon(fks[i], opts[i], handle))
            raise
        except BaseException as exc:
            for _, slot in mine:
                self._settle(slot, exc)
            raise
        results: dict[int, bytes | BaseException] = {}
        hits = 0
        for (i, slot), opening in zip(mine, openings, strict=True):
            if isinstance(opening, BaseException):
                self._settle(slot, opening)
                results[i] = opening
            elif opening.data is not None and opening.data[:1] != TAGGED_TAG:
                self._saw(
                    fks[i],
                    opening.data,
                    sent,
                    opening.ttl_left_ms,
                    opening.leasable,
                    opening.cost_ms,
                    heard,
                    False,
                )
                self._settle(slot, opening.data)
                results[i] = opening.data
                hits += 1
            else:  # a miss, or a tagged result its flight checks (or computes again)
                outcomes[i] = slot.wait()  # made before the flight can settle the slot
                handle = opening.handle if opening.data is None else None
                self._start(slot, fks[i], functools.partial(start, i, handle))
        if outcomes:
            order = list(outcomes)
            answers = await asyncio.gather(*(outcomes[i] for i in order), return_exceptions=True)
            results.update(zip(order, answers, strict=True))
        return [results[i] for i in range(len(fks))], hits

    def _start(
        self, slot: _Slot, fk: FlightKeys, start: Callable[[], Coroutine[Any, Any, bytes]]
    ) -> None:
        """Run the flight in a task of its own, so no caller's cancellation can stop it."""
        if self.closed:
            self._settle(slot, FlightError("the FlightCache was closed", key=fk.digest))
            return
        task = asyncio.ensure_future(start())
        self.tasks.add(task)
        # (a partial, not a closure: fewer objects a flight for the collector to walk)
        task.add_done_callback(functools.partial(self._finish, slot, fk))

    def _finish(self, slot: _Slot, fk: FlightKeys, t: asyncio.Task[bytes]) -> None:
        self.tasks.discard(t)
        if t.cancelled():
            self._settle(slot, FlightError("the FlightCache was closed", key=fk.digest))
        elif (exc := t.exception()) is not None:
            self._settle(slot, exc)
        else:
            self._settle(slot, t.result())

    def _settle(self, slot: _Slot, outcome: bytes | BaseException) -> None:
        if self.slots.get(slot.key) is slot:
            del self.slots[slot.key]
        slot.settle(outcome)
