"""Small shared types: sentinels, the lifecycle state, per-call options, the ``inspect`` and
``invalidate`` records and counters."""

from __future__ import annotations

import bisect
import enum
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Final


class _Sentinel(enum.Enum):
    MISSING = "MISSING"
    UNSET = "UNSET"
    NOT_FOUND = "NOT_FOUND"

    def __repr__(self) -> str:
        return f"flightcache.{self.value}"

    def __bool__(self) -> bool:
        return False


MISSING: Final = _Sentinel.MISSING
"""What ``get`` returns when nothing is cached."""

UNSET: Final = _Sentinel.UNSET
"""Marks an argument that was not given, where ``None`` means something else."""

NOT_FOUND: Final = _Sentinel.NOT_FOUND
"""A loader's answer that the thing does not exist: cached for ``not_found_ttl``, and what
every caller of that key gets back (penetration protection: a missing key costs one load)."""


class CacheState(enum.Enum):
    """Where a cache is in its life (httpx's ``ClientState``): made but not yet connected,
    connected (on first use, or ``async with``), or closed for good."""

    UNOPENED = 1
    OPENED = 2
    CLOSED = 3


Loader = Callable[[], Awaitable[Any]] | Callable[[Any], Awaitable[Any]]
"""A zero-argument async callable, or one that takes the run's ``FlightContext``."""


@dataclass(frozen=True, slots=True)
class CallOptions:
    """Everything one flight needs to know, resolved from a call and the cache's defaults."""

    ttl_ms: int
    lease_ms: int
    timeout_s: float
    error_ttl_ms: int
    key_text: str
    refresh: bool = False  # recompute even when a result is stored (and overwrite it)
    store: bool = True  # False: deliver the result to the flight's callers, store nothing
    not_found_ttl_ms: int = 60_000
    refresh_below_ms: int = 0  # a refresh-ahead: only if the stored result has this little left

    @property
    def wait_bound_s(self) -> float:
        """How long a caller waits at most: one takeover's worth of lease and loader time."""
        return 2 * (self.timeout_s + self.lease_ms / 1000) + 1.0


@dataclass(frozen=True, slots=True)
class FlightInfo:
    """What ``inspect`` reports about one key."""

    key: str | None
    digest: str
    state: str  # "cached", "error-cached", "running" or "vacant"
    owner_node: str | None = None
    token: int | None = None
    lease_left_ms: int | None = None
    attempts: int | None = None
    followers: int = 0
    result_ttl_ms: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Invalidation:
    """How an ``invalidate`` or ``set`` finished.

    ``how`` is ``"acked"`` (every live node with a near cache acknowledged), ``"lease"`` (it
    waited until the longest lease could have lapsed), or ``"absent"`` (nothing was stored,
    so no node could hold a lease on it).
    """

    how: str
    nodes: int  # live nodes whose acknowledgement it waited for
    acked: int
    waited_s: float


WAIT_BOUNDS_S: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0
)  # fmt: skip


@dataclass(slots=True)
class Histogram:
    """Observations counted into fixed buckets: ``counts[i]`` of them were at most
    ``bounds[i]`` and above the bound before it; the last count is above every bound."""

    bounds: tuple[float, ...] = WAIT_BOUNDS_S
    counts: list[int] = field(default_factory=lambda: [0] * (len(WAIT_BOUNDS_S) + 1))
    total: float = 0.0  # the sum of every observation

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass(slots=True)
class Stats:
    """Counters of one FlightCache, cumulative since it was made."""

    calls: int = 0  # do() calls
    hits: int = 0  # do() calls answered from the stored result
    streams: int = 0  # stream() calls
    gets: int = 0  # get() calls
    get_hits: int = 0
    misses: int = 0
    coalesced: int = 0
    follows: int = 0
    loader_runs: int = 0
    loader_errors: int = 0
    timeouts: int = 0
    takeovers: int = 0
    lease_lost: int = 0
    fenced_writes: int = 0
    commands: int = 0
    rejected: int = 0  # do() calls a Bloom filter answered NOT_FOUND without any load
    refreshes_ahead: int = 0  # background recomputations started before a value expired
    fail_open: int = 0  # calls answered by this process alone while the server was down
    tag_stale: int = 0  # tagged results read whose tags were invalidated since (misses)
    owning: int = 0  # flights this cache owns right now (a gauge, not a counter)
    extra: dict[str, int] = field(default_factory=dict)
    # Seconds from a follow of another process's flight to its answer (do() calls only).
    follow_wait: Histogram = field(default_factory=Histogram)

    def snapshot(self) -> dict[str, int]:
        data = {
            k: v for k, v in asdict(self).items() if k not in ("extra", "owning", "follow_wait")
        }
        data.update(self.extra)
        return data
