"""The follower's side of a flight: wait for its events with no connection held.

Events arrive on the wake channel (``wakeup.py``): the entries the owner's scripts appended,
applied after the follower's cursor; a message out of step, or a gap in hearing, makes the
follower read its stream from the cursor instead. An owner that writes nothing (dead or
frozen) is found by the lease-bounded re-check (``rechecks.py``: one heap and timer for every
followed flight of a server; a ``peek_flight`` asks whether the claim followed still holds
the flight), and a ``join_flight`` in mode 'first' only when it does not.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .._errors import FlightTimeout
from .._keys import FlightKeys
from .._types import CallOptions
from .jobs import Job
from .rechecks import Rechecks
from .state import FOLLOW, State
from .wakeup import Entry, Waiter, entry_key

if TYPE_CHECKING:
    from .flight import RedisFlights

log = logging.getLogger("flightcache.follow")


class Follower:
    """Follows flights on one server for one ``RedisFlights`` (whose joins it sends)."""

    def __init__(self, flights: RedisFlights) -> None:
        self.flights = flights
        margin_s = flights.tuning.block_margin_ms / 1000
        self.rechecks = Rechecks(
            flights.conn, margin_s, flights.clock, flights.keyspace.session, flights.hub
        )

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
        last_id = state.last_id  # every event that can end this flight comes after it
        if not job.inline_ok and state.newest != state.last_id:
            # A stream with chunks appended before the join: read them at once. With none
            # (the join saw its claim entry as the newest), every later append publishes to
            # this node, queued in waiters by that same join: nothing to read back.
            waiter.lost()
        rechecks = self.rechecks
        # (the claim followed: its `claimed` entry, the join's `from_id`, then the last one)
        entry = rechecks.add(
            fk, state.last_id, waiter, state.lease_left_ms, opts.lease_ms, deadline, state
        )
        try:
            while True:
                sent = self.flights.clock()
                if sent >= deadline:
                    raise FlightTimeout(
                        f"no result within the wait bound of {opts.wait_bound_s:g} s",
                        key=fk.digest,
                    )
                await waiter.wait()
                due = waiter.take_due()
                if waiter.news:
                    flagged = waiter.gap
                    news = await self._news(fk, waiter, last_id)
                    if flagged and not news:
                        # A read of the stream that found nothing after the cursor: nothing
                        # came, or the stream lapsed with the end on it (this process stalled
                        # past its linger, with the message gone): the flight's own peek tells.
                        rechecks.soon(entry)
                    for entry_id, fields in news:
                        last_id = entry_id
                        kind = fields.get(b"t")
                        if kind == b"claimed":  # past our position: the owner we followed died
                            log.info("flight %s: claimed by %s", fk.digest, fields.get(b"n"))
                            job.on_claimed(entry_id)
                            rechecks.claimed(entry, entry_id)
                            continue
                        if kind == b"chunk":
                            job.on_chunk(int(fields[b"s"]), fields[b"v"])
                            continue
                        if kind in (b"done", b"error", b"reset"):
                            return await self._end(fk, job, opts, sent, entry_id, fields)
                    if news:  # the owner is alive: a whole lease before the next re-check
                        rechecks.later(entry, opts.lease_ms)
                if not due or self.flights.clock() >= deadline:
                    continue  # (the wait bound ran out: raised above)
                # The re-check found the claim we follow no longer holding the flight (or
                # could not ask): join again to learn whether it ended, was taken over or
                # fell vacant. While that claim still held it (renewed), nothing could have
                # been missed: its end would have deleted meta, a takeover changed its claim.
                rechecks.joining(entry)
                now = await self.flights._join(
                    fk, opts, "first", refresh=opts.refresh, since=last_id
                )
                if now.kind != FOLLOW:
                    return replace(now, since=last_id)
                job.on_follow(now.last_id)
                if entry_key(now.last_id) > entry_key(last_id):
                    last_id = now.last_id  # a later claim: its events start there
                rechecks.rejoined(entry, now)
        finally:
            rechecks.drop(entry)

    async def _end(
        self,
        fk: FlightKeys,
        job: Job,
        opts: CallOptions,
        sent: float,
        entry_id: bytes,
        fields: dict[bytes, bytes],
    ) -> bytes | State:
        """What an event that ends the followed flight (``done``, ``error``, ``reset``) gives
        its follower: the result, or the State of a join in mode 'first' (``reset``, or a
        result already gone)."""
        kind = fields.get(b"t")
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
        now = await self.flights._join(fk, opts, "first", refresh=opts.refresh, since=entry_id)
        return replace(now, since=entry_id)
