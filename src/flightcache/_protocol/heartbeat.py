"""The owner's heartbeat: renews the lease every ``lease/3`` while the loader runs.

The heartbeat is bound to the loader task in both directions: it stops when the loader ends,
and when a renewal finds another token (or cannot prove the lease for a whole lease period)
it cancels the loader at once, the "suicide" rule that keeps a stale owner from working on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .._errors import FlightError

log = logging.getLogger("flightcache.heartbeat")


class Heartbeat:
    """Renews one lease while ``work`` runs; ``lost`` tells whether it gave the lease up."""

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
        self._renew = renew
        self._work = work
        self.lease_s = lease_s
        self.interval_s = lease_s / 3
        self.digest = digest
        self._clock = clock
        self._granted_at = clock() if granted_at is None else granted_at
        self.lost = False
        self.reason = ""
        self.renewals = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> Heartbeat:
        self._task = asyncio.get_running_loop().create_task(self._run())
        self._work.add_done_callback(lambda _f: self._cancel_task())
        return self

    def _cancel_task(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def stop(self) -> None:
        if self._task is None:
            return
        self._cancel_task()
        try:
            await self._task
        except asyncio.CancelledError:
            if not self._task.cancelled():
                raise  # our own caller was cancelled, not the heartbeat

    def _give_up(self, reason: str) -> None:
        self.lost = True
        self.reason = reason
        log.warning("flight %s: lease lost (%s); cancelling the loader", self.digest, reason)
        self._work.cancel()

    async def _run(self) -> None:
        # The lease is proven until one lease after the claim was sent (the server started
        # it later than that, so this end comes no later than the server's).
        proven_until = self._granted_at + self.lease_s
        while not self._work.done():
            await asyncio.sleep(self.interval_s)
            sent = self._clock()
            try:
                # A renewal that is still unanswered when the lease runs out proves nothing.
                budget = max(proven_until - sent, 0.001)
                ok = await asyncio.wait_for(self._renew(), budget)
            except (FlightError, asyncio.TimeoutError) as exc:
                if self._clock() >= proven_until:
                    self._give_up(f"no renewal for a whole lease: {exc!r}")
                    return
                log.info("flight %s: renewal failed, retrying: %r", self.digest, exc)
                continue
            if not ok:
                self._give_up("another owner holds the flight, or the lease lapsed")
                return
            self.renewals += 1
            proven_until = sent + self.lease_s
