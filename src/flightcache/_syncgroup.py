"""Threads of one process asking for one key at once share one call (docs/sync.md).

The sync door's own single-flight table, in front of the engine's: the first thread to ask
for a key leads (it sends the read, and hands a miss to the loop thread); the others wait on
a lock of their own until the leader's call settles, and each decodes its own copy. When a
flight ends, the loop thread releases every waiting thread's lock in one callback (a few
microseconds each) instead of resuming one task per thread and waking each through a
``concurrent.futures.Future`` of its own: the fan-out costs the loop almost nothing, and
the woken threads only contend for the GIL among themselves.
"""

from __future__ import annotations

import threading

from ._errors import FlightTimeout


class Group:
    """One key's call under way in this process, and the threads waiting for its outcome."""

    __slots__ = ("digest", "outcome", "waiters")

    def __init__(self, digest: str) -> None:
        self.digest = digest
        self.waiters: list[threading.Lock] = []
        self.outcome: bytes | BaseException | None = None

    def wait(self, lock: threading.Lock, bound: float) -> bytes:
        """The group's outcome (the stored bytes), waited for at most ``bound`` seconds;
        ``lock`` was acquired and queued in ``waiters`` under the table's lock."""
        if not lock.acquire(timeout=bound):  # no GIL held while blocked
            raise FlightTimeout(
                f"FlightCacheSync: no answer from the engine within {bound:g} s", key=self.digest
            )
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

    def enter(self, digest: str) -> tuple[Group, threading.Lock | None]:
        """The key's group, and None if this thread leads it (it must ``settle`` it), or
        the acquired lock this thread waits on (``Group.wait``)."""
        with self._lock:
            group = self._groups.get(digest)
            if group is None:
                group = self._groups[digest] = Group(digest)
                return group, None
            lock = threading.Lock()
            lock.acquire()
            group.waiters.append(lock)
            return group, lock

    def waiting(self, group: Group) -> threading.Lock:
        """A lock for the leader to wait on once it handed its call to the loop thread
        (released at once if the group was settled already)."""
        lock = threading.Lock()
        with self._lock:
            if group.outcome is None:
                lock.acquire()
                group.waiters.append(lock)
        return lock

    def settle(self, group: Group, outcome: bytes | BaseException) -> None:
        """End the group: later callers start a read of their own; every waiter wakes.
        Called once per group, by its leader or by the loop thread for it."""
        with self._lock:
            if self._groups.get(group.digest) is group:
                del self._groups[group.digest]
            if group.outcome is not None:
                return
            group.outcome = outcome
            waiters, group.waiters = group.waiters, []
        for lock in waiters:
            lock.release()
