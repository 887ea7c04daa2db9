"""The owner's renewals on a thread of its own (one server): a :class:`ThreadRenewer` renews
with a blocking connection of its own, so a busy event loop (ten thousand calls starting at
once) cannot delay the renewals past the leases; Kafka's consumers learned the same (KIP-62
moved their heartbeats to a thread). A loop that stops running altogether (blocked,
deadlocked) must not keep its flights forever, so the loop pulses every ``PULSE_S`` while
it owns flights, and a lease is renewed only while the last pulse is younger than
``STALL_FRACTION`` of it (docs/protocol.md, "Lease renewals"). The leases' book, and what a
batch's answers do to them, are ``heartbeat.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

from .._errors import FlightError
from .heartbeat import _LEASE_S, _PROVEN_UNTIL, Lease, _Book

log = logging.getLogger("flightcache.heartbeat")

PULSE_S = 0.1  # the caller's loop shows it runs this often while it owns flights
STALL_FRACTION = 2 / 3  # of a lease: a loop silent this long gets no more renewals
# The thread takes at most this many flights' leases at a time: a long tick goes out in
# slices, one after another, each proven from its own send, with the leases kept alone (a
# session) that fell due renewed first in each. A slice's picking and settling hold the GIL
# (1,000 due leases off the queues were 3 to 10 ms of Python); its scripts free it as they
# wait for their answers, so a loop's thread waiting for it gets it between two slices.
SLICE = 200


# A thread's batch: the leases, and how long more to wait for the answer (asked again each
# time that runs out; None: nobody needs it any more).
SyncRenewBatch = Callable[[Sequence[Lease], Callable[[], "float | None"]], Sequence[bool]]


class ThreadRenewer(_Book):
    """Renews every registered lease on time, in batches, from a thread of its own (started
    with the first lease, stopped by :meth:`aclose`), with a blocking ``renew``. A lease is
    given up (its loader cancelled) on the loader's own loop."""

    def __init__(self, renew: SyncRenewBatch, name: str = "flightcache-renew") -> None:
        super().__init__(time.monotonic)
        self._renew = renew
        self._name = name
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._pulsed = self._clock()
        self._pulse: asyncio.TimerHandle | None = None
        # When the thread looks at the leases next, if it sleeps (under the lock): a lease
        # due before that wakes it; one due later waits for that look (a wake-up per
        # registration would take the GIL from the loop thousands of times a second).
        self._wake_at = math.inf

    def _register(self, lease: Lease) -> None:
        with self._lock:
            self._admit(lease)
            if lease.next_due < self._wake_at:
                self._lock.notify()
            if self._thread is None:
                self._closing = False
                self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
                self._thread.start()
        if self._pulse is None:
            self._beats()

    def remove(self, lease: Lease) -> None:
        with self._lock:
            super().remove(lease)

    def _beats(self) -> None:
        """The caller's loop runs: renewals go on (it says so every ``PULSE_S`` while it owns
        any flight)."""
        self._pulsed = self._clock()
        self._pulse = None
        if self._leases:
            self._pulse = asyncio.get_running_loop().call_later(PULSE_S, self._beats)

    def _give_up(self, lease: Lease, reason: str) -> None:  # on the renewals' thread
        with self._lock:
            self._forget(lease)
        with contextlib.suppress(RuntimeError):  # (its loop closed: nothing runs to stop)
            lease._work.get_loop().call_soon_threadsafe(lease.give_up, reason)

    async def aclose(self) -> None:
        if self._pulse is not None:
            self._pulse.cancel()
            self._pulse = None
        with self._lock:
            thread, self._thread = self._thread, None
            self._closing = True
            self._lock.notify()
        if thread is not None:
            thread.join(5)  # at once, or when the batch on the wire is answered

    def _main(self) -> None:
        tick: float | None = None  # a tick still being taken, slice by slice: its time
        ticked: list[Lease] = []  # its leases taken so far: queued again when it ends
        while True:
            # The queues are this thread's: a registration only appends to `_arrived`, and
            # a wake-up looks at the leases due, not at every lease held.
            with self._lock:
                if self._closing:
                    self._queue(ticked)  # (kept for a thread started after this one)
                    return
                arrived, self._arrived = self._arrived, []
                kept = self._kept()  # (a session or two)
            now = self._clock()
            due = self._next_due(arrived, kept)
            if tick is None and (due is None or due > now):
                with self._lock:
                    if self._closing:
                        return
                    if not self._arrived:  # (else they are queued first)
                        self._wake_at = math.inf if due is None else due
                        # no flight owned: until one is; else the heartbeat interval
                        self._lock.wait(None if due is None else due - now)
                        self._wake_at = -math.inf  # busy: it looks again before it sleeps
                continue
            if tick is None:
                tick = max(now, due or now)
            # A lease removed meanwhile may still be renewed once: harmless (remove()).
            taken = self._due(tick, kept, SLICE)
            ticked += taken
            ended = True
            try:
                batch = self._hold_if_stalled(taken)
                if kept:  # (a session first, in a batch of its own)
                    self._renew_batch([lease for lease in batch if lease.alone])
                    batch = [lease for lease in batch if not lease.alone]
                self._renew_batch(batch)
                ended = len(taken) - sum(lease.alone for lease in taken) < SLICE
            finally:
                if ended:  # (those still held, at their next renewal)
                    self._queue(ticked)
                    tick, ticked = None, []

    def _hold_if_stalled(self, batch: list[Lease]) -> list[Lease]:
        """The leases of ``batch`` to renew: none whose loader's loop has not run for
        ``STALL_FRACTION`` of its lease (they lapse, and are given up once their proof runs
        out: a stopped loop keeps no flight from a takeover)."""
        stalled = self._clock() - self._pulsed
        if not batch or stalled <= min(map(_LEASE_S, batch)) * STALL_FRACTION:
            return batch  # (the loop ran lately: no lease is held, nothing to look at)
        held = [lease for lease in batch if stalled > lease.lease_s * STALL_FRACTION]
        if not held:
            return batch
        for lease in self._lapse(held, f"the event loop has not run for {stalled:.1f} s"):
            lease.next_due = self._clock() + PULSE_S  # look again soon
        return [lease for lease in batch if stalled <= lease.lease_s * STALL_FRACTION]

    def _renew_batch(self, batch: list[Lease]) -> None:
        if not batch:
            return
        self.batches += 1
        sent = self._clock()
        waiting = sorted(batch, key=_PROVEN_UNTIL)

        def patience() -> float | None:
            nonlocal waiting
            waiting, limit = self._waiting(waiting)
            return None if self._closing else limit

        try:
            answers = self._renew(batch, patience)
        except FlightError as exc:
            self._failed(waiting, exc)
            return
        except Exception as exc:  # abandoned (nobody waits), or a bug: not this thread's end
            if waiting and not self._closing:
                log.warning("lease renewal failed: %r", exc)
                self._failed(waiting, FlightError(repr(exc)))
            return
        self._settle(batch, answers, sent)
