"""The renewers' queues: a wake-up takes exactly the leases due (by their own windows), wakes
at the earliest one held, and costs the leases due, not every lease held (docs/protocol.md,
"Batched renewals", "Which leases a tick takes").

No server: the book and the renewals' thread are driven with a batch function of the test's
own, which answers every renewal at once."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from flightcache._protocol.heartbeat import Lease, _Book
from flightcache._protocol.renewer_thread import ThreadRenewer


class _Plain(_Book):
    def _register(self, lease: Lease) -> None:
        self._admit(lease)


class RenewalQueues(RuleBasedStateMachine):
    """Leases of several lengths come, go, are renewed alone (a session between two slices),
    narrowed (bound to a session) and renewed in ticks, as a renewer would; each tick's take
    is compared with the definition: every lease held whose next renewal is due within its
    own window, and none other."""

    @initialize()
    def start(self) -> None:
        self.now = 100.0
        self.loop = asyncio.new_event_loop()
        self.book = _Plain(lambda: self.now)
        self.made: list[Lease] = []  # every lease made (kept: no id is reused)

    def teardown(self) -> None:
        self.loop.close()

    def _held(self) -> list[Lease]:
        return [lease for lease in self.made if id(lease) in self.book._leases]

    @rule(
        lease_s=st.sampled_from([0.3, 1.5, 3.0, 30.0]),
        bound=st.booleans(),
        alone=st.booleans(),
        back=st.floats(0, 2),
    )
    def add(self, lease_s: float, bound: bool, alone: bool, back: float) -> None:
        lease = self.book.add(
            self.loop.create_future(),
            lease_s=lease_s,
            digest=f"d{len(self.made)}",
            granted_at=self.now - back,
            tied=False,
            alone=alone,
            interval_s=lease_s / 2 if bound else None,
        )
        self.made.append(lease)

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        held = self._held()
        if held:
            self.book.remove(data.draw(st.sampled_from(held)))

    @rule(data=st.data(), window=st.floats(0.01, 0.5))
    def narrow(self, data: st.DataObject, window: float) -> None:
        """What ``shape_bound`` does to a lease bound after its claim."""
        held = self._held()
        if held:
            lease = data.draw(st.sampled_from(held))
            lease.window_s = min(lease.window_s, window)

    @rule(data=st.data())
    def renew_alone(self, data: st.DataObject) -> None:
        """A session renewed between two slices of a long batch, off the queues."""
        due = [x for x in self._held() if x.alone and x.next_due <= self.now]
        if due:
            data.draw(st.sampled_from(due)).next_due = self.now + 0.1

    @rule(dt=st.floats(0, 3))
    def wait(self, dt: float) -> None:
        self.now += dt

    @rule(data=st.data(), early=st.floats(0, 0.6))
    def wait_for_one(self, data: st.DataObject, early: float) -> None:
        """Until shortly before a lease's next renewal: inside windows, narrowed or not."""
        held = self._held()
        if held:
            lease = data.draw(st.sampled_from(held))
            self.now = max(self.now, lease.next_due - early)

    @rule(late=st.booleans(), limit=st.sampled_from([1, 3, 200]))
    def tick(self, late: bool, limit: int) -> None:
        """A tick, in slices of up to ``limit`` flights (the sessions due first in each;
        one held back may be due again), until a slice is not full."""
        book = self.book
        arrived, book._arrived = book._arrived, []
        kept = book._kept()
        due = book._next_due(arrived, kept)
        held = self._held()
        assert due == min((x.next_due for x in held), default=None)
        assert all(book._queues.values())  # no empty queue kept
        if due is None or due > self.now:
            return
        now = max(self.now, due)
        expected = {id(x) for x in held if x.next_due - now <= x.window_s}
        sessions = {id(x) for x in held if x.alone and id(x) in expected}
        ticked: list[Lease] = []  # queued again when the tick ends, as the thread does
        while True:
            taken = book._due(now, book._kept(), limit)
            assert all(x.next_due - now <= x.window_s for x in taken)
            flights = [x for x in taken if not x.alone]
            assert len(flights) <= limit
            if not ticked:
                assert {id(x) for x in taken if x.alone} == sessions  # first, all of them
            ticked += flights
            for lease in taken:  # settled: the next renewal one interval on (or held back)
                lease.next_due = now + (0.1 if late else lease.interval_s)
            if len(flights) < limit:
                break
        book._queue(ticked)
        assert len(ticked) == len({id(x) for x in ticked})  # each flight once a tick
        assert {id(x) for x in ticked} == expected - sessions

    @invariant()
    def every_flight_held_is_queued_at_or_before_its_renewal(self) -> None:
        if not hasattr(self, "book"):
            return
        if self.book._arrived:
            return  # (queued at the next tick, before anything is taken)
        entries: dict[int, float] = {}
        for queue in self.book._queues.values():
            for due, key in queue:
                entries[key] = min(due, entries.get(key, due))
        for lease in self._held():
            if lease.alone:
                assert id(lease) not in entries  # (looked at every time, not queued)
                continue
            assert entries.get(id(lease), float("inf")) <= lease.next_due


