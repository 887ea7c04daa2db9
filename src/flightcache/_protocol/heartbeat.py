"""The owner's heartbeats: every lease renewed every ``lease/3`` while its loader runs.

One renewer per server renews the leases of all the flights this process owns there
together: when the earliest renewal is due, every lease due by then or within half its own
interval goes out in one batch (one pipeline of multi-flight scripts), so renewal cost grows
with servers, not flights. Each lease is bound to its loader task in both directions: it
leaves the renewer when the loader ends, and when a renewal finds another token (or the
lease cannot be proven for a whole lease) it cancels that loader at once, the "suicide"
rule that keeps a stale owner from working on. A batch answers per flight, so exactly the
flights whose token was refused are cancelled.

:class:`Renewer` renews on the caller's loop (a Cluster's renewals, or a clock a test
drives); ``renewer_thread.ThreadRenewer`` on a thread of its own (one server). Both keep
their leases in the :class:`_Book` here.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import operator
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from .._errors import FlightError
from .._waits import within

log = logging.getLogger("flightcache.heartbeat")

RETRY_FRACTION = 1.0  # after a failed batch, retry one interval later (as a lone heartbeat did)


class Lease:
    """One owned flight's lease in a renewer; ``lost`` tells whether it gave up."""

    __slots__ = (
        "_work",
        "alone",
        "args",
        "digest",
        "full",
        "full_every",
        "interval_s",
        "lease_s",
        "lost",
        "next_due",
        "on_give_up",
        "packed",
        "proven_until",
        "reason",
        "refused",
        "renewals",
        "since_full",
        "window_s",
    )

    def __init__(
        self,
        work: asyncio.Future[Any],
        lease_s: float,
        digest: str,
        granted_at: float,
        args: Any,
        full_every: int = 0,
    ) -> None:
        self._work = work
        self.lease_s = lease_s
        self.interval_s = lease_s / 3
        # A renewal due within this much goes with a batch sent earlier (so leases renewed
        # together stay together); at most half the interval.
        self.window_s = self.interval_s / 2
        self.digest = digest
        self.args = args  # what the renewer's batch function needs (keys, token, ...)
        # The lease is proven until one lease after the claim was sent (the server started
        # it later than that, so this end comes no later than the server's).
        self.proven_until = granted_at + lease_s
        self.next_due = granted_at + self.interval_s
        self.lost = False
        self.reason = ""
        # Given up because the server refused its renewal: the token holds nothing there
        # any more, so there is nothing to give back (docs/protocol.md, "A lease given up
        # is given back").
        self.refused = False
        self.alone = False  # renewed in a batch of its own, first (a session)
        self.renewals = 0
        self.on_give_up: Callable[[], None] | None = None  # told first (the loader's context)
        self.packed: Any = None  # the batch function's, made once (its keys and args in RESP)
        # Renewals are full (the flight's other keys too, not only its lease) at least every
        # `full_every` + 1 sends: see take_full. The first is full.
        self.full_every = full_every
        self.since_full = full_every
        self.full = True

    def take_full(self) -> bool:
        """Whether the renewal being sent now is full, told by the batch function as it
        builds it: a short one follows at most ``full_every`` short ones sent since the last
        full one was answered (a short one sent and not answered counts: it may have run;
        a full one not answered does not end the count: the next is full again)."""
        self.full = self.since_full >= self.full_every
        if not self.full:
            self.since_full += 1
        return self.full

    def give_up(self, reason: str) -> None:
        """On the loader's loop: the lease is lost, its loader is cancelled."""
        if self._work.done():
            return  # it ended meanwhile: nothing to stop (its writes were fenced)
        self.lost = True
        self.reason = reason
        log.warning("flight %s: lease lost (%s); cancelling the loader", self.digest, reason)
        if self.on_give_up is not None:
            self.on_give_up()
        self._work.cancel()


