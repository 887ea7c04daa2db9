"""Refresh-ahead: recompute a hot value shortly before it expires, in the background.

A caller that asked for it decides by the XFetch rule (Vattani, Chierichetti and
Lowenstein, "Optimal probabilistic cache stampede prevention"): recompute once
``now + cost * (1 + beta * -ln(U)) + margin >= expiry`` with U uniform in (0, 1], where
``cost`` is how long the value took to compute (the ``1 +`` makes sure the new value is
ready before the old one expires), and ``-ln(U)`` is capped at ``MAX_DRAW``. The draw is
made once per value and process, not per call: drawn per call, a hot key's many calls would
all but surely start the refresh long before the expiry (about
``cost * ln(calls per second * cost)`` early), and the value would be recomputed more than
once per lifetime. One background flight recomputes it while every caller keeps getting the
current value; the flight's join skips the work when another process refreshed it already.
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
# The draw -ln(U) is capped at its 99th percentile, -ln(0.01): its exponential tail would
# otherwise, now and then, start a refresh most of a TTL early and run the loader (an LLM
# call) far more often than once per TTL. A CI run saw it: a draw of about 6 across three
# processes refreshed a 1 s value 0.14 s after the one before was stored.
MAX_DRAW = 4.6


class RefreshAhead:
    """What this process knows of the expiry and cost of values read with refresh-ahead."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # digest -> (expires at, cost s, the one XFetch draw for this value: -ln(U), or
        # None once another process refreshed it). Each call's own beta scales the draw
        # when it asks whether the value is due, so keys with different betas stay apart.
        self._known: dict[str, tuple[float, float, float | None]] = {}
        self.running: set[str] = set()

    def saw(self, digest: str, sent: float, ttl_left_ms: int, cost_ms: int | None) -> None:
        """A value read by a request sent at ``sent`` expires ``ttl_left_ms`` after it."""
        if ttl_left_ms <= 0:
            return
        expires = sent + ttl_left_ms / 1000
        old = self._known.pop(digest, None)
        cost = cost_ms / 1000 if cost_ms else (old[1] if old else 0.0)
        if old is not None and abs(old[0] - expires) < max(SAME_VALUE_S, cost):
            draw = old[2]  # the same value, read again: keep its draw
        else:
            draw = min(-math.log(1.0 - random.random()), MAX_DRAW)
        self._known[digest] = (expires, cost, draw)
        if len(self._known) > MAX_TRACKED:
            del self._known[next(iter(self._known))]

    def settled(self, digest: str) -> None:
        """Another process refreshed the value already: nothing more to do for the value
        known now; the next read of the new one brings its own draw."""
        known = self._known.get(digest)
        if known is not None:
            self._known[digest] = (known[0], known[1], None)

    def due(self, digest: str, beta: float) -> int | None:
        """Milliseconds the value has left if it should be recomputed now, else None."""
        known = self._known.get(digest)
        if known is None or digest in self.running:
            return None
        expires, cost, draw = known
        if draw is None:
            return None
        # One cost ahead at least (so the new value is ready in time), plus the XFetch draw
        # scaled by this call's beta, plus a round trip's margin.
        refresh_at = expires - max(cost, MIN_COST_S) * (1.0 + beta * draw) - MARGIN_S
        now = self.clock()
        if now < refresh_at:
            return None
        return max(0, int((expires - now) * 1000))
