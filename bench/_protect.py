"""Phase 6: protection: the Bloom filter (penetration) and refresh-ahead (breakdown).

- Bloom filter: ``BloomFilter(fc, name, capacity, error_rate)`` on the bench's server,
  ``keys`` keys added with ``add_many`` in batches of ``batch``; then ``contains_many`` of
  every added key (each must answer True: a False is a false negative, which a Bloom
  filter may never give) and of as many keys never added (each True is a false positive).
  The measured rate is shown next to the filter's own formula for ``keys`` adds (the
  same-run baseline) and the configured ``error_rate``. Keys/s of ``add_many`` and
  ``contains_many`` are shown next to raw bit operations on the same offsets: one
  ``BITFIELD`` command per batch (``SET u1 <offset> 1`` / ``GET u1 <offset>``) on a key of
  its own, offsets computed beforehand, so what is left is the server's and the driver's
  share. The first call of each script (NOSCRIPT, then a load) is made before the timing,
  on a small filter of its own.
- Refresh-ahead: a hot key (``ttl`` 1 s, loader ``loader_s`` 100 ms) read by ``coroutines``
  coroutines in each of 3 ``FlightCache`` objects (3 nodes, default settings: near cache
  on) for ``seconds``, each coroutine calling ``fc.do`` then sleeping 2 ms, once with
  ``refresh_ahead=True`` and once without (the baseline), in namespaces of their own. A call
  that lasted at least half the loader's time waited for the loader: a miss. Loader runs
  and runs per TTL period count only the hammering (each cache's first call, the warm-up,
  is the one miss there is). Loader runs that overlapped (two at once) are counted too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from typing import Any

import redis.asyncio as aioredis

from flightcache import BloomFilter, FlightCache

from ._util import summary

BLOOM_FP_TARGET = 1.2  # x the configured error rate
CALL_PAUSE_S = 0.002


# -- Bloom filter ---------------------------------------------------------------------------


async def run_bloom(
    url: str,
    *,
    keys: int = 100_000,
    capacity: int = 100_000,
    error_rate: float = 0.01,
    batch: int = 2_000,
    checked: int | None = None,
    raw_keys: int = 20_000,
) -> dict[str, Any]:
    """``checked``: how many of the added keys are read back (all by default)."""
    run_id = uuid.uuid4().hex[:8]
    fc = FlightCache(url, namespace=f"bench-bloom-{run_id}", near_cache=False)
    raw = aioredis.Redis.from_url(url)
    raw_key = f"bench-bloom-raw:{run_id}"
    warm = BloomFilter(fc, "warm", capacity=1_000, error_rate=error_rate)
    bf = BloomFilter(fc, "fp", capacity=capacity, error_rate=error_rate)
    added = [f"member:{i}" for i in range(keys)]
    absent = [f"stranger:{i}" for i in range(keys)]
    read_back = added[: keys if checked is None else checked]
    timing: dict[str, tuple[float, float]] = {}  # name -> (wall s, this process's CPU s)

    async def timed(name: str, op: Any, items: list[str]) -> list[bool]:
        out: list[bool] = []
        cpu, start = time.process_time(), time.perf_counter()
        for i in range(0, len(items), batch):  # bounded: one call per batch
            out.extend(await op(items[i : i + batch]))
        timing[name] = (time.perf_counter() - start, time.process_time() - cpu)
        return out

    try:
        await warm.add_many(["a", "b"])  # both scripts loaded before anything is timed
        await warm.contains_many(["a", "c"])
        new_flags = await timed("add_many", bf.add_many, added)
        found = await timed("contains_many, added keys", bf.contains_many, read_back)
        false_pos = await timed("contains_many, keys never added", bf.contains_many, absent)

        # Baseline: the same bit operations as one raw BITFIELD command per batch.
        cpu, start = time.process_time(), time.perf_counter()
        offsets = [
            [o for key in added[i : i + batch] for o in bf.positions(key)]
            for i in range(0, min(raw_keys, keys), batch)
        ]
        timing["positions (hashing only)"] = (
            time.perf_counter() - start,
            time.process_time() - cpu,
        )
        cpu, start = time.process_time(), time.perf_counter()
        for chunk in offsets:
            args: list[Any] = []
            for o in chunk:
                args += ("SET", "u1", o, 1)
            await raw.execute_command("BITFIELD", raw_key, *args)
        timing["raw BITFIELD SET"] = (time.perf_counter() - start, time.process_time() - cpu)
        raw_found = 0
        k = bf.hashes
        cpu, start = time.process_time(), time.perf_counter()
        for chunk in offsets:
            args = []
            for o in chunk:
                args += ("GET", "u1", o)
            bits = await raw.execute_command("BITFIELD", raw_key, *args)
            raw_found += sum(all(bits[j : j + k]) for j in range(0, len(bits), k))
        timing["raw BITFIELD GET"] = (time.perf_counter() - start, time.process_time() - cpu)
        if raw_found != min(raw_keys, keys):
            raise RuntimeError(f"raw BITFIELD baseline read back {raw_found} keys of {raw_keys}")
    finally:
        for f in (bf, warm):
            try:
                await f.clear()
            except Exception:  # the server may be gone (Ctrl-C); nothing is on disk
                pass
        try:
            await raw.delete(raw_key)
        except Exception:
            pass
        await raw.aclose()
        await fc.aclose()
    counts = {
        "add_many": keys,
        "contains_many, added keys": len(read_back),
        "contains_many, keys never added": len(absent),
        "positions (hashing only)": min(raw_keys, keys),
        "raw BITFIELD SET": min(raw_keys, keys),
        "raw BITFIELD GET": min(raw_keys, keys),
    }
    return {
        "config": {
            "capacity": capacity,
            "error_rate": error_rate,
            "keys_added": keys,
            "keys_probed": len(absent),
            "keys_read_back": len(read_back),
            "batch": batch,
            "bits": bf.bits,
            "hashes": bf.hashes,
        },
        "false_positive_rate": sum(false_pos) / len(absent),
        "expected_rate": bf.false_positive_rate(keys),
        "false_negatives": len(found) - sum(found),
        "added_as_new": sum(new_flags),
        "throughput": {
            name: {
                "keys": counts[name],
                "keys_per_s": counts[name] / wall,
                "cpu_us_per_key": cpu_s / counts[name] * 1e6,
            }
            for name, (wall, cpu_s) in timing.items()
        },
    }


# -- refresh-ahead --------------------------------------------------------------------------


class _ShortTtlNote(logging.Filter):
    """Hides the cache's one warning that ttl 1 s is below the near-cache lease (5 s): the
    bench uses the default settings on purpose, and the leases are clamped as it says."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "shorter than near_lease" not in record.getMessage()


