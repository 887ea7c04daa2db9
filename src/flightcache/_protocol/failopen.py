"""Fail-open: when the server cannot be reached, answer from this process, and recover.

``FailOpen`` stands in front of a server's flights and implements the same ``Flights``.
While the server is down, calls skip it (a circuit breaker: one probe after a growing
pause) and run as ``memory://`` would: local single-flight, a local cache with short TTLs,
the near cache's leases. The outage is logged once when it starts and once when it ends,
and counted (``stats["fail_open"]``). With ``fail_open=False`` calls raise
``BackendUnavailable`` instead (fail-closed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._codec import Envelope
from .._errors import BackendUnavailable, FlightError, PoolExhausted
from .._keys import FlightKeys
from .._types import CallOptions, FlightInfo, Stats
from .base import Flights, Opening
from .jobs import Job
from .memory import MemoryFlights
from .owner import Undelivered

log = logging.getLogger("flightcache.failopen")

FIRST_PAUSE_S = 0.5
LONGEST_PAUSE_S = 5.0


class FailOpen:
    """``server``'s flights, answered by this process while the server cannot be reached."""

    def __init__(
        self,
        server: Flights,
        envelope: Envelope,
        stats: Stats,
        *,
        enabled: bool,
        url: str,
        local_ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.server = server
        self.enabled = enabled
        self.stats = stats
        self.url = url
        self.clock = clock
        # This process alone, while the server is down; what it keeps lives no longer than
        # a near-cache lease, since nobody can invalidate it meanwhile.
        self.local = MemoryFlights(envelope, stats, max_ttl_s=local_ttl_s)
        self.down = False
        self._retry_at = 0.0
        self._pause = FIRST_PAUSE_S

    def skip_server(self) -> bool:
        """True while the server is known down and its next probe is not due."""
        return self.down and self.clock() < self._retry_at

    def failed(self, exc: BackendUnavailable) -> None:
        if self.down and self.clock() < self._retry_at:
            return  # one outage window: concurrent failures do not lengthen the pause
        if not self.down:
            log.warning(
                "Redis at %s unreachable (%s): serving from this process until it is back",
                self.url,
                exc,
            )
        self.down = True
        self._retry_at = self.clock() + self._pause
        self._pause = min(self._pause * 2, LONGEST_PAUSE_S)

    def worked(self) -> None:
        if self.down:
            self.down = False
            self._pause = FIRST_PAUSE_S
            log.warning("Redis at %s answers again: back to shared flights", self.url)

    # -- Flights -------------------------------------------------------------------------

    async def lookup(self, fk: FlightKeys) -> bytes | None:
        return (await self._read(fk, full=False))[0]

    async def lookup_full(self, fk: FlightKeys) -> tuple[bytes | None, int, bool, int]:
        return await self._read(fk, full=True)

    async def _read(self, fk: FlightKeys, *, full: bool) -> tuple[bytes | None, int, bool, int]:
        """The server's answer; while it is down, this process's own, for which the server
        vouches nothing (no time left to lease or to track)."""
        if self.enabled and self.skip_server():
            return await self.local.lookup(fk), 0, False, 0
        try:
            if full:
                answer = await self.server.lookup_full(fk)
            else:
                answer = await self.server.lookup(fk), 0, False, 0
        except PoolExhausted:
            raise  # this process is busy, the server is not down
        except BackendUnavailable as exc:
            if not self.enabled:
                raise
            self.failed(exc)
            return await self.local.lookup(fk), 0, False, 0
        if self.down:
            self.worked()
        return answer

    def prepare(self, fk: FlightKeys) -> Any:
        return self.server.prepare(fk)

    async def begin(self, fk: FlightKeys, opts: CallOptions, handle: Any) -> Opening:
        """The server's first read; while it is known down, this process's own lookup, for
        which the server vouches nothing (no time left to lease or to track). A first read
        that fails is not yet an outage: the flight goes on to ``resolve``, which retries
        through a failover (``Tuning.failover_s``) before this process answers alone."""
        if self.enabled and self.skip_server():
            return Opening(None if opts.refresh else await self.local.lookup(fk))
        try:
            opening = await self.server.begin(fk, opts, handle)
        except PoolExhausted:
            raise  # this process is busy, the server is not down
        except BackendUnavailable:
            if not self.enabled:
                raise
            return Opening(None, handle=handle)  # resolve sends the join again, same claim id
        if self.down:
            self.worked()
        return opening

    async def begin_many(
        self, fks: Sequence[FlightKeys], opts: Sequence[CallOptions], handles: Sequence[Any]
    ) -> list[Opening | FlightError]:
        """``begin`` for several keys, as ``begin`` does it for one."""
        if self.enabled and self.skip_server():
            return [
                Opening(None if o.refresh else await self.local.lookup(fk))
                for fk, o in zip(fks, opts, strict=True)
            ]
        try:
            openings = await self.server.begin_many(fks, opts, handles)
        except PoolExhausted:
            raise
        except BackendUnavailable:
            if not self.enabled:
                raise
            return [Opening(None, handle=handle) for handle in handles]
        if self.down:
            self.worked()
        return openings

    async def abandon(self, fk: FlightKeys, opts: CallOptions, handle: Any) -> None:
        await self.server.abandon(fk, opts, handle)

    def release(self, handle: Any) -> None:
        self.server.release(handle)

    async def resolve(
        self, fk: FlightKeys, job: Job, opts: CallOptions, handle: Any = None
    ) -> bytes:
        """The flight through the server, or, while it is down, in this process."""
        if not self.enabled:
            return await self.server.resolve(fk, job, opts, handle)
        if not self.skip_server():
            try:
                result = await self.server.resolve(fk, job, opts, handle)
            except PoolExhausted:
                raise  # this process is busy, the server is not down
            except Undelivered as exc:
                # The loader ran here and its value is in hand; the server would not take
                # it. This process's callers get it (nobody else can: it is not stored).
                self.failed(exc)
                self.stats.fail_open += 1
                job.lease = None
                return exc.result
            except BackendUnavailable as exc:
                self.failed(exc)
            else:
                self.worked()
                return result
        else:
            self.server.release(handle)
        self.stats.fail_open += 1
        result = await self.local.resolve(fk, job, opts)
        job.lease = None  # this process's own answer: nothing the server could lease
        return result

    async def inspect(self, fk: FlightKeys) -> FlightInfo:
        return await self.server.inspect(fk)  # never fails open: it asks about the server
