"""Phase 3: the gateway, as a client sees it: two ``flightcache serve`` replicas sharing the
bench's server, in front of one ``flightcache mock-upstream``, all separate processes on
127.0.0.1, driven by ``httpx.AsyncClient`` objects in this process (at most ``CLIENT_SHARE``
requests in flight on each).

- Upstream calls per burst: ``burst`` concurrent identical streaming chat requests, split
  evenly over the two replicas, a fresh prompt each burst; the upstream calls are the delta
  of the mock's ``GET /stats`` ``calls``. Baseline, same run: one burst of the same shape with
  ``X-Flightcache-Coalesce: off`` (what the upstream would see without coalescing).
- Follower time to first token minus the owner's: each round sends ``per_gateway`` identical
  streaming requests to each replica at once (fresh prompt); the response marked
  ``X-Cache: MISS`` is the owner, ``COALESCED`` ones are followers, in the owner's replica
  (local) or the other one (remote). TTFT is measured per request by the client, from
  sending it to the first SSE event carrying content.
- Overhead on a hit: with the mock's latency set to 0, sequential non-stream requests, the
  same body sent to the mock directly and to a replica (a cached answer: ``X-Cache: HIT``),
  alternated, over one keep-alive client.
- Requests/s on cached hits: ``concurrency`` coroutines sending a cached non-stream request
  to one replica, bounded in time; baseline, the same load on the mock directly.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import redis.asyncio as aioredis

from ._probes import _cpu_seconds, _server_cpu
from ._services import Service, stop_all
from ._util import median, summary

CHAT = "/v1/chat/completions"
HEADERS = {"authorization": "Bearer sk-bench-not-a-real-key", "content-type": "application/json"}
BYPASS = {**HEADERS, "x-flightcache-coalesce": "off"}
MODEL = "mock-chat"
# The mock for the burst and TTFT parts: first token after LATENCY_MS, then TOKENS_PER_S.
LATENCY_MS = 200.0
TOKENS_PER_S = 200.0
TEXT_TOKENS = 32
# Requests in flight per httpx client: its pool scans every connection for each request
# (polling the idle ones), which costs milliseconds with a hundred connections in one pool.
CLIENT_SHARE = 8


def _body(prompt: str, *, stream: bool) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "stream": stream,
        }
    )


@dataclass
class StreamResult:
    gateway: int
    status: int = 0
    cache: str = ""
    started: float = 0.0
    first_token: float | None = None
    ended: float = 0.0
    text: str = ""
    done: bool = False
    error: str | None = None
    events: int = 0

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token is None else (self.first_token - self.started) * 1000


async def _stream(
    client: httpx.AsyncClient, base: str, gateway: int, body: bytes, headers: dict[str, str]
) -> StreamResult:
    """One streaming request, read to its end; never raises (the error is recorded)."""
    result = StreamResult(gateway)
    parts: list[str] = []
    result.started = time.perf_counter()
    try:
        async with client.stream("POST", base + CHAT, content=body, headers=headers) as r:
            result.status = r.status_code
            result.cache = r.headers.get("x-cache", "")
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    result.done = True  # read on to the end: the connection is kept alive
                    continue
                event = orjson.loads(data)
                result.events += 1
                if "error" in event:
                    result.error = f"SSE error: {event['error']}"
                    break
                for choice in event.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if result.first_token is None:
                            result.first_token = time.perf_counter()
                        parts.append(content)
    except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.ended = time.perf_counter()
        result.text = "".join(parts)
    if result.error is None and not result.done:
        result.error = "the stream ended without [DONE]"
    return result


def _pick(clients: list[httpx.AsyncClient], i: int) -> httpx.AsyncClient:
    return clients[i % len(clients)]


class _Mock:
    def __init__(self, client: httpx.AsyncClient, service: Service) -> None:
        self.client = client
        self.url = service.url

    async def calls(self) -> int:
        r = await self.client.get(self.url + "/stats")
        r.raise_for_status()
        return int(r.json()["calls"])

    async def control(self, **settings: Any) -> None:
        r = await self.client.post(self.url + "/control", json=settings)
        r.raise_for_status()


async def _burst(
    clients: list[httpx.AsyncClient],
    mock: _Mock,
    gateways: list[str],
    prompt: str,
    size: int,
    headers: dict[str, str],
) -> dict[str, Any]:
    body = _body(prompt, stream=True)
    before = await mock.calls()
    started = time.perf_counter()
    results = await asyncio.gather(
        *(_stream(_pick(clients, i), gateways[i % 2], i % 2, body, headers) for i in range(size))
    )
    elapsed = time.perf_counter() - started
    calls = await mock.calls() - before
    errors = [r.error for r in results if r.error is not None]
    texts = {r.text for r in results if r.error is None}
    return {
        "requests": size,
        "upstream_calls": calls,
        "x_cache": dict(sorted(Counter(r.cache for r in results).items())),
        "errors": errors[:5],
        "error_count": len(errors),
        "distinct_texts": len(texts),
        "text_chars": len(next(iter(texts))) if len(texts) == 1 else None,
        "seconds": elapsed,
    }


async def _ttft_round(
    clients: list[httpx.AsyncClient],
    gateways: list[str],
    prompt: str,
    per_gateway: int,
    flip: bool,
) -> dict[str, Any]:
    body = _body(prompt, stream=True)
    order = [(g if not flip else 1 - g) for _ in range(per_gateway) for g in (0, 1)]
    results = await asyncio.gather(
        *(_stream(_pick(clients, i), gateways[g], g, body, HEADERS) for i, g in enumerate(order))
    )
    owners = [r for r in results if r.cache == "MISS" and r.error is None]
    errors = [r.error for r in results if r.error is not None]
    out: dict[str, Any] = {
        "x_cache": dict(sorted(Counter(r.cache for r in results).items())),
        "errors": errors,
        "owner_ttft_ms": None,
        "local_diff_ms": [],
        "remote_diff_ms": [],
        "local_gap_ms": [],
        "remote_gap_ms": [],
    }
    if len(owners) != 1 or owners[0].first_token is None:
        return out
    owner = owners[0]
    owner_first = owner.first_token
    assert owner_first is not None and owner.ttft_ms is not None
    out["owner_ttft_ms"] = owner.ttft_ms
    out["owner_gateway"] = owner.gateway
    for r in results:
        if r.cache != "COALESCED" or r.first_token is None or r.ttft_ms is None:
            continue
        where = "local" if r.gateway == owner.gateway else "remote"
        out[f"{where}_diff_ms"].append(r.ttft_ms - owner.ttft_ms)
        out[f"{where}_gap_ms"].append((r.first_token - owner_first) * 1000)
    return out


async def _overhead(
    client: httpx.AsyncClient, mock_url: str, gateway: str, prompt: str, n: int, seconds: float
) -> dict[str, Any]:
    """Sequential non-stream requests, alternating: the mock directly, then a cached hit."""
    body = _body(prompt, stream=False)
    primed = await client.post(gateway + CHAT, content=body, headers=HEADERS)
    primed.raise_for_status()

    async def timed(url: str) -> tuple[float, httpx.Response]:
        t0 = time.perf_counter()
        r = await client.post(url + CHAT, content=body, headers=HEADERS)
        return (time.perf_counter() - t0) * 1000, r

    for _ in range(20):  # warm both paths
        await timed(mock_url)
        await timed(gateway)
    direct: list[float] = []
    via: list[float] = []
    not_hit = errors = 0
    deadline = time.perf_counter() + seconds
    for i in range(n):
        for url in (mock_url, gateway) if i % 2 == 0 else (gateway, mock_url):
            ms, r = await timed(url)
            if r.status_code != 200:
                errors += 1
            if url == gateway:
                via.append(ms)
                not_hit += r.headers.get("x-cache") != "HIT"
            else:
                direct.append(ms)
        if time.perf_counter() >= deadline:
            break
    d, g = summary(direct), summary(via)
    return {
        "requests_each": len(direct),
        "direct_ms": d,
        "gateway_hit_ms": g,
        "overhead_p50_ms": g["p50"] - d["p50"],
        "overhead_p99_ms": g["p99"] - d["p99"],
        "not_hit": not_hit,
        "errors": errors,
    }


async def _rate(
    clients: list[httpx.AsyncClient],
    url: str,
    body: bytes,
    seconds: float,
    concurrency: int,
    server_pid: int,
    redis: aioredis.Redis,
) -> dict[str, Any]:
    """``concurrency`` coroutines, spread over ``clients`` (httpx's pool gets costly with
    many requests in flight on one client), for ``seconds``; the CPU time this process, the
    server process and the Redis server spent meanwhile, per request."""
    count = errors = not_hit = 0
    cap = 200_000

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal count, errors, not_hit
        while count < cap and time.perf_counter() < deadline:
            count += 1
            r = await client.post(url + CHAT, content=body, headers=HEADERS)
            if r.status_code != 200:
                errors += 1
            elif r.headers.get("x-cache", "HIT") != "HIT":
                not_hit += 1

    redis_cpu = await _server_cpu(redis)
    server_cpu = _cpu_seconds(server_pid)
    cpu = time.process_time()
    started = time.perf_counter()
    deadline = started + seconds
    await asyncio.gather(*(one(_pick(clients, i)) for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    client_cpu = time.process_time() - cpu
    server_cpu = _cpu_seconds(server_pid) - server_cpu
    redis_cpu = await _server_cpu(redis) - redis_cpu
    return {
        "requests": count,
        "seconds": elapsed,
        "rps": count / elapsed,
        "client_cpu_us": client_cpu / count * 1e6,
        "server_cpu_us": server_cpu / count * 1e6,
        "redis_cpu_us": redis_cpu / count * 1e6,
        "errors": errors,
        "not_hit": not_hit,
    }


async def _start(redis_url: str, namespace: str, services: list[Service]) -> None:
    mock_args = ["mock-upstream", "--port", "0", "--latency-ms", f"{LATENCY_MS:g}"]
    mock_args += ["--tokens-per-s", f"{TOKENS_PER_S:g}"]
    mock = await Service.start("mock-upstream", mock_args)
    services.append(mock)
    args = ["serve", "--upstream", mock.url, "--redis", redis_url, "--port", "0"]
    started = await asyncio.gather(
        *(Service.start(f"gateway-{n}", [*args, "--namespace", namespace]) for n in "AB"),
        return_exceptions=True,
    )
    services.extend(s for s in started if isinstance(s, Service))
    for s in started:
        if isinstance(s, BaseException):
            raise s


async def run(
    redis_url: str,
    *,
    bursts: int = 5,
    burst_size: int = 100,
    ttft_rounds: int = 8,
    per_gateway: int = 10,
    overhead_requests: int = 500,
    overhead_s: float = 3.0,
    rate_rounds: int = 2,
    rate_s: float = 1.0,
    concurrency: int = 32,
) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:8]
    services: list[Service] = []
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(60.0))
    in_flight = max(burst_size, 2 * per_gateway, concurrency)
    clients = [
        httpx.AsyncClient(timeout=httpx.Timeout(60.0))
        for _ in range(math.ceil(in_flight / CLIENT_SHARE))
    ]
    redis = aioredis.Redis.from_url(redis_url)
    try:
        await _start(redis_url, f"bench-gw-{run_id}", services)
        mock_service, gw_a, gw_b = services
        gateways = [gw_a.url, gw_b.url]
        mock = _Mock(client, mock_service)
        await mock.control(
            latency_ms=LATENCY_MS, tokens_per_s=TOKENS_PER_S, text_tokens=TEXT_TOKENS
        )
        # Open the keep-alive connections a burst needs, and one flight through each replica.
        await asyncio.gather(
            *(_pick(clients, i).get(gateways[i % 2] + "/healthz") for i in range(in_flight))
        )
        for g, url in enumerate(gateways):
            warm = await _stream(client, url, g, _body(f"warm {run_id} {g}", stream=True), HEADERS)
            if warm.error is not None:
                raise RuntimeError(f"gateway {'AB'[g]} failed a warm-up request: {warm.error}")

        burst_results = [
            await _burst(clients, mock, gateways, f"burst {run_id} {i}", burst_size, HEADERS)
            for i in range(bursts)
        ]
        bypass = await _burst(clients, mock, gateways, f"bypass {run_id}", burst_size, BYPASS)

        rounds = []
        for i in range(ttft_rounds):
            before = await mock.calls()
            r = await _ttft_round(clients, gateways, f"ttft {run_id} {i}", per_gateway, i % 2 == 1)
            r["upstream_calls"] = await mock.calls() - before
            rounds.append(r)

        await mock.control(latency_ms=0, tokens_per_s=None)
        overhead = await _overhead(
            client, mock.url, gw_a.url, f"overhead {run_id}", overhead_requests, overhead_s
        )
        hit_body = _body(f"overhead {run_id}", stream=False)  # cached by the overhead part
        rate: dict[str, list[dict[str, Any]]] = {"gateway": [], "direct": []}
        targets = {"gateway": gw_a, "direct": mock_service}
        for service in targets.values():  # open every client's connections
            await _rate(clients, service.url, hit_body, 0.1, concurrency, service.pid, redis)
        for i in range(rate_rounds):
            for name in ("gateway", "direct") if i % 2 == 0 else ("direct", "gateway"):
                service = targets[name]
                rate[name].append(
                    await _rate(
                        clients, service.url, hit_body, rate_s, concurrency, service.pid, redis
                    )
                )
    finally:
        try:
            await stop_all(services)
        finally:
            for c in (client, *clients):
                await c.aclose()
            await redis.aclose()
    return _aggregate(
        burst_results,
        bypass,
        rounds,
        overhead,
        rate,
        config={
            "bursts": bursts,
            "burst_size": burst_size,
            "ttft_rounds": ttft_rounds,
            "per_gateway": per_gateway,
            "mock_latency_ms": LATENCY_MS,
            "mock_tokens_per_s": TOKENS_PER_S,
            "mock_text_tokens": TEXT_TOKENS,
            "overhead_requests": overhead_requests,
            "overhead_s": overhead_s,
            "rate_rounds": rate_rounds,
            "rate_s": rate_s,
            "concurrency": concurrency,
        },
    )


def _aggregate(
    bursts: list[dict[str, Any]],
    bypass: dict[str, Any],
    rounds: list[dict[str, Any]],
    overhead: dict[str, Any],
    rate: dict[str, list[dict[str, Any]]],
    *,
    config: dict[str, Any],
) -> dict[str, Any]:
    def pooled(field: str) -> list[float]:
        return [x for r in rounds for x in r[field]]

    local, remote = pooled("local_diff_ms"), pooled("remote_diff_ms")
    owners = [r["owner_ttft_ms"] for r in rounds if r["owner_ttft_ms"] is not None]
    x_cache = Counter[str]()
    for r in rounds:
        x_cache.update(r["x_cache"])
    gw_rps = median([r["rps"] for r in rate["gateway"]])
    direct_rps = median([r["rps"] for r in rate["direct"]])
    return {
        "config": config,
        "bursts": bursts,
        "upstream_calls_per_burst": [b["upstream_calls"] for b in bursts],
        "burst_errors": sum(b["error_count"] for b in bursts),
        "burst_mismatched": sum(b["distinct_texts"] > 1 for b in bursts),
        "bypass_burst": bypass,
        "ttft": {
            "rounds_with_one_owner": len(owners),
            "upstream_calls_per_round": [r["upstream_calls"] for r in rounds],
            "x_cache": dict(sorted(x_cache.items())),
            "errors": [e for r in rounds for e in r["errors"]][:5],
            "owner_ttft_ms": summary(owners),
            "worst_follower_minus_owner_ms_per_round": [
                max(r["local_diff_ms"] + r["remote_diff_ms"], default=math.nan) for r in rounds
            ],
            "follower_minus_owner_ms": {
                "all": summary(local + remote),
                "local": summary(local),
                "remote": summary(remote),
            },
            "first_token_gap_ms": {
                "local": summary(pooled("local_gap_ms")),
                "remote": summary(pooled("remote_gap_ms")),
            },
        },
        "overhead": overhead,
        "hit_rate": {
            "gateway_rps": gw_rps,
            "direct_rps": direct_rps,
            "ratio_to_direct": gw_rps / direct_rps if direct_rps else float("nan"),
            "cpu_us_per_request": {
                name: {
                    part: median([r[f"{part}_cpu_us"] for r in rounds])
                    for part in ("client", "server", "redis")
                }
                for name, rounds in rate.items()
            },
            "errors": sum(r["errors"] for rs in rate.values() for r in rs),
            "not_hit": sum(r["not_hit"] for r in rate["gateway"]),
            "rounds": rate,
        },
    }
