"""Fail-open: when the server cannot be reached, answer from this process, and recover.

While the server is down, calls skip it (a circuit breaker: one probe after a growing
pause) and run as ``memory://`` would: local single-flight, a local cache with short TTLs,
the near cache's leases. The outage is logged once when it starts and once when it ends,
and counted (``stats["fail_open"]``). With ``fail_open=False`` calls raise
``BackendUnavailable`` instead (fail-closed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .._codec import Envelope
from .._errors import BackendUnavailable
from .._types import Stats
from .memory import MemoryFlights

log = logging.getLogger("flightcache.failopen")

FIRST_PAUSE_S = 0.5
LONGEST_PAUSE_S = 5.0


class FailOpen:
    def __init__(
        self,
        envelope: Envelope,
        stats: Stats,
        *,
        enabled: bool,
        url: str,
        local_ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
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
