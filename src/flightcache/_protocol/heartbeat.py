"""The owner's heartbeats: every lease renewed every ``lease/3`` while its loader runs.

One :class:`Renewer` per server renews the leases of all the flights this process owns
there together: when the earliest renewal is due, every lease due within half its own
interval goes out in one batch (one pipeline of multi-flight scripts), so renewal cost grows
with servers, not flights. Each lease is bound to its loader task in both directions: it
leaves the renewer when the loader ends, and when a renewal finds another token (or the
lease cannot be proven for a whole lease) it cancels that loader at once, the "suicide"
rule that keeps a stale owner from working on. A batch answers per flight, so exactly the
flights whose token was refused are cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from .._errors import FlightError

log = logging.getLogger("flightcache.heartbeat")

RETRY_FRACTION = 1.0  # after a failed batch, retry one interval later (as a lone heartbeat did)


class Lease:
    """One owned flight's lease in a :class:`Renewer`; ``lost`` tells whether it gave up."""

    __slots__ = (
        "_work",
        "args",
        "digest",
        "interval_s",
        "lease_s",
        "lost",
        "next_due",
        "on_give_up",
        "proven_until",
        "reason",
        "renewals",
    )

    def __init__(
        self, work: asyncio.Future[Any], lease_s: float, digest: str, granted_at: float, args: Any
    ) -> None:
        self._work = work
        self.lease_s = lease_s
        self.interval_s = lease_s / 3
        self.digest = digest
        self.args = args  # what the renewer's batch function needs (keys, token, ...)
        # The lease is proven until one lease after the claim was sent (the server started
        # it later than that, so this end comes no later than the server's).
        self.proven_until = granted_at + lease_s
        self.next_due = granted_at + self.interval_s
        self.lost = False
        self.reason = ""
        self.renewals = 0
        self.on_give_up: Callable[[], None] | None = None  # told first (the loader's context)

    def give_up(self, reason: str) -> None:
        self.lost = True
        self.reason = reason
        log.warning("flight %s: lease lost (%s); cancelling the loader", self.digest, reason)
        if self.on_give_up is not None:
            self.on_give_up()
        self._work.cancel()


RenewBatch = Callable[[Sequence[Lease]], Awaitable[Sequence[bool]]]


class Renewer:
    """Renews every registered lease on time, in batches, with one task."""

    def __init__(self, renew: RenewBatch, clock: Callable[[], float] = time.monotonic) -> None:
        self._renew = renew
        self._clock = clock
        self._leases: dict[int, Lease] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
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
    ) -> Lease:
        lease = Lease(
            work, lease_s, digest, self._clock() if granted_at is None else granted_at, args
        )
        self._leases[id(lease)] = lease
        work.add_done_callback(lambda _f: self.remove(lease))
        self._changed.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return lease

    def remove(self, lease: Lease) -> None:
        """The lease needs no more renewals (its loader ended); a batch already on the wire
        may still renew it once, which is harmless, and its answer is ignored."""
        self._leases.pop(id(lease), None)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while self._leases:
            now = self._clock()
            due = min(lease.next_due for lease in self._leases.values())
            if due > now:
                self._changed.clear()
                try:  # a new lease may be due sooner: look again when one arrives
                    await asyncio.wait_for(self._changed.wait(), due - now)  # heartbeat interval
                    continue
                except asyncio.TimeoutError:
                    pass  # the timer says `due` has come, whatever the clock reads
            batch = [
                lease
                for lease in self._leases.values()
                if lease.next_due - due <= lease.interval_s / 2
            ]
            if batch:  # (empty when the leases due ended while we waited)
                await self._renew_batch(batch)

    async def _renew_batch(self, batch: list[Lease]) -> None:
        self.batches += 1
        sent = self._clock()
        # A renewal still unanswered when a lease runs out proves nothing for it.
        budget = max(min(lease.proven_until for lease in batch) - sent, 0.001)
        try:
            answers = await asyncio.wait_for(self._renew(batch), budget)
        except (FlightError, asyncio.TimeoutError) as exc:
            now = self._clock()
            for lease in batch:
                if id(lease) not in self._leases:
                    continue
                if now >= lease.proven_until:
                    self.remove(lease)
                    lease.give_up(f"no renewal for a whole lease: {exc!r}")
                else:
                    log.info("flight %s: renewal failed, retrying: %r", lease.digest, exc)
                    lease.next_due = now + lease.interval_s * RETRY_FRACTION
            return
        for lease, ok in zip(batch, answers, strict=True):
            if id(lease) not in self._leases:
                continue  # its loader ended while the batch was on the wire
            if not ok:
                self.remove(lease)
                lease.give_up("another owner holds the flight, or the lease lapsed")
                continue
            lease.renewals += 1
            lease.proven_until = sent + lease.lease_s
            lease.next_due = sent + lease.interval_s


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
