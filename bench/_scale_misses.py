"""Phase 7, misses/s: in this process, ``keys`` distinct keys asked once each,
``concurrency`` at a time, loader returning at once: ``fc.do`` next to plain redis-py GET,
then SET on a miss, in rounds that alternate the order; the ratio is taken within each
round. Commands per miss: ``INFO commandstats`` (everything the server ran, inside Lua too)
and ``fc.stats["commands"]`` over the timed rounds, and the commands sent on the wire for
``monitor_keys`` more misses of each, seen by ``MONITOR``.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import redis.asyncio as aioredis

from flightcache import FlightCache

from ._probes import _commandstats, _server_cpu
from ._rounds import ratio
from ._stampede import Monitor
from ._util import SETUP_COMMANDS, delta, median

TTL_S = 600

Op = Callable[[str, int], Awaitable[Any]]


async def _load(i: int) -> dict[str, int]:
    return {"i": i}


async def _each_once(op: Op, prefix: str, keys: int, concurrency: int) -> dict[str, Any]:
    """``op(f"{prefix}:{i}", i)`` for every ``i`` once, ``concurrency`` at a time."""
    next_i = wrong = 0
    errors: list[str] = []

    async def one() -> None:
        nonlocal next_i, wrong
        while next_i < keys:
            i = next_i
            next_i += 1
            try:
                value = await op(f"{prefix}:{i}", i)
            except Exception as exc:  # counted, not raised: the report shows them
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            wrong += value != {"i": i}

    cpu = time.process_time()
    started = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(one() for _ in range(concurrency))), 120)
    elapsed = time.perf_counter() - started
    return {
        "keys": keys,
        "seconds": elapsed,
        "per_s": keys / elapsed,
        "cpu_us": (time.process_time() - cpu) / keys * 1e6,
        "wrong": wrong,
        "errors": errors[:5],
        "error_count": len(errors),
    }


async def _on_the_wire(
    ctl: aioredis.Redis, url: str, ops: dict[str, Op], run_id: str, keys: int, concurrency: int
) -> dict[str, dict[str, float]]:
    """Commands sent per miss (top level, connection setup left out), seen by MONITOR."""
    monitor = Monitor(url)
    out: dict[str, dict[str, float]] = {}
    try:
        await monitor.start()
        for name, op in ops.items():
            start, end = f"bench-miss-{run_id}-{name}-start", f"bench-miss-{run_id}-{name}-end"
            await ctl.echo(start)
            await _each_once(op, f"wire:{run_id}:{name}", keys, concurrency)
            await ctl.echo(end)
            lo, hi = await monitor.wait_for_marker(start), await monitor.wait_for_marker(end)
            sent = Counter(
                entry[2]
                for entry in monitor.entries[lo + 1 : hi]
                if entry[0] != "lua" and entry[2] not in SETUP_COMMANDS
            )
            out[name] = {n: v / keys for n, v in sorted(sent.items())}
    finally:
        await monitor.stop()
    return out


async def run_misses(
    url: str, *, keys: int = 5_000, rounds: int = 3, concurrency: int = 100, monitor_keys: int = 100
) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:8]
    ctl = aioredis.Redis.from_url(url)
    raw = aioredis.Redis.from_url(url)
    fc = FlightCache(url, namespace=f"bench-miss-{run_id}", near_cache=False, node_ttl=60.0)

    async def get_then_set(key: str, i: int) -> Any:
        cached = await raw.get(key)
        if cached is not None:
            return orjson.loads(cached)
        value = await _load(i)
        await raw.set(key, orjson.dumps(value), ex=TTL_S)
        return value

    def do(key: str, i: int) -> Awaitable[Any]:
        return fc.do(key, functools.partial(_load, i), ttl=TTL_S)

    ops: dict[str, Op] = {"get-set": get_then_set, "do": do}
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in ops}
    try:
        for name, op in ops.items():  # scripts loaded, connections open
            await _each_once(op, f"warm:{run_id}:{name}", 4 * concurrency, concurrency)
        for r in range(rounds):
            for name in list(ops) if r % 2 == 0 else list(ops)[::-1]:
                before, stats = await _commandstats(ctl), fc.stats
                server_cpu = await _server_cpu(ctl)
                got = await _each_once(ops[name], f"miss:{run_id}:{r}:{name}", keys, concurrency)
                got["server_cpu_us"] = (await _server_cpu(ctl) - server_cpu) / keys * 1e6
                ran = delta(before, await _commandstats(ctl))
                got["server_commands"] = ran
                got["client_commands"] = fc.stats["commands"] - stats["commands"]
                samples[name].append(got)
        wire = await _on_the_wire(ctl, url, ops, run_id, monitor_keys, concurrency)
    finally:
        await fc.aclose()
        await raw.aclose()
        await ctl.aclose()

    def variant(name: str) -> dict[str, Any]:
        runs = samples[name]
        total = sum(r["keys"] for r in runs)
        server = Counter[str]()
        for r in runs:
            server.update(r["server_commands"])
        return {
            "misses_per_s": median([r["per_s"] for r in runs]),
            "samples": [r["per_s"] for r in runs],
            "cpu_us_per_miss": median([r["cpu_us"] for r in runs]),
            "server_cpu_us_per_miss": median([r["server_cpu_us"] for r in runs]),
            "server_commands_per_miss": sum(server.values()) / total,
            "server_by_name_per_miss": {n: v / total for n, v in sorted(server.items())},
            "sent_per_miss_monitor": sum(wire[name].values()),
            "sent_by_name_per_miss_monitor": wire[name],
            "wrong": sum(r["wrong"] for r in runs),
            "errors": [e for r in runs for e in r["errors"]][:5],
            "error_count": sum(r["error_count"] for r in runs),
        }

    result = {name: variant(name) for name in ops}
    result["do"]["client_commands_per_miss"] = sum(
        r["client_commands"] for r in samples["do"]
    ) / sum(r["keys"] for r in samples["do"])
    return {
        "config": {
            "keys": keys,
            "rounds": rounds,
            "concurrency": concurrency,
            "monitor_keys": monitor_keys,
        },
        **result,
        "ratio": ratio(result["do"]["samples"], result["get-set"]["samples"]),
    }
