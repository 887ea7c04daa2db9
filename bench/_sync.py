"""Section "sync": FlightCacheSync, the blocking client, against raw sync redis-py.

Hit path (this process, values already cached, ``near_cache=False``): each variant is an
operation on the ``i``-th key, timed sequentially (one thread) and with ``threads`` threads
on a key each, in rounds that rotate the variants' order; ratios are taken within a round.

- ``raw``: ``redis.Redis.from_url(url).get(key)`` (sync redis-py with hiredis): the baseline;
- ``get``: ``fcs.get(key)``;
- ``do``: ``fcs.do(key, loader)`` on a cached key (the loader must never run);
- ``do-near``: the same on a cache with its near cache on (a hot key: no round trip; the
  copy is read in the calling thread).

Round trips: ``stats["commands"]`` per ``fcs.do`` of fresh keys, a miss then a hit (the
near cache off), one key at a time.

Stampede: ``processes`` worker processes (``python -m bench._sync URL``, each one
``FlightCacheSync``) start ``callers`` threads each on one fresh key at one
``time.monotonic()`` instant; the loader blocks (``time.sleep``) in a worker thread and
returns its pid and end time. The worker answers as ``bench._worker`` does, so the rounds
are read by ``_stampede.caller_figures``.

Floor, in the same run and the same workers, alternating with the stampede's rounds: each
worker's ``callers`` threads wait on one ``threading.Event``, set by a thread of the worker
blocked in a raw redis-py ``XREAD BLOCK``; this process ``XADD``s once all are blocked. Its
wake lag (a thread's wake minus the instant before the ``XADD``) is what Python threads
cost here to be woken by one Redis notification, with no library between.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio as aioredis

from flightcache import FlightCacheSync

from . import _orders, _stampede
from ._rounds import MODES, PAYLOAD, VALUE, Samples, figures
from ._util import summary

VARIANTS = ("raw", "get", "do", "do-near")
LABELS = {
    "raw": "raw GET (sync redis-py, from_url)",
    "get": "fcs.get(key)",
    "do": "fcs.do(key, loader), cached",
    "do-near": "fcs.do(key, loader), near cache on",
}
NAMESPACE = "bench-sync"
SyncOp = Callable[[int], Any]


class Loader:
    """Returns VALUE and counts its runs: on cached keys ``fcs.do`` must never run it."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> dict[str, Any]:
        self.calls += 1
        return VALUE


def sequential(op: SyncOp, ops: int, seconds: float) -> tuple[int, float, float]:
    done = 0
    cpu = time.process_time()
    start = time.perf_counter()
    deadline = start + seconds
    while done < ops:
        op(0)
        done += 1
        if done % 64 == 0 and time.perf_counter() >= deadline:
            break
    return done, time.perf_counter() - start, time.process_time() - cpu


