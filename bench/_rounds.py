"""Timed reads of cached values in alternating rounds: the hit-path and near-cache phases.

Each phase names its variants (``raw`` is a raw redis-py GET, the baseline; the others read
through flightcache) as operations ``op(i)`` on the ``i``-th key. Every variant is measured
sequentially (one coroutine) and with ``concurrency`` coroutines, each on a key of its own,
in rounds that rotate the variants' order, so drift and noise on a small machine hit every
variant alike; ratios are taken within a round, and the median over rounds is reported.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import orjson
import redis.asyncio as aioredis

from flightcache import FlightCache

from ._util import median

VALUE = {"role": "assistant", "content": "A cached completion of about a hundred bytes." * 2}
PAYLOAD = b"j" + orjson.dumps(VALUE)  # the same bytes flightcache stores for VALUE
MODES = ("sequential", "concurrent")

Op = Callable[[int], Awaitable[Any]]
Samples = dict[str, dict[str, list[float]]]  # mode -> variant -> one figure per round


class Loader:
    """Returns VALUE and counts its runs: on cached keys ``fc.do`` must never run it."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self) -> dict[str, Any]:
        self.calls += 1
        return VALUE


async def sequential(op: Op, ops: int, seconds: float) -> tuple[int, float, float]:
    done = 0
    cpu = time.process_time()
    start = time.perf_counter()
    deadline = start + seconds
    while done < ops:
        await op(0)
        done += 1
        if done % 64 == 0 and time.perf_counter() >= deadline:
            break
    return done, time.perf_counter() - start, time.process_time() - cpu


async def concurrent(
    op: Op, ops: int, seconds: float, concurrency: int
) -> tuple[int, float, float]:
    done = 0
    cpu = time.process_time()
    start = time.perf_counter()
    deadline = start + seconds

    async def one(i: int) -> None:
        nonlocal done
        while done < ops and time.perf_counter() < deadline:
            done += 1
            await op(i)

    await asyncio.gather(*(one(i) for i in range(concurrency)))
    return done, time.perf_counter() - start, time.process_time() - cpu


class Reads:
    """What both phases read: ``concurrency`` keys holding PAYLOAD, read by a raw redis-py
    GET (the baseline), and as many holding VALUE, read through flightcache; the loader
    that must never run; and the measurements. ``async with`` closes the raw client."""

    def __init__(self, url: str, raw_prefix: str, concurrency: int) -> None:
        self.raw = aioredis.Redis.from_url(url)
        self.concurrency = concurrency
        self.loader = Loader()
        self.keys = [f"hit:{i}" for i in range(concurrency)]
        self.raw_keys = [f"{raw_prefix}:{i}" for i in range(concurrency)]

    async def __aenter__(self) -> Reads:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.raw.aclose()

    async def store(self, fc: FlightCache) -> None:
        """PAYLOAD under every raw key; VALUE under every key through ``fc.do`` (ttl 1 h)."""
        await self.raw.mset(dict.fromkeys(self.raw_keys, PAYLOAD))
        for key in self.keys:
            await fc.do(key, self.loader, ttl=3600)

    def raw_get(self, i: int) -> Awaitable[Any]:
        return self.raw.get(self.raw_keys[i])

    def through(self, fc: FlightCache, suffix: str = "") -> dict[str, Op]:
        """The variants ``get<suffix>`` and ``do<suffix>``: ``fc.get`` and ``fc.do``."""
        return {
            f"get{suffix}": lambda i: fc.get(self.keys[i]),
            f"do{suffix}": lambda i: fc.do(self.keys[i], self.loader, ttl=3600),
        }

    async def check_and_warm(self, phase: str, ops: Mapping[str, Op]) -> None:
        """Every variant reads what it should (the raw ones PAYLOAD, the others VALUE), and
        opens every connection it needs."""
        for name, op in ops.items():
            got = await op(0)
            want = PAYLOAD if name.startswith("raw") else VALUE
            if got != want:
                raise RuntimeError(f"{phase} {name}: read {got!r}, expected {want!r}")
            await concurrent(op, self.concurrency * 4, 5.0, self.concurrency)

    async def alternate(
        self,
        ops: Mapping[str, Op],
        variants: Sequence[str],
        *,
        rounds: int,
        budget: Callable[[str], tuple[int, float]],
    ) -> tuple[Samples, Samples]:
        """Ops/s and this process's CPU us per op of every variant in both modes, ``rounds``
        times; ``budget(variant)`` bounds one measurement (ops, seconds). Fails if the
        loader ran meanwhile."""
        self.loader.calls = 0
        rate: Samples = {mode: {v: [] for v in variants} for mode in MODES}
        cpu_us: Samples = {mode: {v: [] for v in variants} for mode in MODES}
        for r in range(rounds):
            order = [*variants[r % len(variants) :], *variants[: r % len(variants)]]
            for mode in MODES:
                for name in order:
                    op = ops[name]
                    n_ops, seconds = budget(name)
                    await sequential(op, 200, 0.5)  # warm this variant's path again
                    if mode == "sequential":
                        n, dt, cpu = await sequential(op, n_ops, seconds)
                    else:
                        n, dt, cpu = await concurrent(op, n_ops, seconds, self.concurrency)
                    rate[mode][name].append(n / dt)
                    cpu_us[mode][name].append(cpu / n * 1e6)
        if self.loader.calls:
            raise RuntimeError(f"fc.do on cached keys ran the loader {self.loader.calls} times")
        return rate, cpu_us


def ratio(values: list[float], base: list[float]) -> float:
    """The median over rounds of each round's ratio (both measured in that round)."""
    return median([v / b for v, b in zip(values, base, strict=True)])


def figures(rate: Samples, cpu_us: Samples, mode: str, name: str) -> dict[str, Any]:
    """One variant's figures in one mode: ops/s median and best, the ratio to raw GET, CPU."""
    values = rate[mode][name]
    return {
        "ops_per_s": median(values),
        "best_ops_per_s": max(values),
        "ratio_to_raw": ratio(values, rate[mode]["raw"]),
        "cpu_us_per_op": median(cpu_us[mode][name]),
        "samples": values,
    }
