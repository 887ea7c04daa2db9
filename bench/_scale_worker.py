"""One process of the many-keys figures: ``python -m bench._scale_worker URL NAMESPACE LEASE``.

It keeps one ``FlightCache`` (``near_cache=False``, the given lease, ``node_ttl=60`` so the
liveness heartbeat stays out of the windows the bench counts) for its whole life and takes
orders as JSON lines on stdin (``bench._orders``), answering each with one JSON line:

- ``{"op": "warm"}``: as ``bench._worker``'s: one flight and a few reads.
- ``{"op": "own", "prefix", "keys", "loader_s", "spread_s", "wave", "timeout"}``: start
  ``fc.do(f"{prefix}:{i}")`` for ``i`` in ``range(keys)``, ``wave`` calls at a time (the
  next wave once every loader of the last one runs; 0: all at once), each with a loader that
  sleeps ``loader_s`` plus its share of ``spread_s`` (the keys' shares spread evenly over
  it, mixed across the waves; 0: every wave's loaders end together) and returns
  ``{"i", "pid", "end"}`` (``end``: ``time.monotonic()`` as it returns, one clock for every
  process on a Linux machine). Answers once every loader runs (or its call failed, or
  ``timeout`` passed): how long that took, how many loaders started and leases were lost
  meanwhile. The calls go on.
- ``{"op": "follow", "prefix", "keys"}``: start the same calls with a loader that must never
  run; answers at once. The calls go on.
- ``{"op": "progress"}``: this cache's ``fc.stats`` counters since the last ``own`` or
  ``follow``, and how many of its calls have ended.
- ``{"op": "results", "timeout"}``: wait (at most ``timeout``) for the calls of the last
  ``own``/``follow`` and answer what they got: right values, errors, calls still unfinished
  (then cancelled), loader runs and times, the wake lag of each call (its return minus the
  owner's loader end, in ms), each key's return time, and the library's warnings meanwhile
  (counted by shape, with the first time each was seen: they are not printed).
- ``plain_follow``, ``plain_own``, ``plain_results``: a wave of events ending at once done
  with plain redis-py (``bench._scale_plain``).
- ``{"op": "quit"}`` (or end of input): close the cache and exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import re
import sys
import time
from typing import Any

from flightcache import FlightCache

from ._orders import serve
from ._scale_plain import OPS as PLAIN_OPS
from ._util import spread_share
from ._worker import warm


class LogCounts(logging.Handler):
    """The library's warnings, counted by message shape (digests and numbers left out) with
    the first time each was seen, instead of tens of thousands of lines on stderr."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: dict[str, list[float]] = {}  # shape -> [count, first seen (monotonic)]

    def emit(self, record: logging.LogRecord) -> None:
        shape = re.sub(r"[0-9a-f]{32}", "<flight>", record.getMessage())
        shape = re.sub(r"\d+", "N", shape)[:160]
        seen = self.counts.setdefault(f"{record.name}: {shape}", [0, time.monotonic()])
        seen[0] += 1

    def top(self, n: int = 5) -> list[dict[str, Any]]:
        rows = sorted(self.counts.items(), key=lambda kv: -kv[1][0])[:n]
        return [{"message": m, "count": int(c), "first": t} for m, (c, t) in rows]


LOGGED = LogCounts()