def concurrent(op: SyncOp, ops: int, seconds: float, threads: int) -> tuple[int, float, float]:
    """``threads`` threads, each on its own key, until ``ops`` in all or ``seconds``."""
    counts = [0] * threads
    each = max(1, ops // threads)
    go = threading.Barrier(threads + 1)
    deadline = 0.0

    def one(i: int) -> None:
        go.wait()
        while counts[i] < each:
            op(i)
            counts[i] += 1
            if counts[i] % 16 == 0 and time.perf_counter() >= deadline:
                break

    workers = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    cpu = time.process_time()
    start = time.perf_counter()
    deadline = start + seconds
    go.wait()
    for w in workers:
        w.join()
    return sum(counts), time.perf_counter() - start, time.process_time() - cpu


def run_hits(
    url: str, *, rounds: int = 3, ops: int = 10_000, seconds: float = 1.0, threads: int = 16
) -> dict[str, Any]:
    raw = redis.Redis.from_url(url)
    fcs = FlightCacheSync(url, namespace=NAMESPACE, near_cache=False)
    near = FlightCacheSync(url, namespace=NAMESPACE, near_cache=True)
    loader = Loader()
    keys = [f"hit:{i}" for i in range(threads)]
    raw_keys = [f"bench-sync-raw:{i}" for i in range(threads)]
    try:
        raw.mset(dict.fromkeys(raw_keys, PAYLOAD))
        for key in keys:
            fcs.do(key, loader, ttl=3600)
        ops_by_variant: dict[str, SyncOp] = {
            "raw": lambda i: raw.get(raw_keys[i]),
            "get": lambda i: fcs.get(keys[i]),
            "do": lambda i: fcs.do(keys[i], loader, ttl=3600),
            "do-near": lambda i: near.do(keys[i], loader, ttl=3600),
        }
        for name, op in ops_by_variant.items():  # right values, connections open
            got, want = op(0), PAYLOAD if name == "raw" else VALUE
            if got != want:
                raise RuntimeError(f"sync hit path {name}: read {got!r}, expected {want!r}")
            concurrent(op, threads * 4, 5.0, threads)
        loader.calls = 0
        stats_before = fcs.stats
        rate: Samples = {mode: {v: [] for v in VARIANTS} for mode in MODES}
        cpu_us: Samples = {mode: {v: [] for v in VARIANTS} for mode in MODES}
        for r in range(rounds):
            order = [*VARIANTS[r % len(VARIANTS) :], *VARIANTS[: r % len(VARIANTS)]]
            for mode in MODES:
                for name in order:
                    op = ops_by_variant[name]
                    sequential(op, 200, 0.5)  # warm this variant's path again
                    if mode == "sequential":
                        n, dt, cpu = sequential(op, ops, seconds)
                    else:
                        n, dt, cpu = concurrent(op, ops, seconds, threads)
                    rate[mode][name].append(n / dt)
                    cpu_us[mode][name].append(cpu / n * 1e6)
        if loader.calls:
            raise RuntimeError(f"fcs.do on cached keys ran the loader {loader.calls} times")
        stats_after = fcs.stats
        trips = round_trips(fcs, loader)
    finally:
        fcs.close()
        near.close()
        raw.close()
    result: dict[str, Any] = {
        "config": {
            "rounds": rounds,
            "ops_per_measurement": ops,
            "seconds_per_measurement": seconds,
            "threads": threads,
            "value_bytes": len(PAYLOAD),
        },
        "round_trips": trips,
        "fc_stats_delta": {
            k: stats_after[k] - stats_before.get(k, 0)
            for k in stats_after
            if stats_after[k] != stats_before.get(k, 0)
        },
    }
    for mode in MODES:
        result[mode] = {name: figures(rate, cpu_us, mode, name) for name in VARIANTS}
    return result


def round_trips(fcs: FlightCacheSync, loader: Loader, keys: int = 20) -> dict[str, float]:
    """Commands per call (``stats["commands"]``: every round trip the client sends, from
    the caller's thread or the loop's) for a miss and a hit of fresh keys, one at a time."""
    run = uuid.uuid4().hex[:8]
    fresh = [f"trips:{run}:{i}" for i in range(keys)]
    before = fcs.stats["commands"]
    for key in fresh:
        fcs.do(key, loader, ttl=60)
    middle = fcs.stats["commands"]
    for key in fresh:
        fcs.do(key, loader, ttl=60)
    after = fcs.stats["commands"]
    return {"miss": (middle - before) / keys, "hit": (after - middle) / keys}


async def _floor_round(
    ctl: aioredis.Redis, workers: list[_orders.Worker], *, key: str, callers: int
) -> list[float]:
    """One floor round: the wake lags (ms) of every worker's threads."""
    blocked_before = int((await ctl.info("clients"))["blocked_clients"])
    order = {"op": "floor", "key": key, "callers": callers, "timeout": _stampede.ROUND_TIMEOUT_S}
    await asyncio.gather(*(w.send(order) for w in workers))
    deadline = time.monotonic() + _stampede.ROUND_TIMEOUT_S
    while int((await ctl.info("clients"))["blocked_clients"]) < blocked_before + len(workers):
        if time.monotonic() > deadline:  # a setup wait, not a waiter: bounded, then fails
            raise TimeoutError("the floor's readers did not all block")
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # every thread in its wait
    sent = time.monotonic()
    await ctl.xadd(key, {"v": "1"})
    replies = await asyncio.gather(*(w.receive(_stampede.ROUND_TIMEOUT_S + 5) for w in workers))
    await ctl.delete(key)
    return [(t - sent) * 1000 for r in replies for t in r["woken"]]


async def run_stampede(
    url: str, *, processes: int = 4, callers: int = 50, rounds: int = 5, loader_s: float = 0.2
) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:8]
    results = []
    floor: list[float] = []
    floor_p99: list[float] = []
    ctl = aioredis.Redis.from_url(url)
    try:
        async with _orders.started(processes, url, module="bench._sync") as workers:
            for number in range(1, rounds + 1):
                start_at, replies = await _stampede.stampede_round(
                    workers,
                    key=f"sync-stampede:{run_id}:{number}",
                    callers=callers,
                    loader_s=loader_s,
                )
                results.append(_stampede.caller_figures(replies, start_at))
                key = f"sync-floor:{run_id}:{number}"
                lags = await _floor_round(ctl, workers, key=key, callers=callers)
                floor += lags
                floor_p99.append(summary(lags)["p99"])
    finally:
        await ctl.aclose()
    pooled = _stampede.pooled(results, processes=processes, callers=callers, loader_s=loader_s)
    pooled["arrival_spread_ms"] = [r["arrival_spread_ms"] for r in results]
    pooled["floor_wake_lag_ms"] = summary(floor)
    pooled["floor_p99_ms_per_round"] = floor_p99
    return pooled


