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

from ._errors import BackendUnavailable

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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._renew = renew
        self._work = work
        self.lease_s = lease_s
        self.interval_s = lease_s / 3
        self.digest = digest
        self._clock = clock
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
        proven_until = self._clock() + self.lease_s  # the claim itself granted one lease
        while not self._work.done():
            await asyncio.sleep(self.interval_s)
            sent = self._clock()
            try:
                ok = await self._renew()
            except BackendUnavailable as exc:
                if self._clock() >= proven_until:
                    self._give_up(f"no renewal for a whole lease: {exc}")
                    return
                log.info("flight %s: renewal failed, retrying: %s", self.digest, exc)
                continue
            if not ok:
                self._give_up("another owner holds the flight, or the lease lapsed")
                return
            self.renewals += 1
            proven_until = sent + self.lease_s
