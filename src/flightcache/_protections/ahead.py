"""Refresh-ahead: recompute a hot value shortly before it expires, in the background.

A caller that asked for it decides by the XFetch rule (Vattani, Chierichetti and
Lowenstein, "Optimal probabilistic cache stampede prevention"): recompute once
``now + cost * (1 + beta * -ln(U)) + margin >= expiry`` with U uniform in (0, 1], where
``cost`` is how long the value took to compute (the ``1 +`` makes sure the new value is
ready before the old one expires). The draw is made once per value and process, not per call:
drawn per call, a hot key's many calls would all but surely start the refresh long before
the expiry (about ``cost * ln(calls per second * cost)`` early), and the value would be
recomputed more than once per lifetime. One background flight recomputes it while every
caller keeps getting the current value; the flight's join skips the work when another
process refreshed it already.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

MIN_COST_S = 0.01  # a value whose cost is unknown is treated as this cheap
MAX_TRACKED = 10_000
SAME_VALUE_S = 0.05  # two reads whose expiries differ by less saw the same value
MARGIN_S = 0.05  # a refresh starts at least this long before it must be done


class RefreshAhead:
    """What this process knows of the expiry and cost of values read with refresh-ahead."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # digest -> (expires at, cost s, refresh at: the one XFetch draw for this value)
        self._known: dict[str, tuple[float, float, float]] = {}
        self.running: set[str] = set()
        self.beta = 1.0

    def saw(self, digest: str, sent: float, ttl_left_ms: int, cost_ms: int | None) -> None:
        """A value read by a request sent at ``sent`` expires ``ttl_left_ms`` after it."""
        if ttl_left_ms <= 0:
            return
        expires = sent + ttl_left_ms / 1000
        old = self._known.pop(digest, None)
        cost = cost_ms / 1000 if cost_ms else (old[1] if old else 0.0)
        if old is not None and abs(old[0] - expires) < max(SAME_VALUE_S, cost):
            refresh_at = old[2]  # the same value, read again: keep its draw
        else:
            # One cost ahead at least (so the new value is ready in time), plus the XFetch
            # draw, plus a round trip's margin.
            cost_s = max(cost, MIN_COST_S)
            draw = -math.log(1.0 - random.random())
            refresh_at = expires - cost_s * (1.0 + self.beta * draw) - MARGIN_S
        self._known[digest] = (expires, cost, refresh_at)
        if len(self._known) > MAX_TRACKED:
            del self._known[next(iter(self._known))]

    def settled(self, digest: str) -> None:
        """Another process refreshed the value already: nothing more to do for the value
        known now; the next read of the new one brings its own draw."""
        known = self._known.get(digest)
        if known is not None:
            self._known[digest] = (known[0], known[1], math.inf)

    def due(self, digest: str, beta: float) -> int | None:
        """Milliseconds the value has left if it should be recomputed now, else None."""
        self.beta = beta
        known = self._known.get(digest)
        if known is None or digest in self.running:
            return None
        expires, _cost, refresh_at = known
        now = self.clock()
        if now < refresh_at:
            return None
        return max(0, int((expires - now) * 1000))
