"""One process of the wrapped-SDK stampede tests: ``python -m tests.helpers.sdk_worker SPEC``.

SPEC (JSON) names the Redis URL, the namespace, the upstream (the mock), this worker's
index and a list of scenarios. Each worker first makes one plain SDK call of each kind (a
warm-up: the SDKs import their types on first use), then worker 0 notes the upstream's call
count and sends SPEC's ``control`` to the mock, if any. For each scenario every worker
waits at a barrier (a Redis counter), then makes ``calls`` identical wrapped calls at once
(coroutines on an async client, or threads on a sync one) and records, per call, the SDK
types it got, a digest of what it got (the answer, or the whole list of stream events) and
the outcome (HIT, MISS, COALESCED), or the exception's class and status. It prints one
JSON line: a summary per scenario.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import redis

from flightcache import FlightCache, FlightCacheSync
from flightcache.integrations import anthropic as fc_anthropic
from flightcache.integrations import openai as fc_openai


def barrier(client: redis.Redis, name: str, parties: int, timeout: float = 60.0) -> None:
    client.incr(name)
    deadline = time.monotonic() + timeout
    while int(client.get(name) or 0) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: not every worker arrived")
        time.sleep(0.002)


def digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def dump(obj: Any) -> Any:
    return obj.model_dump(mode="json")


def client_for(scenario: dict[str, Any], upstream: str, is_async: bool) -> Any:
    if scenario["sdk"] == "openai":
        make = openai.AsyncOpenAI if is_async else openai.OpenAI
        return make(base_url=f"{upstream}/v1", api_key="sk-worker", max_retries=0, timeout=30)
    make_a = anthropic.AsyncAnthropic if is_async else anthropic.Anthropic
    return make_a(base_url=upstream, api_key="ak-worker", max_retries=0, timeout=30)


def create_of(client: Any, scenario: dict[str, Any]) -> Any:
    target = client
    for name in scenario["path"]:
        target = getattr(target, name)
    return target.create


def record(result: Any) -> dict[str, Any]:
    return {
        "types": [type(result).__name__],
        "digest": digest(dump(result)),
        "container": type(result).__name__,
    }


def summary(results: list[dict[str, Any]], outcomes: list[Any]) -> dict[str, Any]:
    sources = Counter(r["source"] for r in results if "source" in r)
    if not sources:  # non-stream answers: what on_outcome said
        sources = Counter(o.cache for o in outcomes)
    return {
        "types": sorted({t for r in results for t in r.get("types", [])}),
        "digests": sorted({r["digest"] for r in results if "digest" in r}),
        "sources": dict(sources),
        "errors": dict(Counter(r["error"] for r in results if "error" in r)),
        "retry_after": sorted({r["retry_after"] for r in results if r.get("retry_after")}),
        "containers": sorted({r["container"] for r in results if "container" in r}),
        "count": len(results),
    }


def failed(exc: BaseException) -> dict[str, Any]:
    response = getattr(exc, "response", None)
    retry = response.headers.get("retry-after") if response is not None else None
    name = f"{type(exc).__name__}:{getattr(exc, 'status_code', '')}"
    return {"error": name, "retry_after": retry}


async def run_async(spec: dict[str, Any], scenario: dict[str, Any], r: redis.Redis) -> Any:
    async with FlightCache(spec["redis"], namespace=spec["namespace"]) as fc:
        module = fc_openai if scenario["sdk"] == "openai" else fc_anthropic
        outcomes: list[Any] = []
        client = module.coalesce(
            client_for(scenario, spec["upstream"], True),
            fc,
            on_outcome=outcomes.append,
            cache_sampled=scenario.get("cache_sampled", False),
        )
        create = create_of(client, scenario)
        await fc.ping()

        async def one() -> dict[str, Any]:
            try:
                result = await create(**scenario["kwargs"])
            except Exception as exc:
                return failed(exc)
            if scenario["kwargs"].get("stream"):
                events = [event async for event in result]
                return {
                    "types": sorted({type(e).__name__ for e in events}),
                    "digest": digest([dump(e) for e in events]),
                    "source": result.source,
                    "container": type(result).__name__,
                }
            return record(result)

        barrier(r, f"{spec['namespace']}:{scenario['name']}", spec["workers"])
        results = await asyncio.gather(*[one() for _ in range(scenario["calls"])])
        return summary(list(results), outcomes)


def run_sync(spec: dict[str, Any], scenario: dict[str, Any], r: redis.Redis) -> Any:
    with FlightCacheSync(spec["redis"], namespace=spec["namespace"]) as fcs:
        module = fc_openai if scenario["sdk"] == "openai" else fc_anthropic
        lock = threading.Lock()
        outcomes: list[Any] = []

        def note(outcome: Any) -> None:
            with lock:
                outcomes.append(outcome)

        client = module.coalesce(
            client_for(scenario, spec["upstream"], False),
            fcs,
            on_outcome=note,
            cache_sampled=scenario.get("cache_sampled", False),
        )
        create = create_of(client, scenario)
        fcs.ping()
        go = threading.Event()

        def one() -> dict[str, Any]:
            go.wait(60)
            try:
                result = create(**scenario["kwargs"])
            except Exception as exc:
                return failed(exc)
            if scenario["kwargs"].get("stream"):
                with result:
                    events = list(result)
                return {
                    "types": sorted({type(e).__name__ for e in events}),
                    "digest": digest([dump(e) for e in events]),
                    "source": result.source,
                    "container": type(result).__name__,
                }
            return record(result)

        with ThreadPoolExecutor(scenario["calls"]) as pool:
            futures = [pool.submit(one) for _ in range(scenario["calls"])]
            barrier(r, f"{spec['namespace']}:{scenario['name']}", spec["workers"])
            go.set()
            results = [f.result(120) for f in futures]
        return summary(results, outcomes)


def warm_up(spec: dict[str, Any], r: redis.Redis) -> int | None:
    """One plain SDK call of each kind first (the SDKs import their types on first use),
    then a barrier; worker 0 answers the upstream's call count after it."""
    kinds = {
        (s["sdk"], tuple(s["path"]), bool(s["kwargs"].get("stream"))) for s in spec["scenarios"]
    }
    for sdk, path, stream in sorted(kinds):
        client = client_for({"sdk": sdk}, spec["upstream"], False)
        create = create_of(client, {"path": path})
        kwargs = dict(
            next(
                s["kwargs"]
                for s in spec["scenarios"]
                if s["sdk"] == sdk and tuple(s["path"]) == path
            )
        )
        kwargs["stream"] = stream
        if "input" in kwargs:
            kwargs["input"] = f"warm {uuid.uuid4().hex}"
        else:
            kwargs["messages"] = [{"role": "user", "content": f"warm {uuid.uuid4().hex}"}]
        result = create(**kwargs)
        if stream:
            with result:
                list(result)
        client.close()
    barrier(r, f"{spec['namespace']}:warm", spec["workers"])
    calls: int | None = None
    if spec["index"] == 0:
        calls = httpx.get(f"{spec['upstream']}/stats", timeout=10).json()["calls"]
        if spec.get("control"):  # the mock's behaviour for the scenarios
            httpx.post(f"{spec['upstream']}/control", json=spec["control"], timeout=10)
    barrier(r, f"{spec['namespace']}:controlled", spec["workers"])
    return calls


def main() -> None:
    spec = json.loads(sys.argv[1])
    r = redis.Redis.from_url(spec["redis"])
    out: dict[str, Any] = {"baseline": warm_up(spec, r)}
    for scenario in spec["scenarios"]:
        if scenario.get("sync"):
            out[scenario["name"]] = run_sync(spec, scenario, r)
        else:
            out[scenario["name"]] = asyncio.run(run_async(spec, scenario, r))
    r.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
