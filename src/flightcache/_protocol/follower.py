"""The follower's side of a flight: wait for its events with no connection held.

Events arrive on the wake channel (``wakeup.py``): the entries the owner's scripts appended,
applied after the follower's cursor; a message out of step, or a gap in hearing, makes the
follower read its stream from the cursor instead. An owner that writes nothing (dead or
frozen) is found by the lease-bounded re-check: a ``peek_flight`` (does the claim it follows
still hold the flight? the peeks of one turn of the loop go out in one write), and a
``join_flight`` in mode 'first' only when it does not.
"""

from __future__ import annotations

import functools
import logging
import random
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .._errors import FlightTimeout
from .._keys import FlightKeys
from .._types import CallOptions
from .jobs import Job
from .pipelined import Together
from .state import FOLLOW, LUA, State
from .wakeup import Entry, Waiter, entry_key

if TYPE_CHECKING:
    from .flight import RedisFlights

log = logging.getLogger("flightcache.follow")

# A lease re-check comes up to this share of the lease (and at most RECHECK_SPREAD_MAX_S)
# after the lease's end, drawn for each wait: one owner renews all its leases in one batch,
# so the leases its flights have left end together, and the followers of ten thousand such
# flights would all re-check in one turn of the loop (a stall of ~100 ms every renewal
# interval, which every wake message arriving then waits out).
RECHECK_SPREAD = 0.1
RECHECK_SPREAD_MAX_S = 0.25


class Follower:
    """Follows flights on one server for one ``RedisFlights`` (whose joins it sends)."""

    def __init__(self, flights: RedisFlights) -> None:
        self.flights = flights
        self._peeks = Together(flights.conn, LUA["peek_flight"])

    def _recheck_at(self, lease_left_ms: int, opts: CallOptions) -> float:
        """When a waiter told of ``lease_left_ms`` re-checks the owner if it hears nothing:
        once that lease ran out, plus the margin, plus its draw of the spread."""
        spread_s = min(opts.lease_ms / 1000 * RECHECK_SPREAD, RECHECK_SPREAD_MAX_S)
        margin_s = self.flights.tuning.block_margin_ms / 1000
        return self.flights.clock() + lease_left_ms / 1000 + margin_s + random.random() * spread_s

    async def _peek(self, fk: FlightKeys, claim: bytes) -> int:
        """The lease left (ms) while the claim whose ``claimed`` entry is ``claim`` still
        holds the flight, else -1."""
        return int(await self._peeks.call([fk.meta], [claim]))

    async def _read_after(self, fk: FlightKeys, cursor: bytes) -> list[Entry]:
        """The flight's stream after ``cursor``: what a follower missed (one short command
        per ``fetch_count`` entries)."""
        client = self.flights.conn.client
        entries: list[Entry] = []
        while True:
            batch: Any = await self.flights.conn.run(
                functools.partial(
                    client.xrange,
                    fk.stream,
                    b"(" + cursor,
                    b"+",
                    count=self.flights.tuning.fetch_count,
                ),
                fk,
            )
            entries += batch
            if len(batch) < self.flights.tuning.fetch_count:
                return entries
            cursor = batch[-1][0]

    async def _news(self, fk: FlightKeys, waiter: Waiter, cursor: bytes) -> list[Entry]:
        """The entries after ``cursor`` that the waiter's messages tell of, in order; the
        stream itself is read when a message is out of step or one may have been lost."""
        gap, messages = waiter.take()
        if gap:
            return await self._read_after(fk, cursor)
        at = entry_key(cursor)
        news: list[Entry] = []
        for prev, entries in messages:
            if entries and entry_key(entries[-1][0]) <= at:
                continue  # nothing after the cursor
            if not entries or entry_key(prev) > at:
                # A bare hint, or an entry between the cursor and `prev` never arrived: what
                # the earlier messages told, then the stream itself from there.
                return news + await self._read_after(fk, cursor)
            for entry in entries:
                if entry_key(entry[0]) > at:
                    news.append(entry)
            at = entry_key(entries[-1][0])
            cursor = entries[-1][0]
        return news

    async def follow(
        self,
        fk: FlightKeys,
        job: Job,
        state: State,
        opts: CallOptions,
        deadline: float,
        waiter: Waiter,
    ) -> bytes | State:
        """Wait for the flight's events until it ends; a State when the flight fell vacant.

        Events arrive on the wake channel (or, after a gap, from a read of the stream), and
        only those after the position the join saw are applied, so every event is about
        this flight: only writes under the then-current token reach the stream (the scripts
        are fenced), so no token needs checking here. No connection is held while waiting.
        """
        recheck_at = self._recheck_at(state.lease_left_ms, opts)
        last_id = state.last_id  # every event that can end this flight comes after it
        claim = state.last_id  # the `claimed` entry of the claim followed
        if not job.inline_ok:
            waiter.lost()  # a stream: chunks appended before the join are read at once
        while True:
            sent = self.flights.clock()
            if sent >= deadline:
                raise FlightTimeout(
                    f"no result within the wait bound of {opts.wait_bound_s:g} s", key=fk.digest
                )
            if await waiter.wait(max(min(recheck_at, deadline) - sent, 0.001)):
                news = await self._news(fk, waiter, last_id)
                for entry_id, fields in news:
                    last_id = entry_id
                    kind = fields.get(b"t")
                    if kind == b"claimed":  # past our position: the owner we followed died
                        log.info("flight %s: claimed by %s", fk.digest, fields.get(b"n"))
                        job.on_claimed(entry_id)
                        claim = entry_id
                        continue
                    if kind == b"chunk":
                        job.on_chunk(int(fields[b"s"]), fields[b"v"])
                        continue
                    if kind == b"done":
                        count = fields.get(b"n")
                        if count is not None and job.has_all(int(count)):
                            return b""  # a stream: every chunk is here already
                        value = fields.get(b"v")
                        if value is None:
                            value = await self.flights.lookup(fk)
                        elif b"x" in fields:  # stored: a near cache may lease it
                            job.lease = (sent, int(fields[b"x"]))
                            job.cost_ms = int(fields.get(b"c", 0)) or None
                        if value is not None:
                            return bytes(value)
                        # the result is gone already (evicted, or a tiny TTL): start over
                        return await self.flights._join(fk, opts, "always", refresh=opts.refresh)
                    if kind == b"error":
                        return bytes(fields.get(b"v", b""))
                    if kind == b"reset":
                        now = await self.flights._join(
                            fk, opts, "first", refresh=opts.refresh, since=entry_id
                        )
                        return replace(now, since=entry_id)
                if news:  # the owner is alive: a whole lease before the next re-check
                    recheck_at = self._recheck_at(opts.lease_ms, opts)
                continue
            if self.flights.clock() >= deadline:
                continue  # the wait bound, not the lease, ran out
            # The wait ran out with no event: is the owner still alive? While the claim we
            # follow still holds the flight (renewed), nothing can have been missed: its end
            # would have deleted meta, a takeover would have changed its claim.
            left_ms = await self._peek(fk, claim)
            if left_ms > 0:
                recheck_at = self._recheck_at(left_ms, opts)
                continue
            now = await self.flights._join(fk, opts, "first", refresh=opts.refresh, since=last_id)
            if now.kind != FOLLOW:
                return replace(now, since=last_id)
            job.on_follow(now.last_id)
            claim = now.last_id
            if entry_key(now.last_id) > entry_key(last_id):
                last_id = now.last_id  # a later claim: its events start there
            recheck_at = self._recheck_at(now.lease_left_ms, opts)