class _Book:
    """The leases of one renewer and what a batch does to them, whoever sends it."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._leases: dict[int, Lease] = {}
        self._alone: dict[int, Lease] = {}  # those renewed alone (a session or two)
        # When each flight's lease falls due: a heap of (next_due, id) per window length, so
        # a wake-up looks at the leases due, not at every lease held (docs/protocol.md,
        # "Which leases a tick takes"). A lease's next renewal only ever moves later, so an
        # entry at or before it is met in time; an entry met early is put back at the
        # lease's time, an entry of a lease gone is dropped. Leases registered wait in
        # `_arrived` until the renewer queues them (the thread's queues are its own: a
        # registration only appends). Those renewed alone are looked at every time.
        self._queues: dict[float, list[tuple[float, int]]] = {}
        self._arrived: list[Lease] = []
        self.batches = 0

    def __len__(self) -> int:
        return len(self._leases)

    def add(
        self,
        work: asyncio.Future[Any],
        *,
        lease_s: float,
        digest: str,
        granted_at: float | None = None,
        args: Any = None,
        tied: bool = True,
        full_every: int = 0,
        alone: bool = False,
        interval_s: float | None = None,
    ) -> Lease:
        """Renew a lease of ``lease_s`` (granted at ``granted_at``) while ``work`` runs, and
        cancel ``work`` when it is lost; ``args``: what the batch function needs. With
        ``tied``, the lease is removed when ``work`` ends; without, the caller removes it.
        ``full_every``: short renewals allowed between full ones (``Lease.take_full``).
        ``alone``: renewed in a batch of its own, ahead of the others and between their
        slices (a session, which keeps many flights: a long batch of flights must not make
        it wait, nor its proof wait for theirs). ``interval_s``: renewed this often instead of
        every third of the lease (a bound flight's own keys: every half of the backstop)."""
        granted_at = self._clock() if granted_at is None else granted_at
        lease = Lease(work, lease_s, digest, granted_at, args, full_every)
        lease.alone = alone
        if interval_s is not None:
            lease.interval_s = interval_s
            lease.window_s = min(lease.window_s, interval_s / 2)
            lease.next_due = granted_at + interval_s
        if tied:
            work.add_done_callback(lambda _f: self.remove(lease))
        self._register(lease)
        return lease

    def _register(self, lease: Lease) -> None:
        raise NotImplementedError

    def _admit(self, lease: Lease) -> None:
        """Book ``lease`` (under the renewer's lock, if it has one)."""
        self._leases[id(lease)] = lease
        if lease.alone:
            self._alone[id(lease)] = lease
        else:
            self._arrived.append(lease)

    def remove(self, lease: Lease) -> None:
        """The lease needs no more renewals (its loader ended); a batch already on the wire
        may still renew it once, which is harmless, and its answer is ignored. Its loader's
        context is no longer told of a give-up: that breaks the reference cycle between
        the two, so a flight's objects are freed when it ends, not by a full cyclic GC."""
        self._forget(lease)
        lease.on_give_up = None

    def _forget(self, lease: Lease) -> None:
        """Unbook ``lease`` (under the renewer's lock, if it has one); its queue entry, if
        any, is dropped when met."""
        self._leases.pop(id(lease), None)
        self._alone.pop(id(lease), None)

    def _give_up(self, lease: Lease, reason: str) -> None:
        self._forget(lease)
        lease.give_up(reason)

    def _kept(self) -> list[Lease]:
        """The leases renewed alone (a copy: under the renewer's lock, if it has one)."""
        return [lease for key, lease in self._alone.items() if key in self._leases]

    def _queue(self, leases: Iterable[Lease]) -> None:
        """Queue ``leases`` (arrived, or back from a batch) at their next renewal, those
        still held (and not renewed alone: those are not queued)."""
        held = self._leases
        for lease in leases:
            key = id(lease)
            if held.get(key) is lease and not lease.alone:
                queue = self._queues.get(lease.window_s)
                if queue is None:
                    queue = self._queues[lease.window_s] = []
                heapq.heappush(queue, (lease.next_due, key))

    def _next_due(self, arrived: list[Lease], kept: Sequence[Lease]) -> float | None:
        """When the earliest lease held falls due (None: none is held), with ``arrived``
        (taken from ``_arrived``) queued first; ``kept``: those renewed alone (``_kept``).
        Entries met early are put back at their lease's time, entries of leases gone
        dropped: each entry is met once a renewal."""
        self._queue(arrived)
        held = self._leases
        moved: list[Lease] = []  # due later than their entry (an id reused by a later lease)
        dues: list[float] = []
        for window, queue in list(self._queues.items()):
            while queue:
                due, key = queue[0]
                lease = held.get(key)
                if lease is not None and lease.next_due <= due:
                    dues.append(due)
                    break
                heapq.heappop(queue)
                if lease is not None:
                    moved.append(lease)
            if not queue:  # (leases of many lengths come and go: no empty queue is kept)
                del self._queues[window]
        self._queue(moved)
        dues += [lease.next_due for lease in moved]
        dues += [lease.next_due for lease in kept if id(lease) in held]
        return min(dues, default=None)

    def _due(self, now: float, kept: Sequence[Lease], limit: float = math.inf) -> list[Lease]:
        """Every lease due by ``now`` (a busy process may be late: all the late ones go in
        this batch) and those due within their window (half their interval, or less): those
        of ``kept`` first, then up to ``limit`` flights' (the others are taken next time),
        taken off the queues: the renewer queues them again once the batch is settled
        (``_queue``, whatever became of it). Looks at those leases only, and at entries
        due within each queue's window."""
        held = self._leases
        taken = [x for x in kept if x.next_due - now <= x.window_s and id(x) in held]
        limit += len(taken)
        seen: set[int] = set()
        later: list[Lease] = []
        for window, queue in self._queues.items():
            horizon = now + window
            while queue and queue[0][0] <= horizon and len(taken) < limit:
                _, key = heapq.heappop(queue)
                lease = held.get(key)
                if lease is None or key in seen:
                    continue  # its loader ended, or it was queued twice
                seen.add(key)
                if lease.next_due - now <= lease.window_s:
                    taken.append(lease)
                else:  # not due yet: its renewal moved later, or its window narrowed
                    later.append(lease)
        self._queue(later)
        return taken

    def _lapse(self, batch: Sequence[Lease], reason: str) -> list[Lease]:
        """Give up every lease of ``batch`` whose proof ran out; the ones left."""
        now = self._clock()
        left = []
        for lease in batch:
            if id(lease) not in self._leases:
                continue  # its loader ended meanwhile
            if now >= lease.proven_until:
                self._give_up(lease, f"no renewal for a whole lease: {reason}")
            else:
                left.append(lease)
        return left

    def _waiting(self, waiting: list[Lease]) -> tuple[list[Lease], float | None]:
        """The leases of a batch (by ``proven_until``) still waiting for its answer, and how
        long more to wait for it (None: none is). A renewal still unanswered when a lease
        runs out proves nothing for that lease: it is given up then, while the others wait
        on for the same answer."""
        now = self._clock()
        lapsed = 0  # (sorted by proof: the lapsed ones lead, and only they are looked at)
        while lapsed < len(waiting) and (
            now >= waiting[lapsed].proven_until or id(waiting[lapsed]) not in self._leases
        ):
            lapsed += 1
        if lapsed:
            self._lapse(waiting[:lapsed], "no answer")
            waiting = waiting[lapsed:]
        if not waiting:
            return waiting, None
        return waiting, max(waiting[0].proven_until - now, 0.001)

    def _failed(self, batch: Sequence[Lease], exc: Exception) -> None:
        for lease in self._lapse(batch, repr(exc)):
            log.info("flight %s: renewal failed, retrying: %r", lease.digest, exc)
            lease.next_due = self._clock() + lease.interval_s * RETRY_FRACTION

    def _settle(self, batch: Sequence[Lease], answers: Sequence[bool], sent: float) -> None:
        if len(answers) != len(batch):
            raise ValueError(f"{len(answers)} answers for {len(batch)} renewals")
        leases = self._leases
        for lease, ok in zip(batch, answers, strict=True):
            if id(lease) not in leases:
                continue  # its loader ended, or it was given up, while the batch was out
            if not ok:
                lease.refused = True  # (before the give-up is scheduled on the loader's loop)
                self._give_up(lease, "another owner holds the flight, or the lease lapsed")
                continue
            lease.renewals += 1
            if lease.full:
                lease.since_full = 0
            lease.proven_until = sent + lease.lease_s
            lease.next_due = sent + lease.interval_s


_PROVEN_UNTIL = operator.attrgetter("proven_until")
_LEASE_S = operator.attrgetter("lease_s")

RenewBatch = Callable[[Sequence[Lease]], Awaitable[Sequence[bool]]]


class Renewer(_Book):
    """Renews every registered lease on time, in batches, with one task of the caller's
    loop."""

    def __init__(self, renew: RenewBatch, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock)
        self._renew = renew
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def _register(self, lease: Lease) -> None:
        self._admit(lease)
        self._changed.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while self._leases:
            now = self._clock()
            arrived, self._arrived = self._arrived, []
            kept = self._kept()
            due = self._next_due(arrived, kept)
            if due is None:
                break  # (the leases ended meanwhile)
            if due > now:
                self._changed.clear()
                try:  # a new lease may be due sooner: look again when one arrives
                    await within(self._changed.wait(), due - now)  # heartbeat interval
                    continue
                except asyncio.TimeoutError:
                    pass  # the timer says `due` has come, whatever the clock reads
            batch = self._due(max(self._clock(), due), kept)
            try:
                if batch:  # (empty when the leases due ended while we waited)
                    await self._renew_batch(batch)
            finally:
                self._queue(batch)

    async def _renew_batch(self, batch: list[Lease]) -> None:
        self.batches += 1
        sent = self._clock()
        reply = asyncio.ensure_future(self._renew(batch))
        waiting = sorted(batch, key=_PROVEN_UNTIL)
        try:
            while True:
                waiting, limit = self._waiting(waiting)
                if limit is None:
                    return
                done, _ = await asyncio.wait({reply}, timeout=limit)  # a lease's proof
                if done:
                    break
            answers = reply.result()
        except FlightError as exc:
            self._failed(waiting, exc)
            return
        finally:
            if not reply.done():
                reply.cancel()
                await asyncio.gather(reply, return_exceptions=True)
        self._settle(batch, answers, sent)


class Heartbeat:
    """One lease renewed alone by ``renew`` (a renewer of its own): for tests and for a
    backend without batching. ``lost`` and ``reason`` as for :class:`Lease`."""

    def __init__(
        self,
        renew: Callable[[], Awaitable[bool]],
        work: asyncio.Future[Any],
        *,
        lease_s: float,
        digest: str,
        granted_at: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        async def one(batch: Sequence[Lease]) -> list[bool]:
            return [await renew() for _ in batch]

        self._renewer = Renewer(one, clock)
        self._work = work
        self._params = (lease_s, digest, granted_at)
        self._lease: Lease | None = None

    def start(self) -> Heartbeat:
        lease_s, digest, granted_at = self._params
        self._lease = self._renewer.add(
            self._work, lease_s=lease_s, digest=digest, granted_at=granted_at
        )
        return self

    @property
    def lost(self) -> bool:
        return self._lease is not None and self._lease.lost

    @property
    def reason(self) -> str:
        return self._lease.reason if self._lease is not None else ""

    @property
    def renewals(self) -> int:
        return self._lease.renewals if self._lease is not None else 0

    async def stop(self) -> None:
        if self._lease is not None:
            self._renewer.remove(self._lease)
        await self._renewer.aclose()
