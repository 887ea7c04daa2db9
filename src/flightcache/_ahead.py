"""Refresh-ahead: recompute a hot value shortly before it expires, in the background.

On a hit, a caller that asked for it decides by the XFetch rule (Vattani, Chierichetti and
Lowenstein, "Optimal probabilistic cache stampede prevention"): recompute now if
``now - cost * beta * ln(U) >= expiry`` with U uniform in (0, 1], where ``cost`` is how long
the value took to compute. The nearer the expiry and the costlier the value, the likelier.
One background flight recomputes it while every caller keeps getting the current value;
the flight's join skips the work when another process refreshed it already.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

MIN_COST_S = 0.01  # a value whose cost is unknown is treated as this cheap
MAX_TRACKED = 10_000


class RefreshAhead:
    """What this process knows of the expiry and cost of values read with refresh-ahead."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._known: dict[str, tuple[float, float]] = {}  # digest -> (expires at, cost s)
        self.running: set[str] = set()

    def saw(self, digest: str, sent: float, ttl_left_ms: int, cost_ms: int | None) -> None:
        """A value read by a request sent at ``sent`` expires ``ttl_left_ms`` after it."""
        if ttl_left_ms <= 0:
            return
        cost = cost_ms / 1000 if cost_ms else self._known.get(digest, (0.0, 0.0))[1]
        self._known.pop(digest, None)
        self._known[digest] = (sent + ttl_left_ms / 1000, cost)
        if len(self._known) > MAX_TRACKED:
            del self._known[next(iter(self._known))]

    def due(self, digest: str, beta: float) -> int | None:
        """Milliseconds the value has left if it should be recomputed now, else None."""
        known = self._known.get(digest)
        if known is None or digest in self.running:
            return None
        expires, cost = known
        now = self.clock()
        if now - max(cost, MIN_COST_S) * beta * math.log(1.0 - random.random()) < expires:
            return None
        return max(0, int((expires - now) * 1000))