class GcPauses:
    """The cyclic GC's collections in this process: (generation, ms, ended at monotonic)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float, float]] = []
        self._started = 0.0
        gc.callbacks.append(self._seen)

    def _seen(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
        else:
            self.pauses.append((info["generation"], (now - self._started) * 1000, time.monotonic()))

    def since(self, t0: float) -> dict[str, Any]:
        mine = [p for p in self.pauses if p[2] >= t0]
        return {
            "collections": len(mine),
            "gen2": sum(p[0] == 2 for p in mine),
            "total_ms": sum(p[1] for p in mine),
            "max_ms": max((p[1] for p in mine), default=0.0),
            "over_20ms": sorted((round(p[2], 3), round(p[1], 1)) for p in mine if p[1] > 20),
        }


GC = GcPauses()


class Batch:
    """The calls started by the last ``own`` or ``follow`` order of this process, ``wave``
    at a time (0: all at once): an owner starts the next wave once every loader of the
    last one runs (or its call failed)."""

    def __init__(self, fc: FlightCache, msg: dict[str, Any], owner: bool) -> None:
        self.owner = owner
        self.keys = int(msg["keys"])
        self.prefix = str(msg["prefix"])
        self.loader_s = float(msg.get("loader_s", 0.0))
        self.spread_s = float(msg.get("spread_s", 0.0))
        self.pid = os.getpid()
        self.loader_starts: list[float] = []  # every run, restarts after a lost lease too
        self.loading: set[int] = set()  # the keys whose loader has started at least once
        self.loader_ends: list[float] = []
        self.ended = 0
        self.failed = 0
        self._moved = asyncio.Event()  # a loader started or a call failed
        self.stats_before = fc.stats
        self.rechecks_before = _rechecks(fc)
        self.started = time.monotonic()
        wave = int(msg.get("wave", 0)) or self.keys
        self.tasks: list[asyncio.Task[tuple[float, float, Any, str | None]]] = []
        self.all_started = asyncio.ensure_future(self._start(fc, wave, float(msg["timeout"])))

    async def _start(self, fc: FlightCache, wave: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for lo in range(0, self.keys, wave):
            hi = min(lo + wave, self.keys)
            self.tasks += [asyncio.ensure_future(self._call(fc, i)) for i in range(lo, hi)]
            if self.owner:
                await self.settled(hi, deadline)

    async def settled(self, count: int, deadline: float) -> bool:
        """Whether the first ``count`` keys' loaders all started (or their calls failed)
        before ``deadline``."""
        while len(self.loading) + self.failed < count:
            self._moved.clear()
            try:
                await asyncio.wait_for(self._moved.wait(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                return False
        return True

    async def _load(self, i: int) -> dict[str, Any]:
        self.loader_starts.append(time.monotonic())
        self.loading.add(i)
        self._moved.set()
        if self.owner:  # with a spread, the ends of the keys mixed over spread_s
            await asyncio.sleep(self.loader_s + self.spread_s * spread_share(i, self.keys))
        end = time.monotonic()
        self.loader_ends.append(end)
        return {"i": i, "pid": self.pid, "end": end}

    async def _call(self, fc: FlightCache, i: int) -> tuple[float, float, Any, str | None]:
        t0 = time.monotonic()
        try:
            value = await fc.do(f"{self.prefix}:{i}", functools.partial(self._load, i), ttl=600)
        except Exception as exc:  # reported, not raised: the bench decides
            self.failed += 1
            self._moved.set()
            return t0, time.monotonic(), None, f"{type(exc).__name__}: {exc}"
        finally:
            self.ended += 1
        return t0, time.monotonic(), value, None

    async def report(self, fc: FlightCache, timeout: float) -> dict[str, Any]:
        """What the calls got; those still running after ``timeout`` are cancelled and
        counted as ``unfinished``."""
        deadline = time.monotonic() + timeout
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.all_started), timeout)
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=max(0.0, deadline - time.monotonic()))
        self.all_started.cancel()
        unfinished = [t for t in self.tasks if not t.done()]
        for task in unfinished:
            task.cancel()
        await asyncio.gather(*unfinished, return_exceptions=True)
        after = fc.stats
        calls = [t.result() for t in self.tasks if not t.cancelled()]
        errors = [err for _t0, _t1, _v, err in calls if err is not None]
        right = owners = 0
        lags: list[float] = []  # ms, calls that started before their value existed
        late = 0  # calls that started after the owner's loader had ended: not a wake-up
        owner_pids: set[int] = set()
        for t0, t1, value, err in calls:
            if err is not None or not isinstance(value, dict):
                continue
            owner_pids.add(int(value["pid"]))
            owners += value["pid"] == self.pid
            if t0 < value["end"]:
                lags.append(round((t1 - value["end"]) * 1000, 3))
            else:
                late += 1
        returns: list[float | None] = [None] * self.keys  # each key's return, if it got a value
        for i, task in enumerate(self.tasks):
            if not task.cancelled() and isinstance(task.result()[2], dict):
                right += task.result()[2].get("i") == i
                returns[i] = task.result()[1]
        return {
            "pid": self.pid,
            "keys": self.keys,
            "right": right,
            "unfinished": self.keys - len(calls),
            "answered_by_this_process": owners,
            "owner_pids": sorted(owner_pids),
            "error_count": len(errors),
            "errors": errors[:5],
            "loader_runs": len(self.loader_ends),
            "loader_starts": len(self.loader_starts),
            "loader_first_start": min(self.loader_starts, default=None),
            "loader_last_start": max(self.loader_starts, default=None),
            "loader_first_end": min(self.loader_ends, default=None),
            "loader_last_end": max(self.loader_ends, default=None),
            "wake_lag_ms": lags,
            "returns": returns,
            "late": late,
            "seconds": time.monotonic() - self.started,
            "stats": {k: v - self.stats_before.get(k, 0) for k, v in after.items()},
            "rechecks": {k: v - self.rechecks_before[k] for k, v in _rechecks(fc).items()},
            "warnings": LOGGED.top(),
            "gc": GC.since(self.started),
        }


def _rechecks(fc: FlightCache) -> dict[str, int]:
    """The follower's lease re-checks so far (``_protocol/rechecks.py``): flights peeked,
    the script calls that carried them, sessions peeked, followers woken to join again."""
    parts: Any = fc._parts
    if parts is None or not parts.redis_flights:
        return {"peeks": 0, "calls": 0, "sessions": 0, "woken": 0}
    rechecks = parts.redis_flights[0].follower.rechecks
    return {
        "peeks": rechecks.peeks,
        "calls": rechecks.peek_calls,
        "sessions": rechecks.session_peeks,
        "woken": rechecks.woken,
    }


def _bound_late(fc: FlightCache) -> int:
    """The flights this owner bound to its session after their claim (``renewals.py``)."""
    parts: Any = fc._parts
    if parts is None or not parts.redis_flights:
        return 0
    return int(parts.redis_flights[0].owner.renewals.bound_late)


_batch: list[Batch] = []  # the last own/follow of this process, if any


async def own(fc: FlightCache, msg: dict[str, Any]) -> dict[str, Any]:
    batch = Batch(fc, msg, owner=True)
    _batch[:] = [batch]
    await batch.settled(batch.keys, batch.started + float(msg["timeout"]))
    return {
        "pid": batch.pid,
        "running": len(batch.loading),
        "loader_starts": len(batch.loader_starts),
        "failed": batch.failed,
        "claim_s": time.monotonic() - batch.started,
        "all_running_at": time.monotonic(),
        "lease_lost": fc.stats["lease_lost"] - batch.stats_before["lease_lost"],
    }


async def follow(fc: FlightCache, msg: dict[str, Any]) -> dict[str, Any]:
    batch = Batch(fc, {"timeout": 0, **msg}, owner=False)
    _batch[:] = [batch]
    return {"pid": batch.pid, "started_at": batch.started}


async def progress(fc: FlightCache, msg: dict[str, Any]) -> dict[str, Any]:
    """The counters of ``fc.stats`` since the last own/follow, its calls that ended, and the
    flights it bound to its session after their claim (in all)."""
    before = _batch[0].stats_before if _batch else {}
    stats = {k: v - before.get(k, 0) for k, v in fc.stats.items()}
    ended = _batch[0].ended if _batch else 0
    return {"stats": stats, "ended": ended, "bound_late": _bound_late(fc)}


async def results(fc: FlightCache, msg: dict[str, Any]) -> dict[str, Any]:
    if not _batch:
        raise RuntimeError("results without an own or follow order")
    report = await _batch.pop().report(fc, float(msg["timeout"]))
    LOGGED.counts.clear()  # each batch reports its own
    return report


def _cache() -> FlightCache:
    logging.getLogger("flightcache").addHandler(LOGGED)  # no lastResort lines on stderr
    url, namespace, lease = sys.argv[1], sys.argv[2], float(sys.argv[3])
    return FlightCache(url, namespace=namespace, lease=lease, near_cache=False, node_ttl=60.0)


if __name__ == "__main__":
    serve(
        _cache,
        {
            "warm": warm,
            "own": own,
            "follow": follow,
            "progress": progress,
            "results": results,
            **PLAIN_OPS,
        },
    )
