"""Threads of one process asking for one key at once share one call (docs/sync.md).

The sync door's own single-flight table, in front of the engine's: the first thread to ask
for a key leads (it sends the read, and hands a miss to the loop thread); the others wait on
a lock of their own until the call settles, and each decodes its own copy. When it settles,
the waiting threads are woken a few at a time: the loop thread (or the leader) wakes the
first ``AHEAD``, and each woken thread, as soon as it runs, wakes the next, keeping
``AHEAD`` woken ahead of it. The loop thread's part is a lock release or two, not one task
and one ``concurrent.futures.Future`` per thread; fifty threads released at once would all
contend for the GIL with the loop thread among them, and a strict chain (one ahead) stalls
whenever its next thread is slow to be scheduled.
"""

from __future__ import annotations

import collections
import threading

from ._errors import FlightTimeout

AHEAD = 2  # threads woken ahead of the running one: one late to run does not stall the rest


class Waiter:
    """One waiting thread's lock, and whether the chain reached it (``woken``) or it left
    (``gone``), both under the group's ``baton``."""

    __slots__ = ("gone", "lock", "woken")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.woken = False
        self.gone = False


class Group:
    """One key's call under way in this process, and the threads waiting for its outcome."""

    __slots__ = ("baton", "digest", "handed", "outcome", "waiters", "woken")

    def __init__(self, digest: str) -> None:
        self.digest = digest
        self.waiters: collections.deque[Waiter] = collections.deque()
        self.outcome: bytes | BaseException | None = None
        self.baton = threading.Lock()
        self.woken = 0  # threads woken that have not run yet
        self.handed = False  # the call went to the loop thread, which settles the group

    def wake_next(self, ran: bool) -> None:
        """Keep ``AHEAD`` threads woken ahead of the ones running (``ran``: the caller is
        one of those woken, and runs now)."""
        with self.baton:
            if ran:
                self.woken -= 1
            while self.woken < AHEAD and self.waiters:
                waiter = self.waiters.popleft()
                if not waiter.gone:
                    waiter.woken = True
                    waiter.lock.release()
                    self.woken += 1

    def wait(self, waiter: Waiter, bound: float) -> bytes:
        """The group's outcome (the stored bytes), waited for at most ``bound`` seconds."""
        if not waiter.lock.acquire(timeout=bound):  # no GIL held while blocked
            with self.baton:
                waiter.gone = True
                woken = waiter.woken  # the chain reached it as it left: pass it on
            if woken:
                self.wake_next(ran=True)
            raise FlightTimeout(
                f"FlightCacheSync: no answer from the engine within {bound:g} s", key=self.digest
            )
        self.wake_next(ran=waiter.woken)  # (not woken by the chain: a leader too late)
        outcome = self.outcome
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome is not None
        return outcome


class Groups:
    """The table: one ``Group`` per key with a call under way."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict[str, Group] = {}

    def __len__(self) -> int:
        return len(self._groups)

    def enter(self, digest: str) -> tuple[Group, Waiter | None]:
        """The key's group, and None if this thread leads it (it must ``settle`` it), or
        the waiter this thread waits as (``Group.wait``)."""
        with self._lock:
            group = self._groups.get(digest)
            if group is None:
                group = self._groups[digest] = Group(digest)
                return group, None
            waiter = Waiter()
            group.waiters.append(waiter)
            return group, waiter

    def waiting(self, group: Group) -> Waiter:
        """A waiter for the leader, once it handed its call to the loop thread (woken at
        once if the group was settled already)."""
        waiter = Waiter()
        with self._lock:
            if group.outcome is None:
                group.waiters.append(waiter)
                return waiter
        waiter.lock.release()
        return waiter

    def settle(self, group: Group, outcome: bytes | BaseException) -> None:
        """End the group: later callers start a read of their own; its threads wake, one
        after another. Called once per group, by its leader or by the loop thread for it."""
        with self._lock:
            if self._groups.get(group.digest) is group:
                del self._groups[group.digest]
            if group.outcome is not None:
                return
            group.outcome = outcome
        group.wake_next(ran=False)