async def _hammer(
    url: str,
    namespace: str,
    *,
    refresh_ahead: bool,
    nodes: int,
    coroutines: int,
    seconds: float,
    ttl: float,
    loader_s: float,
    max_calls: int = 20_000,
) -> dict[str, Any]:
    caches = [FlightCache(url, namespace=namespace) for _ in range(nodes)]
    runs: list[tuple[float, float]] = []
    running = 0
    most_at_once = 0

    async def loader() -> int:
        nonlocal running, most_at_once
        running += 1
        most_at_once = max(most_at_once, running)
        started = time.monotonic()
        try:
            await asyncio.sleep(loader_s)
        finally:
            running -= 1
        runs.append((started, time.monotonic()))
        return len(runs)

    durations: list[float] = []
    errors: list[str] = []
    try:
        for fc in caches:  # warm-up: the first call misses (the one miss there is)
            await fc.do("hot", loader, ttl=ttl, refresh_ahead=refresh_ahead)
        warm_runs = len(runs)
        before = [fc.stats for fc in caches]
        t0 = time.monotonic()

        async def caller(fc: FlightCache) -> None:
            for _ in range(max_calls):
                if time.monotonic() - t0 >= seconds:
                    return
                started = time.perf_counter()
                try:
                    await fc.do("hot", loader, ttl=ttl, refresh_ahead=refresh_ahead)
                except Exception as exc:  # reported, not raised
                    errors.append(f"{type(exc).__name__}: {exc}")
                durations.append(time.perf_counter() - started)
                await asyncio.sleep(CALL_PAUSE_S)

        await asyncio.wait_for(
            asyncio.gather(*(caller(fc) for fc in caches for _ in range(coroutines))),
            timeout=seconds + 30,
        )
        elapsed = time.monotonic() - t0
        after = [fc.stats for fc in caches]
    finally:
        for fc in caches:
            await fc.aclose()
    hammer_runs = [r for r in runs[warm_runs:] if r[0] >= t0]
    starts = [s for s, _ in hammer_runs]
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(starts)]
    waited = [d for d in durations if d >= loader_s / 2]
    return {
        "calls": len(durations),
        "waited": len(waited),
        "errors": errors,
        "latency_ms": summary([d * 1000 for d in durations]),
        "loader_runs": len(runs) - warm_runs,
        "runs_per_ttl": (len(runs) - warm_runs) / (elapsed / ttl),
        "most_runs_at_once": most_at_once,
        "run_interval_ms": summary(gaps),
        "elapsed_s": elapsed,
        "refreshes_ahead": sum(
            a["refreshes_ahead"] - b["refreshes_ahead"] for a, b in zip(after, before, strict=True)
        ),
    }


async def run_refresh_ahead(
    url: str,
    *,
    seconds: float = 4.0,
    nodes: int = 3,
    coroutines: int = 3,
    ttl: float = 1.0,
    loader_s: float = 0.1,
) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:8]
    note = _ShortTtlNote()
    logger = logging.getLogger("flightcache.near")
    logger.addFilter(note)
    try:
        modes = {}
        for name, ahead in (("refresh_ahead", True), ("plain", False)):
            modes[name] = await _hammer(
                url,
                f"bench-ahead-{run_id}-{name}",
                refresh_ahead=ahead,
                nodes=nodes,
                coroutines=coroutines,
                seconds=seconds,
                ttl=ttl,
                loader_s=loader_s,
            )
    finally:
        logger.removeFilter(note)
    return {
        "config": {
            "nodes": nodes,
            "coroutines_per_node": coroutines,
            "seconds": seconds,
            "ttl_s": ttl,
            "loader_s": loader_s,
            "pause_s": CALL_PAUSE_S,
            "waited_threshold_ms": loader_s / 2 * 1000,
        },
        **modes,
    }
