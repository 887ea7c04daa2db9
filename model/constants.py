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
# The wait bound (src/flightcache/_types.py CallOptions.wait_bound_s): a call's flight task
# raises FlightTimeout once this long has passed since it began (flight.py _resolve,
# follower.py follow); an owner's own loader is bounded by ``timeout`` instead, and one that
# ignores its cancellation is abandoned CANCEL_GRACE_S later (_protocol/loader.py).
WAIT_BOUND_FACTOR = 2  # 2 x (timeout + lease) + WAIT_BOUND_EXTRA_S
WAIT_BOUND_EXTRA_S = 1.0
CANCEL_GRACE_S = 1.0
# Sessions (docs/protocol.md, "Sessions"): a flight bound to its owner's session keeps meta
# for the backstop B and renews it every B/3; its liveness is the session key's (TTL lease,
# renewed every lease/3). The code's B is Tuning.session_backstop_ms (30 s for the 3 s
# lease); the arguments need only B > lease (a bound meta outlives the session that proves
# it), and the smallest B whose B/3 is a whole tick keeps the state space small: 6 s.
SESSION_BACKSTOP_S = 2 * LEASE_S
BACKSTOP_RENEW_EVERY_S = SESSION_BACKSTOP_S / 3
# How long a finished flight's stream stays readable, with sessions: the code's linger
# (STREAM_LINGER_MS, 10 s) is a third of its B (30 s), and so is the model's (2 s of 6 s).
# What it weighs against is B: a follower of a bound flight that missed an end (its re-read
# came after the linger) waits for its flight timer, up to B. The literal 10 s would outlast
# the model's B and hide that. Without sessions an end may lapse at once (an
# over-approximation every invariant there allows: one_run_per_flight asks for the end
# still on the stream, and a follower's one timer is a lease).
STREAM_LINGER_OF_BACKSTOP = 3  # the code's B / linger (tests/test_model.py checks it)
SESSION_LINGER_S = SESSION_BACKSTOP_S / STREAM_LINGER_OF_BACKSTOP


def wait_bound_s(timeout_s: float, lease_s: float) -> float:
    """How long a call waits at most (``CallOptions.wait_bound_s``)."""
    return WAIT_BOUND_FACTOR * (timeout_s + lease_s) + WAIT_BOUND_EXTRA_S


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
    backstop: int = 0  # a session-bound meta's TTL (B)
    backstop_renew: int = 0  # a bound flight's own renewal period (B/3)
    linger: int = 0  # sessions: how long a finished flight's stream stays readable

    def wait_bound(self, timeout_s: float) -> int:
        """A call's wait bound in ticks, for a call made with ``timeout=timeout_s``."""
        return _exact(wait_bound_s(timeout_s, LEASE_S), self.tick_s, "the wait bound")

    def loader_bound(self, timeout_s: float) -> int:
        """How long an owner's loader may run, in ticks: ``timeout``, then the grace a
        loader that ignores its cancellation is given before it is abandoned."""
        return _exact(timeout_s + CANCEL_GRACE_S, self.tick_s, "timeout + the cancel grace")

    @classmethod
    def of(cls, tick_s: float, *, leases_for_readers: bool) -> Timing:
        lease = _exact(LEASE_S, tick_s, "lease")
        renew = _exact(RENEW_EVERY_S, tick_s, "lease/3")
        margin = max(1, math.ceil(BLOCK_MARGIN_MS / 1000 / tick_s - 1e-9))
        backstop = _exact(SESSION_BACKSTOP_S, tick_s, "the session backstop")
        backstop_renew = _exact(BACKSTOP_RENEW_EVERY_S, tick_s, "the backstop's B/3")
        linger = _exact(SESSION_LINGER_S, tick_s, "the stream's linger")
        if not leases_for_readers:  # no read leases in the scope: their figures unused
            return cls(tick_s, lease, renew, margin, 0, 0, 0, 0, backstop, backstop_renew, linger)
        return cls(
            tick_s,
            lease,
            renew,
            margin,
            _exact(NEAR_LEASE_S, tick_s, "near_lease"),
            _exact(SKEW_MARGIN_S, tick_s, "skew_margin"),
            _exact(NODE_TTL_S, tick_s, "node_ttl"),
            _exact(NODE_RENEW_EVERY_S, tick_s, "node_ttl/3"),
            backstop,
            backstop_renew,
            linger,
        )
