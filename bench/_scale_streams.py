"""Phase 7, distinct streams through two gateways: the gateway phase's mock upstream and
two ``flightcache serve`` replicas (``bench._gateway``); ``streams`` distinct prompts, each
asked of both replicas at once (``in_flight`` prompts at a time), every stream read to its
end. Upstream calls (the mock's ``GET /stats``), clients served, the same text as the
upstream's, wall time, and the CPU each process spent. Baseline, same run: the same clients
sending the same requests to the mock directly. Beside them, same run: the same clients
through the same replicas with ``X-Flightcache-Coalesce: off`` (each request proxied to
the mock as it is: 2 upstream calls a prompt), which prices what coalescing adds to plain
proxying. The three passes take turns (``rounds`` rounds, each a slice of the prompts
through all three, the order rotated every round), so a machine whose speed drifts during
the run (a shared host) slows each pass alike; each pass's figures are its rounds' sums.
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
    _Mock,
    _pick,
    _start,
    _stream,
)
from ._probes import ConnectionPeak, _cpu_seconds, _server_cpu
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
        """Adds what each process spends inside the block to ``spent``."""
        before = await self._now()
        yield self
        after = await self._now()
        for name in before:
            self.spent[name] = self.spent.get(name, 0.0) + after[name] - before[name]


class Pass:
    """One way of sending the prompts (direct, via the replicas, relayed): its figures
    summed over its rounds."""

    def __init__(
        self, targets: tuple[str, str], cpu: CPU, headers: dict[str, str] = HEADERS
    ) -> None:
        self.targets, self.cpu, self.headers = targets, cpu, headers
        self.seconds = 0.0
        self.calls = 0
        self.results: list[tuple[StreamResult, StreamResult]] = []

    async def run(
        self, clients: list[httpx.AsyncClient], mock: _Mock, prompts: list[str], in_flight: int
    ) -> None:
        before = await mock.calls()
        async with self.cpu.measuring():
            seconds, results = await _pass(clients, self.targets, prompts, in_flight, self.headers)
        self.calls += await mock.calls() - before
        self.seconds += seconds
        self.results += results


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
    redis_url: str, *, streams: int = 1_000, in_flight: int = 100, rounds: int = 4
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
    rounds = max(1, min(rounds, streams))
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
        direct = Pass((mock.url, mock.url), CPU(ctl, named))
        via = Pass(gateways, CPU(ctl, named))
        relay = Pass(gateways, CPU(ctl, named), BYPASS)
        peaks = [ConnectionPeak(ctl, gw.pid, interval=0.25) for gw in (gw_a, gw_b)]
        order = [direct, via, relay]
        for r in range(rounds):
            part = prompts[r * streams // rounds : (r + 1) * streams // rounds]
            for p in order[r % 3 :] + order[: r % 3]:
                if p is via:
                    async with peaks[0].running(), peaks[1].running():
                        await p.run(clients, mock, part, in_flight)
                else:  # the relayed pass gets fresh prompts: none of them is stored
                    asked = [f"relay {q}" for q in part] if p is relay else part
                    await p.run(clients, mock, asked, in_flight)
    finally:
        try:
            await stop_all(services)
        finally:
            for c in (client, *clients):
                await c.aclose()
            await ctl.aclose()
    texts = [a.text if a.error is None else b.text for a, b in direct.results]  # upstream's
    same_pair = sum(a.text == b.text for a, b in via.results)
    same_as_upstream = sum(
        a.text == t and b.text == t for (a, b), t in zip(via.results, texts, strict=True)
    )
    return {
        "config": {
            "streams": streams,
            "in_flight": in_flight,
            "rounds": rounds,
            "mock_latency_ms": LATENCY_MS,
            "mock_tokens_per_s": TOKENS_PER_S,
            "mock_text_tokens": TEXT_TOKENS,
        },
        "gateway": {
            **_served(via.results),
            "upstream_calls": via.calls,
            "seconds": via.seconds,
            "both_replicas_same_text": same_pair,
            "same_text_as_upstream": same_as_upstream,
            "connections": [p.figures() for p in peaks],
            "cpu_s": via.cpu.spent,
        },
        "direct": {
            **_served(direct.results),
            "upstream_calls": direct.calls,
            "seconds": direct.seconds,
            "cpu_s": direct.cpu.spent,
        },
        "relayed": {
            **_served(relay.results),
            "upstream_calls": relay.calls,
            "seconds": relay.seconds,
            "cpu_s": relay.cpu.spent,
        },
        "wall_time_ratio": via.seconds / direct.seconds,
        "relayed_wall_time_ratio": relay.seconds / direct.seconds,
    }