TestRenewalQueues = RenewalQueues.TestCase
TestRenewalQueues.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_a_lease_whose_window_narrowed_is_taken_by_its_own_and_stays_queued() -> None:
    """A flight bound after its claim has its window narrowed (``shape_bound``) while it
    sits in its old window's queue: a tick within the old window but not the new one leaves
    it for its own time, and it is taken then."""
    now = [10.0]
    loop = asyncio.new_event_loop()
    try:
        book = _Plain(lambda: now[0])
        first = book.add(loop.create_future(), lease_s=3.0, digest="a", tied=False)
        bound = book.add(loop.create_future(), lease_s=3.0, digest="b", granted_at=10.3, tied=False)
        arrived, book._arrived = book._arrived, []
        assert book._next_due(arrived, []) == 11.0  # (both queued, window 0.5)
        bound.window_s = 0.1
        now[0] = 11.0
        assert book._due(11.0, []) == [first]  # 11.3 is within 0.5, not within 0.1
        first.next_due = 12.0
        book._queue([first])
        assert book._next_due([], []) == 11.3
        now[0] = 11.3
        assert book._due(11.3, []) == [bound]
    finally:
        loop.close()


def _thread_cpu(renewer: ThreadRenewer) -> float:
    assert renewer._thread is not None and renewer._thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(renewer._thread.ident))


async def _cpu_per_tick(flights: int, ticks: int = 10) -> float:
    """CPU seconds of the renewals' thread per tick, over ``ticks`` ticks of one session
    lease (renewed alone every 150 ms), with ``flights`` leases held that fall due only long
    after."""
    warm, done = threading.Event(), threading.Event()
    goal = [3]  # the flights queued (once), the first ticks gone

    def renew(leases: Sequence[Lease], _patience: Callable[[], Any]) -> list[bool]:
        if renewer.batches >= goal[0]:
            (done if warm.is_set() else warm).set()
        return [True] * len(leases)

    renewer = ThreadRenewer(renew, name="test-renew")
    works = [asyncio.get_running_loop().create_future() for _ in range(flights + 1)]
    try:
        for i, work in enumerate(works[1:]):
            renewer.add(work, lease_s=60.0, digest=f"f{i}")
        renewer.add(works[0], lease_s=0.45, digest="session", alone=True)
        assert await asyncio.to_thread(warm.wait, 30)
        start, cpu = renewer.batches, _thread_cpu(renewer)
        goal[0] = start + ticks
        assert await asyncio.to_thread(done.wait, 30)
        return (_thread_cpu(renewer) - cpu) / (renewer.batches - start)
    finally:
        await renewer.aclose()
        for work in works:
            work.cancel()


async def test_a_renewal_tick_costs_the_leases_due_not_every_lease_held() -> None:
    """A session's tick with ten thousand flights held (none due) costs the renewals' thread
    about what it costs with a hundred: it looks at the leases due. (Scanning every lease
    held, as the thread did, was about a millisecond of Python a tick for ten thousand,
    the GIL held all along: the owner's loop stalled for it every session tick.)"""
    few = min([await _cpu_per_tick(100) for _ in range(2)])
    many = min([await _cpu_per_tick(10_000) for _ in range(2)])
    assert many < max(4 * few, 200e-6), (few, many)
