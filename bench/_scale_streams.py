"""Phase 7, distinct streams through two gateways: the gateway phase's mock upstream and
two ``flightcache serve`` replicas (``bench._gateway``); ``streams`` distinct prompts, each
asked of both replicas at once (``in_flight`` prompts at a time), every stream read to its
end. Upstream calls (the mock's ``GET /stats``), clients served, the same text as the
upstream's, wall time, and the CPU each process spent. Baseline, same run: the same clients
sending the same requests to the mock directly. Beside them, same run: the same clients
through the same replicas with ``X-Flightcache-Coalesce: off`` (each request proxied to
the mock as it is: 2 upstream calls a prompt), which prices what coalescing adds to plain
proxying.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import redis.asyncio as aioredis

from ._gateway import (
    BYPASS,
    CLIENT_SHARE,
    HEADERS,
    LATENCY_MS,
    TEXT_TOKENS,
    TOKENS_PER_S,
    StreamResult,
    _body,
    _cpu_seconds,
    _Mock,
    _pick,
    _server_cpu,
    _start,
    _stream,
)
from ._probes import ConnectionPeak
from ._services import Service, stop_all
from ._util import summary


async def _pass(
    clients: list[httpx.AsyncClient],
    targets: tuple[str, str],
    prompts: list[str],
    in_flight: int,
    headers: dict[str, str] = HEADERS,
) -> tuple[float, list[tuple[StreamResult, StreamResult]]]:
    """Every prompt asked of both targets at once, ``in_flight`` prompts at a time; each
    stream read to its end. The wall time and each prompt's two results."""
    results: dict[int, tuple[StreamResult, StreamResult]] = {}
    next_i = 0

    async def slot(k: int) -> None:
        nonlocal next_i
        while next_i < len(prompts):
            i = next_i
            next_i += 1
            body = _body(prompts[i], stream=True)
            a, b = await asyncio.gather(
                *(_stream(_pick(clients, 2 * k + j), targets[j], j, body, headers) for j in (0, 1))
            )
            results[i] = (a, b)

    started = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(slot(k) for k in range(in_flight))), 300)
    return time.perf_counter() - started, [results[i] for i in range(len(prompts))]


class CPU:
    """CPU seconds spent by the mock, the two replicas, the Redis server and this process
    over one pass (``/proc/<pid>/stat``, ``INFO cpu``, ``time.process_time``)."""

    def __init__(self, ctl: aioredis.Redis, services: dict[str, Service]) -> None:
        self.ctl, self.services = ctl, services
        self.spent: dict[str, float] = {}

    async def _now(self) -> dict[str, float]:
        now = {name: _cpu_seconds(s.pid) for name, s in self.services.items()}
        return {**now, "redis": await _server_cpu(self.ctl), "client": time.process_time()}

    @contextlib.asynccontextmanager
    async def measuring(self) -> AsyncIterator[CPU]:
        before = await self._now()
        yield self
        after = await self._now()
        self.spent = {name: after[name] - before[name] for name in before}


def _served(results: list[tuple[StreamResult, StreamResult]]) -> dict[str, Any]:
    flat = [r for pair in results for r in pair]
    errors = [r.error for r in flat if r.error is not None]
    return {
        "requests": len(flat),
        "served": sum(r.error is None for r in flat),
        "errors": errors[:5],
        "error_count": len(errors),
        "x_cache": dict(sorted(Counter(r.cache for r in flat if r.cache).items())),
        "latency_ms": summary([(r.ended - r.started) * 1000 for r in flat]),
    }


async def run_streams(
    redis_url: str, *, streams: int = 1_000, in_flight: int = 100
) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:8]
    services: list[Service] = []
    client = httpx.AsyncClient(timeout=httpx.Timeout(60.0))
    clients = [
        httpx.AsyncClient(timeout=httpx.Timeout(60.0))
        for _ in range(math.ceil(2 * in_flight / CLIENT_SHARE))
    ]
    ctl = aioredis.Redis.from_url(redis_url)
    prompts = [f"scale {run_id} {i}" for i in range(streams)]
    try:
        await _start(redis_url, f"bench-gws-{run_id}", services)
        mock_service, gw_a, gw_b = services
        mock = _Mock(client, mock_service)
        await mock.control(
            latency_ms=LATENCY_MS, tokens_per_s=TOKENS_PER_S, text_tokens=TEXT_TOKENS
        )
        gateways = (gw_a.url, gw_b.url)
        # Every client's connections open, one flight through each replica, and the mock.
        for name, urls in (("gateways", gateways), ("mock", (mock.url, mock.url))):
            warm = [f"warm {run_id} {name} {k}" for k in range(in_flight)]
            await _pass(clients, urls, warm, in_flight)

        named = {"mock": mock_service, "gateway_a": gw_a, "gateway_b": gw_b}
        direct_cpu, via_cpu, relay_cpu = CPU(ctl, named), CPU(ctl, named), CPU(ctl, named)
        before = await mock.calls()
        async with direct_cpu.measuring():
            direct_s, direct = await _pass(clients, (mock.url, mock.url), prompts, in_flight)
        direct_calls = await mock.calls() - before

        before = await mock.calls()
        peaks = [ConnectionPeak(ctl, gw.pid, interval=0.25) for gw in (gw_a, gw_b)]
        async with peaks[0].running(), peaks[1].running(), via_cpu.measuring():
            via_s, via = await _pass(clients, gateways, prompts, in_flight)
        via_calls = await mock.calls() - before

        before = await mock.calls()
        relayed = [f"relay {p}" for p in prompts]
        async with relay_cpu.measuring():
            relay_s, relay = await _pass(clients, gateways, relayed, in_flight, BYPASS)
        relay_calls = await mock.calls() - before
    finally:
        try:
            await stop_all(services)
        finally:
            for c in (client, *clients):
                await c.aclose()
            await ctl.aclose()
    texts = [a.text if a.error is None else b.text for a, b in direct]  # the upstream's
    same_pair = sum(a.text == b.text for a, b in via)
    same_as_upstream = sum(
        a.text == t and b.text == t for (a, b), t in zip(via, texts, strict=True)
    )
    return {
        "config": {
            "streams": streams,
            "in_flight": in_flight,
            "mock_latency_ms": LATENCY_MS,
            "mock_tokens_per_s": TOKENS_PER_S,
            "mock_text_tokens": TEXT_TOKENS,
        },
        "gateway": {
            **_served(via),
            "upstream_calls": via_calls,
            "seconds": via_s,
            "both_replicas_same_text": same_pair,
            "same_text_as_upstream": same_as_upstream,
            "connections": [p.figures() for p in peaks],
            "cpu_s": via_cpu.spent,
        },
        "direct": {
            **_served(direct),
            "upstream_calls": direct_calls,
            "seconds": direct_s,
            "cpu_s": direct_cpu.spent,
        },
        "relayed": {
            **_served(relay),
            "upstream_calls": relay_calls,
            "seconds": relay_s,
            "cpu_s": relay_cpu.spent,
        },
        "wall_time_ratio": via_s / direct_s,
        "relayed_wall_time_ratio": relay_s / direct_s,
    }
