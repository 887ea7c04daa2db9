"""The lease-bounded re-checks of every flight a process follows on one server, on one timer.

A follower hears its flight's events on the wake channel (``wakeup.py``). Only an owner that
writes nothing (dead or frozen) must be found another way: once the lease the follower was
told of has run out (plus a margin and a spread), it asks whether the claim it follows still
holds the flight (``peek_flight``), and joins again only when it does not.

Those re-checks are kept here, for every followed flight of one server, in time slots of
``SLOT_S`` (one set of flights a slot, a heap of the slots) with one timer for the end of the
earliest slot, so the re-checks due within one slot go together. A flight's item leaves its
slot as soon as its follower is done, or moves when its re-check moves earlier, each in a
step of constant cost: nothing stale is left to be swept out later. When the timer fires,
the flights due are peeked together, one write out at a time, several flights a script
call, and the answers are applied here: a claim that still holds only moves its flight's
next re-check to when the lease it has left runs out, with no wake-up of its follower; a
follower is woken only when its claim no longer holds, its peek failed, or its wait bound
ran out, and it then joins again itself. So following ten thousand flights for a long time
costs an item a flight, and a share of a script call a flight and
lease: no timer, task, future, command or wake-up of a coroutine per flight and lease.
(Each of those, ten thousand at once since one owner renews its leases in one batch, kept
every wake message behind them waiting for hundreds of milliseconds.) docs/protocol.md
("Why no wake-up is lost", point 4).

A flight bound to its owner's session (docs/protocol.md, "Sessions") lives while that
session holds its epoch, so its followers watch the session instead (a :class:`Watch`): one
``peek_sessions`` a session and lease, however many of its flights are followed, and a peek
of each flight only when meta's own TTL (the backstop) ran out; after a gap of the wake
channel, a join of each. docs/protocol.md ("Followers watch sessions").
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._backends.redis import RedisConnection
from .._backends.scripts import Script
from .._keys import FlightKeys
from .pipelined import Call, script_batches, script_calls
from .state import LUA, State
from .wakeup import Waiter, WakeHub

log = logging.getLogger("flightcache.follow")

# A re-check comes up to this share of the lease (and at most RECHECK_SPREAD_MAX_S) after the
# lease's end, drawn for each wait: one owner renews all its leases in one batch, so the
# leases its flights have left end together, and so would ten thousand re-checks.
RECHECK_SPREAD = 0.1
RECHECK_SPREAD_MAX_S = 0.25


@dataclass(slots=True, eq=False)
class Recheck:
    """One followed flight: the claim its follower follows and when to re-check it."""

    fk: FlightKeys
    claim: bytes  # the stream id of the followed claim's `claimed` entry
    waiter: Waiter
    lease_ms: int  # the call's lease: the spread of its re-checks
    deadline: float  # the call's wait bound: its follower is woken then
    due: float = 0.0  # the next re-check (of a bound flight: once meta's own TTL ran out)
    queued: int = -1  # the slot its item is in, if it has one (else -1)
    at: float = 0.0  # when that item comes up
    peeking: bool = False  # its peek is out: the answer queues it again
    gone: bool = False
    watch: Watch | None = None  # the session the flight is bound to, watched


@dataclass(slots=True, eq=False)
class Watch:
    """A session that followed flights are bound to: their liveness, re-checked once a
    lease for all of them (``peek_sessions``)."""

    key: str  # the owner node's session key
    epoch: bytes
    lease_ms: int  # the spread of its re-checks
    flights: set[Recheck] = field(default_factory=set)
    deadline: float = math.inf
    due: float = 0.0  # once the session's TTL last heard ran out
    queued: int = -1
    at: float = 0.0
    peeking: bool = False
    gone: bool = False


class Rechecks:
    """The re-checks of every flight this process follows on one server."""

    SLOT_S = 0.01  # the re-checks due within one slot go together, at its end
    PEEK_WRITE = 200  # flights a write: the due ones beyond go in the next
    PEEK_CALL = 200  # flights a script call on one server

    def __init__(
        self,
        conn: RedisConnection,
        margin_s: float,
        clock: Callable[[], float],
        session_key: Callable[[str], str],
        hub: WakeHub,
    ) -> None:
        self._conn = conn
        self._margin_s = margin_s
        self._clock = clock
        self._session_key = session_key  # a node id's session key on this server
        # A slot's items (a dict for its order-free set with O(1) removal); the slots that
        # have items, or had since their number was pushed, in a heap of their numbers.
        self._slots: dict[int, dict[Recheck | Watch, None]] = {}
        self._heap: list[int] = []
        self._queued = 0  # items in the slots: one a followed flight or watched session
        self._watches: dict[tuple[str, bytes], Watch] = {}
        self._hub = hub  # its gaps: a peek answered across one is old; a bind across one, too
        hub.gap_hooks.append(self.gap)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._sender: asyncio.Task[None] | None = None
        self.peeks = 0  # flights peeked, for tests and the bench
        self.peek_calls = 0  # script calls that carried them
        self.woken = 0  # followers woken to join again
        self.session_peeks = 0  # sessions peeked

    def __len__(self) -> int:
        """Queued items: one a followed flight and a watched session (none is left behind
        by a flight that ended or whose re-check moved)."""
        return self._queued

    def add(
        self,
        fk: FlightKeys,
        claim: bytes,
        waiter: Waiter,
        lease_left_ms: int,
        lease_ms: int,
        deadline: float,
        state: State | None = None,
    ) -> Recheck:
        """Re-check ``claim`` once the ``lease_left_ms`` a join was told of ran out; a
        flight that join found bound to its owner's session (``state``), once meta's own
        TTL ran out, its session watched meanwhile."""
        entry = Recheck(fk, claim, waiter, lease_ms, deadline)
        if state is not None and state.bound:
            entry.due = self._after(state.own_left_ms, lease_ms)
            self._bind(entry, state.owner_node, state.bound, lease_left_ms)
        else:
            entry.due = self._after(lease_left_ms, lease_ms)
        self._push(entry, min(entry.due, deadline))
        return entry

    def soon(self, entry: Recheck) -> None:
        """Peek the flight itself at the next round, bound or not (its follower's read of the
        stream could not tell whether it ended)."""
        self._reschedule(entry, self._clock())

    def joining(self, entry: Recheck) -> None:
        """The follower sends a join now: the gaps it must not have missed count from here."""
        entry.waiter.mark = self._hub.gaps

    def later(self, entry: Recheck, lease_left_ms: int) -> None:
        """The owner was heard from: the next re-check comes once ``lease_left_ms`` from now
        ran out (for an unbound flight; a bound one's liveness is its session's, watched).
        An earlier heap item is moved when it comes up; a peek out now keeps the later of
        its answer and this."""
        if entry.watch is None:
            self._reschedule(entry, self._after(lease_left_ms, entry.lease_ms))

    def rejoined(self, entry: Recheck, state: State) -> None:
        """A join found the flight running (again, or under another claim): follow the claim
        it told of, bound or not, as ``add`` does."""
        entry.claim = state.last_id
        if state.bound:
            self._bind(entry, state.owner_node, state.bound, state.lease_left_ms)
            self._reschedule(entry, self._after(state.own_left_ms, entry.lease_ms))
        else:
            self._unbind(entry)
            self._reschedule(entry, self._after(state.lease_left_ms, entry.lease_ms))

    def claimed(self, entry: Recheck, claim: bytes) -> None:
        """A takeover's ``claimed`` event was heard: its binding is not known until the next
        peek tells it, so the flight is re-checked on its own lease until then."""
        entry.claim = claim
        self._unbind(entry)

    def drop(self, entry: Recheck) -> None:
        """The follower is done: its item leaves its slot now (a flight that ends at once
        must not be kept for a lease, with its waiter, by a busy process)."""
        entry.gone = True
        self._unbind(entry)
        self._unqueue(entry)

    def gap(self) -> None:
        """The wake channel had a gap (its connection dropped, or it subscribed anew): the
        follower of every bound flight joins again. A message lost in the gap is found by
        its read of the stream; a flight that vanished without one (a failover to a replica
        that lacks it), or a waiters list that lost this node (a failover that lost its
        join: the end would not be published to it), only by a join, which finds the flight
        gone or puts the node back in the list; its session's liveness says nothing of
        either. A peek answered across the gap counts for nothing."""
        for watch in list(self._watches.values()):
            for entry in list(watch.flights):
                self._unbind(entry)
                self._wake(entry)

    def _reschedule(self, entry: Recheck, due: float) -> None:
        entry.due = due
        at = min(due, entry.deadline)
        if not entry.peeking and (entry.queued == -1 or at < entry.at):
            self._push(entry, at)

    def _bind(self, entry: Recheck, node: bytes, epoch: bytes, session_left_ms: int) -> bool:
        """``entry``'s flight is bound to ``node``'s session ``epoch``: watch it (a session
        watched already keeps its own re-check: what it heard last is the earlier bound).
        Only if the wake channel had no gap since the join the follower follows was sent:
        else this node may be missing from the flight's waiters list (a failover or restart
        lost its join) or the follower may have missed the end (a message lost in the gap,
        the stream gone by the time it reads), and a watched session would tell of neither;
        its follower is woken to join again instead (False)."""
        if entry.waiter.mark != self._hub.gaps:
            self._unbind(entry)
            self._wake(entry)
            return False
        key = self._session_key(node.decode())
        watch = entry.watch
        if watch is not None and watch.key == key and watch.epoch == epoch:
            return True
        self._unbind(entry)
        watch = self._watches.get((key, epoch))
        if watch is None:
            watch = self._watches[(key, epoch)] = Watch(key, epoch, entry.lease_ms)
            watch.due = self._after(session_left_ms, watch.lease_ms)
            self._push(watch, watch.due)
        watch.flights.add(entry)
        entry.watch = watch
        return True

    def _unbind(self, entry: Recheck) -> None:
        watch = entry.watch
        if watch is None:
            return
        entry.watch = None
        watch.flights.discard(entry)
        if not watch.flights:  # no flight followed is bound to it: no more re-checks
            self._retire(watch)

    def _retire(self, watch: Watch) -> None:
        watch.gone = True
        if self._watches.get((watch.key, watch.epoch)) is watch:
            del self._watches[(watch.key, watch.epoch)]
        self._unqueue(watch)

    def _after(self, lease_left_ms: int, lease_ms: int) -> float:
        spread_s = min(lease_ms / 1000 * RECHECK_SPREAD, RECHECK_SPREAD_MAX_S)
        return self._clock() + lease_left_ms / 1000 + self._margin_s + random.random() * spread_s

    def _slot(self, at: float) -> int:
        return math.floor(at / self.SLOT_S)

    def _push(self, entry: Recheck | Watch, at: float) -> None:
        """Queue ``entry``'s re-check for ``at``, in the slot of ``at`` (out of the slot it
        was in: moved earlier)."""
        self._unqueue(entry)
        slot = self._slot(at)
        items = self._slots.get(slot)
        if items is None:
            items = self._slots[slot] = {}
            heapq.heappush(self._heap, slot)  # (a number once in the heap at a time)
        items[entry] = None
        entry.queued, entry.at = slot, at
        self._queued += 1
        self._arm()

    def _unqueue(self, entry: Recheck | Watch) -> None:
        """Take ``entry``'s item out of its slot, if it has one. A slot left empty stays
        until its number comes up (its number is in the heap): it is one a ``SLOT_S`` of
        time ahead at most, and a flight queued in it again needs no second number."""
        if entry.queued == -1:
            return
        items = self._slots.get(entry.queued)
        if items is not None and items.pop(entry, 0) is None:
            self._queued -= 1
        entry.queued = -1

    def _arm(self) -> None:
        """One timer, for the end of the earliest slot with items (none while the sender
        runs: it arms it when done). A timer up to a slot later still stands: a hundred
        flights followed in one turn do not replace it a hundred times."""
        if self._sender is not None:
            return
        heap, slots = self._heap, self._slots
        while heap and not slots[heap[0]]:  # emptied by drops: nothing to fire for
            del slots[heapq.heappop(heap)]
        if not heap:
            return
        # a hair past the slot's end, so the clock read when it fires is past it too
        at = (heap[0] + 1.01) * self.SLOT_S
        if self._timer is not None:
            if self._timer_at <= at + self.SLOT_S:
                return
            self._timer.cancel()
        self._timer_at = at
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(max(at - self._clock(), 0.0), self._fire)

    def _fire(self) -> None:
        self._timer = None
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(self._send_due())

    async def _send_due(self) -> None:
        """The peeks of every flight and session due, ``PEEK_WRITE`` a write, one write out
        at a time."""
        try:
            while True:
                flights, watches = self._take_due()
                if not flights and not watches:
                    return
                await self._peek(flights, watches)
        finally:
            self._sender = None
            self._arm()

    def _take_due(self) -> tuple[list[Recheck], list[Watch]]:
        """Up to ``PEEK_WRITE`` flights and sessions whose re-check is due now (their slot
        ended); flights whose wait bound ran out are woken instead (their followers
        raise)."""
        now = self._clock()
        current = self._slot(now)  # the slots before it ended: their items' times < now
        heap, slots = self._heap, self._slots
        flights: list[Recheck] = []
        watches: list[Watch] = []
        while heap and heap[0] < current and len(flights) + len(watches) < self.PEEK_WRITE:
            items = slots[heap[0]]
            if not items:
                del slots[heapq.heappop(heap)]
                continue
            entry = items.popitem()[0]
            self._queued -= 1
            entry.queued = -1
            at = min(entry.due, entry.deadline)
            if at > now:  # heard from meanwhile: its re-check moved later (to a slot not
                self._push(entry, at)  # ended, so not this one)
            elif isinstance(entry, Watch):
                entry.peeking = True
                watches.append(entry)
            elif now >= entry.deadline:
                self._wake(entry)
            else:
                entry.peeking = True
                flights.append(entry)
        return flights, watches

    async def _peek(self, flights: list[Recheck], watches: list[Watch]) -> None:
        gaps = self._hub.gaps
        answers = await asyncio.gather(
            self._send(flights), self._send_sessions(watches), return_exceptions=True
        )
        replies: list[list[Any]] = []
        for answer, count in zip(answers, (len(flights), len(watches)), strict=True):
            if isinstance(answer, BaseException):  # unreachable or refused: join and learn
                if not isinstance(answer, Exception):
                    raise answer
                log.info("lease re-check of %d flights or sessions failed: %s", count, answer)
                answer = [answer] * count
            replies.append(answer)
        gapped = gaps != self._hub.gaps  # the answers may be older than the gap: peek again
        for watch, reply in zip(watches, replies[1], strict=True):
            watch.peeking = False
            if watch.gone:
                continue
            if type(reply) is int and reply > 0:  # still holds its epoch, renewed
                watch.due = self._after(reply, watch.lease_ms)
                self._push(watch, watch.due)
            else:  # lapsed or replaced (for good), or the peek failed: every flight bound
                self._retire(watch)  # to it joins again
                for entry in list(watch.flights):
                    entry.watch = None
                    if not entry.gone:
                        self._wake(entry)
                watch.flights.clear()
        now = self._clock()
        for entry, reply in zip(flights, replies[0], strict=True):
            entry.peeking = False
            if entry.gone:
                continue
            if gapped and not isinstance(reply, Exception):
                self._push(entry, min(now, entry.deadline))
            elif type(reply) is int and reply > 0:  # the claim still holds, renewed
                self._unbind(entry)
                entry.due = max(entry.due, self._after(reply, entry.lease_ms))
                self._push(entry, min(entry.due, entry.deadline))
            elif isinstance(reply, list) and int(reply[0]) > 0:  # holds, bound to a session
                own, node, epoch, session_left = reply
                if self._bind(entry, node, epoch, int(session_left)):
                    entry.due = max(entry.due, self._after(int(own), entry.lease_ms))
                    self._push(entry, min(entry.due, entry.deadline))
            else:  # ended, lapsed or claimed anew (or the peek failed): the follower joins,
                self._wake(entry)  # and queues it again with what the join told

    async def _send(self, due: list[Recheck]) -> list[Any]:
        """Each flight's answer while its claim holds (the lease it has left, in ms; for a
        bound flight a list, ``peek_flight.lua``), else -1; or the error that failed its
        call. ``peek_flight`` calls of up to ``PEEK_CALL`` flights (one slot a call on a
        Cluster), all in one round trip (one per node of a Cluster)."""
        if not due:
            return []
        self.peeks += len(due)
        cluster = self._conn.cluster is not None
        groups = script_batches(due, lambda entry: entry.fk.meta, cluster, self.PEEK_CALL)
        calls = [([e.fk.meta for e in group], [e.claim for e in group]) for group in groups]
        answers = await self._answers(LUA["peek_flight"], groups, calls)
        self.peek_calls += len(calls)
        return answers

    async def _send_sessions(self, due: list[Watch]) -> list[Any]:
        """Each session's TTL left while it holds the epoch watched, else -1
        (``peek_sessions``, up to ``PEEK_CALL`` sessions a call; one server only)."""
        if not due:
            return []
        self.session_peeks += len(due)
        groups = script_batches(due, lambda watch: watch.key, False, self.PEEK_CALL)
        calls = [([w.key for w in group], [w.epoch for w in group]) for group in groups]
        return await self._answers(LUA["peek_sessions"], groups, calls)

    async def _answers(
        self, lua: Script, groups: Sequence[Sequence[Any]], calls: Sequence[Call]
    ) -> list[Any]:
        """One answer per item of ``groups``, in order: its call's, or the error that failed
        that call (for every item of it); all calls in one round trip."""
        replies = await script_calls(self._conn, lua, calls)
        out: list[Any] = []
        for group, reply in zip(groups, replies, strict=True):
            out += reply if isinstance(reply, list) else [reply] * len(group)
        return out

    def _wake(self, entry: Recheck) -> None:
        self.woken += 1
        entry.waiter.recheck()

    async def aclose(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._slots.clear()
        self._heap.clear()
        self._queued = 0
        self._watches.clear()
        sender = self._sender
        if sender is not None:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