# -- the worker process: python -m bench._sync URL ----------------------------------------


def warm(fcs: FlightCacheSync, msg: dict[str, Any]) -> dict[str, Any]:
    pid = os.getpid()
    fcs.do(f"warm:{pid}:{time.monotonic_ns()}", lambda: {"warm": pid}, ttl=5)
    gets = [
        threading.Thread(target=fcs.get, args=(f"warm:{pid}:{i}",))
        for i in range(int(msg.get("connections", 4)))
    ]
    for t in gets:
        t.start()
    for t in gets:
        t.join()
    return {"pid": pid}


def stampede(fcs: FlightCacheSync, msg: dict[str, Any]) -> dict[str, Any]:
    """``callers`` threads call ``fcs.do(key, loader)`` at ``start_at``; the reply has the
    shape of ``bench._worker``'s: loader ends, and per caller [t0, t1, owner pid, loader
    end, error]."""
    key = str(msg["key"])
    callers = int(msg["callers"])
    loader_s = float(msg["loader_s"])
    start_at = float(msg["start_at"])
    pid = os.getpid()
    loader_ends: list[float] = []
    results: list[list[Any]] = [[] for _ in range(callers)]

    def loader() -> dict[str, Any]:
        time.sleep(loader_s)  # blocks its worker thread, as a sync loader does
        end = time.monotonic()
        loader_ends.append(end)
        return {"pid": pid, "end": end}

    def caller(i: int) -> None:
        time.sleep(max(0.0, start_at - time.monotonic()))
        t0 = time.monotonic()
        try:
            value = fcs.do(key, loader, ttl=60)
        except Exception as exc:  # reported, not raised: the parent decides
            results[i] = [t0, time.monotonic(), None, None, f"{type(exc).__name__}: {exc}"]
            return
        results[i] = [t0, time.monotonic(), value["pid"], value["end"], None]

    before = fcs.stats
    threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(float(msg["timeout"]))
    after = fcs.stats
    return {
        "pid": pid,
        "loader_ends": loader_ends,
        "callers": results,
        "stats": {name: after[name] - before.get(name, 0) for name in after},
    }


def floor(fcs: FlightCacheSync, msg: dict[str, Any]) -> dict[str, Any]:
    """``callers`` threads wait on one ``threading.Event``, set once a raw redis-py
    ``XREAD BLOCK`` on ``key`` returns; each thread's ``time.monotonic()`` on waking."""
    woken: list[float] = []
    ready = threading.Event()

    def waiter() -> None:
        ready.wait()
        woken.append(time.monotonic())

    threads = [threading.Thread(target=waiter) for _ in range(int(msg["callers"]))]
    for t in threads:
        t.start()
    raw = redis.Redis.from_url(fcs.url)
    try:
        raw.xread({str(msg["key"]): "0"}, block=int(float(msg["timeout"]) * 1000))
    finally:
        ready.set()  # never leave a thread waiting
        raw.close()
    for t in threads:
        t.join(float(msg["timeout"]))
    return {"pid": os.getpid(), "woken": woken}


def worker_main(url: str) -> int:
    handlers = {"warm": warm, "stampede": stampede, "floor": floor}
    # node_ttl=60: the liveness heartbeat stays out of the rounds (as bench._worker).
    fcs = FlightCacheSync(url, namespace=NAMESPACE, lease=3.0, node_ttl=60.0)
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            op = msg.get("op")
            if op == "quit":
                return 0
            try:
                handler = handlers.get(op)
                reply = handler(fcs, msg) if handler else {"error": f"unknown op {op!r}"}
            except Exception:
                reply = {"error": traceback.format_exc()}
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
            if "error" in reply:
                return 1
        return 0
    finally:
        fcs.close()


if __name__ == "__main__":
    try:
        sys.exit(worker_main(sys.argv[1]))
    except KeyboardInterrupt:
        sys.exit(130)
