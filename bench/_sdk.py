"""Section ``sdk``: the SDK wrappers (``flightcache.integrations``) with the real ``openai``
and ``anthropic`` clients, against one ``flightcache mock-upstream`` process on 127.0.0.1.

- Hit overhead: sequential non-stream calls with the mock's latency at 0 and no pacing, the
  same request made by the plain async client (the mock answers it) and by the wrapped one
  (a stored answer: HIT), alternated; p50/p99 per call, for Chat Completions and Messages.
- Upstream calls per burst: ``processes`` worker processes (``bench._sdk_worker``) each make
  ``callers`` identical wrapped calls at once after a barrier, a fresh prompt each burst,
  for Chat Completions (non-stream), Responses (stream) and Messages (stream); the upstream
  calls are the delta of the mock's ``GET /stats`` ``calls`` after each burst.
- Follower time to first token minus the owner's, on the Responses and Messages streams
  (deterministic requests: a caller that comes after the end gets a HIT, counted apart):
  every caller notes the wall-clock moment its first text delta arrived (one machine, one
  clock); the caller whose outcome is ``MISS`` is the owner, the others followers, in its
  process or another. Starts differ by the barrier's release skew, so the first-delta
  moments are compared directly.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import httpx

from ._services import Service, stop_all
from ._util import python_module, summary

LATENCY_MS = 200  # the mock's time to first token in the bursts
TOKENS_PER_S = 100
LEASE_S = 3.0  # the flights' lease (FlightCache's default)


async def _hit_overhead(
    server_url: str, mock: str, *, ops: int
) -> dict[str, dict[str, dict[str, float]]]:
    import anthropic
    import openai

    from flightcache import FlightCache
    from flightcache.integrations import anthropic as fc_anthropic
    from flightcache.integrations import openai as fc_openai

    out: dict[str, dict[str, dict[str, float]]] = {}
    async with FlightCache(server_url, namespace="bench-sdk-" + uuid.uuid4().hex[:6]) as fc:
        plain_openai = openai.AsyncOpenAI(base_url=f"{mock}/v1", api_key="sk-bench", max_retries=0)
        plain_claude = anthropic.AsyncAnthropic(base_url=mock, api_key="ak-bench", max_retries=0)
        cases = {
            "chat": (
                plain_openai.chat.completions.create,
                fc_openai.coalesce(plain_openai, fc).chat.completions.create,
                {
                    "model": "mock-chat",
                    "messages": [{"role": "user", "content": "hit overhead"}],
                    "temperature": 0,
                },
            ),
            "messages": (
                plain_claude.messages.create,
                fc_anthropic.coalesce(plain_claude, fc, cache_sampled=True).messages.create,
                {
                    "model": "mock-claude",
                    "max_tokens": 32,
                    "messages": [{"role": "user", "content": "hit overhead"}],
                },
            ),
        }
        try:
            for name, (direct, wrapped, body) in cases.items():
                await wrapped(**body)  # stored
                for _ in range(20):  # warm both paths
                    await direct(**body)
                    await wrapped(**body)
                times: dict[str, list[float]] = {"direct": [], "wrapped_hit": []}
                for _ in range(ops):
                    for label, create in (("direct", direct), ("wrapped_hit", wrapped)):
                        started = time.perf_counter()
                        await create(**body)
                        times[label].append((time.perf_counter() - started) * 1000)
                out[name] = {label: summary(values) for label, values in times.items()}
        finally:
            await plain_openai.close()
            await plain_claude.close()
    return out


def _bursts(rounds: int) -> list[dict[str, Any]]:
    bursts = []
    for index in range(rounds):
        tag = f"burst {index} {uuid.uuid4().hex}"
        user = [{"role": "user", "content": tag}]
        bursts += [
            {
                "name": f"chat-{index}",
                "api": "chat",
                "sdk": "openai",
                "path": ["chat", "completions"],
                "kwargs": {"model": "mock-chat", "messages": user, "temperature": 0},
            },
            {
                "name": f"responses-{index}",
                "api": "responses",
                "sdk": "openai",
                "path": ["responses"],
                "kwargs": {"model": "mock-chat", "input": tag, "temperature": 0, "stream": True},
            },
            {
                "name": f"messages-{index}",
                "api": "messages",
                "sdk": "anthropic",
                "path": ["messages"],
                "kwargs": {
                    "model": "mock-claude",
                    "max_tokens": 32,
                    "messages": user,
                    "extra_body": {"temperature": 0},  # deterministic: stored
                },
                "stream": True,
            },
        ]
    for burst in bursts:
        if burst.pop("stream", False):
            burst["kwargs"]["stream"] = True
    return bursts


async def _run_workers(spec: dict[str, Any], processes: int) -> list[dict[str, Any]]:
    procs = [
        await python_module(
            "bench._sdk_worker",
            json.dumps({**spec, "index": i}),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for i in range(processes)
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = await asyncio.wait_for(proc.communicate(), 300)
            if proc.returncode != 0:
                raise RuntimeError(f"sdk worker failed: {err.decode()[-2000:]}")
            outputs.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    return outputs


def _analyse(bursts: list[dict[str, Any]], outputs: list[dict[str, Any]]) -> dict[str, Any]:
    first = next(o for o in outputs if o["calls_after"])
    counts = first["calls_after"]
    calls: dict[str, list[int]] = {}
    lags: dict[str, list[float]] = {}
    owners: dict[str, list[float]] = {}
    hits: dict[str, int] = {}
    errors: dict[str, int] = {}
    before = first["calls_before"]
    for burst, after in zip(bursts, counts, strict=True):
        api = burst["api"]
        calls.setdefault(api, []).append(after - before)
        before = after
        records = [r for o in outputs for r in o["bursts"][burst["name"]]]
        for record in records:
            if record.get("error"):
                errors[record["error"]] = errors.get(record["error"], 0) + 1
        owner = [r for r in records if r.get("source") == "MISS"]
        if len(owner) != 1 or not burst["kwargs"].get("stream"):
            continue
        owners.setdefault(api, []).append((owner[0]["first"] - owner[0]["started"]) * 1000)
        lags.setdefault(api, []).extend(
            (r["first"] - owner[0]["first"]) * 1000
            for r in records
            if r.get("source") == "COALESCED" and r.get("first")
        )
        hits[api] = hits.get(api, 0) + sum(1 for r in records if r.get("source") == "HIT")
    return {
        "upstream_calls_per_burst": calls,
        "owner_ttft_ms": {api: summary(v) for api, v in owners.items()},
        "follower_ttft_minus_owner_ms": {api: summary(v) for api, v in lags.items()},
        "late_hits": hits,  # callers that came after the answer was stored
        "errors": errors,
    }


async def run(
    server_url: str, *, processes: int = 4, callers: int = 50, rounds: int = 3, hit_ops: int = 1000
) -> dict[str, Any]:
    mock = await Service.start("mock-upstream", ["mock-upstream", "--port", "0"])
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            quick = {"latency_ms": 0, "tokens_per_s": None}
            (await http.post(f"{mock.url}/control", json=quick)).raise_for_status()
            hits = await _hit_overhead(server_url, mock.url, ops=hit_ops)
            (await http.post(f"{mock.url}/control/reset")).raise_for_status()
            paced = {"latency_ms": LATENCY_MS, "tokens_per_s": TOKENS_PER_S}
            (await http.post(f"{mock.url}/control", json=paced)).raise_for_status()
            bursts = _bursts(rounds)
            spec = {
                "redis": server_url,
                "namespace": "bench-sdkw-" + uuid.uuid4().hex[:6],
                "upstream": mock.url,
                "workers": processes,
                "callers": callers,
                "bursts": bursts,
                "lease": LEASE_S,
            }
            outputs = await _run_workers(spec, processes)
    finally:
        await stop_all([mock])
    return {
        "config": {
            "processes": processes,
            "callers": callers,
            "rounds": rounds,
            "hit_ops": hit_ops,
            "mock_latency_ms": LATENCY_MS,
            "mock_tokens_per_s": TOKENS_PER_S,
        },
        "hit_overhead_ms": hits,
        **_analyse(bursts, outputs),
    }
