"""The protocol's constants, in seconds as the code has them, and in a scope's ticks.

The model imports nothing from ``flightcache`` (it is standard library only);
``tests/test_model.py`` checks every figure here against ``flightcache._config.Tuning`` and
the defaults of ``FlightCache(...)``, so the two cannot drift apart unnoticed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# FlightCache(...) defaults (src/flightcache/_cache.py)
LEASE_S = 3.0  # lease: the owner's lease, the TTL of meta
NEAR_LEASE_S = 5.0  # near_lease: how long a node may serve a copy
SKEW_MARGIN_S = 0.25  # skew_margin: the clock margin on read leases and invalidations
NODE_TTL_S = 6.0  # node_ttl: a node's liveness lease
# The renewal periods the code derives from them (heartbeat.py, nodes.py)
RENEW_EVERY_S = LEASE_S / 3  # an owner renews its lease every lease/3
NODE_RENEW_EVERY_S = NODE_TTL_S / 3  # a node renews its liveness every node_ttl/3
# Tuning defaults (src/flightcache/_config.py)
BLOCK_MARGIN_MS = 50  # a follower waits the lease left plus this before re-checking
STREAM_LINGER_MS = 10_000  # how long a flight's stream outlives it
TAKEOVER_STEP_S = 0.03  # a follower not first in line sleeps rank x this before rejoining
TAKEOVER_MAX_RANK = 16


def _exact(seconds: float, tick_s: float, what: str) -> int:
    ticks = seconds / tick_s
    if abs(ticks - round(ticks)) > 1e-9:
        raise ValueError(f"{what} ({seconds} s) is not a whole number of {tick_s} s ticks")
    return round(ticks)


@dataclass(frozen=True)
class Timing:
    """The durations of one scope in ticks.

    Every duration the safety of read leases depends on (lease, renewal periods, near lease,
    skew margin, node TTL) must be a whole number of ticks: the constructor refuses a tick
    that would round one of them. Only the follower's 50 ms block margin is rounded, up to a
    whole tick: it delays a re-check and so can only make the model's followers slower.
    """

    tick_s: float
    lease: int
    renew: int
    margin: int
    near_lease: int
    skew: int
    node_ttl: int
    node_renew: int

    @classmethod
    def of(cls, tick_s: float, *, leases_for_readers: bool) -> Timing:
        lease = _exact(LEASE_S, tick_s, "lease")
        renew = _exact(RENEW_EVERY_S, tick_s, "lease/3")
        margin = max(1, math.ceil(BLOCK_MARGIN_MS / 1000 / tick_s - 1e-9))
        if not leases_for_readers:  # no read leases in the scope: their figures unused
            return cls(tick_s, lease, renew, margin, 0, 0, 0, 0)
        return cls(
            tick_s,
            lease,
            renew,
            margin,
            _exact(NEAR_LEASE_S, tick_s, "near_lease"),
            _exact(SKEW_MARGIN_S, tick_s, "skew_margin"),
            _exact(NODE_TTL_S, tick_s, "node_ttl"),
            _exact(NODE_RENEW_EVERY_S, tick_s, "node_ttl/3"),
        )
