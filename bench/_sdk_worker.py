"""One worker process of the ``sdk`` bench section: ``python -m bench._sdk_worker SPEC``.

For each burst of SPEC (JSON), every worker waits at a barrier (a Redis counter), makes
``callers`` identical wrapped calls at once and notes, per call, its outcome, the wall-clock
moment it started and the moment its first text delta (or its answer) arrived; after a
second barrier worker 0 reads the mock's call count. Prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import anthropic
import httpx
import openai
import redis

from flightcache import FlightCache
from flightcache.integrations import anthropic as fc_anthropic
from flightcache.integrations import openai as fc_openai


def barrier(client: redis.Redis, name: str, parties: int) -> None:
    client.incr(name)
    deadline = time.monotonic() + 120
    while int(client.get(name) or 0) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}")
        time.sleep(0.001)


def _fresh(kwargs: dict[str, Any], tag: str) -> dict[str, Any]:
    """The same call with a prompt of its own."""
    if "input" in kwargs:
        return {**kwargs, "input": tag}
    return {**kwargs, "messages": [{"role": "user", "content": tag}]}


def _is_text(event: Any) -> bool:
    return event.type in ("response.output_text.delta", "content_block_delta")


async def burst(client: Any, spec: dict[str, Any], callers: int) -> list[dict[str, Any]]:
    create = client
    for name in spec["path"]:
        create = getattr(create, name)
    create = create.create
    stream = spec["kwargs"].get("stream", False)

    async def one() -> dict[str, Any]:
        record: dict[str, Any] = {"started": time.time()}
        try:
            if stream:
                events = await create(**spec["kwargs"])
                record["source"] = events.source
                async for event in events:
                    if "first" not in record and _is_text(event):
                        record["first"] = time.time()
            else:
                await create(**spec["kwargs"])
                record["first"] = time.time()
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        return record

    return await asyncio.gather(*[one() for _ in range(callers)])


async def main(spec: dict[str, Any]) -> dict[str, Any]:
    r = redis.Redis.from_url(spec["redis"])
    out: dict[str, Any] = {"bursts": {}, "calls_after": []}
    async with (
        FlightCache(spec["redis"], namespace=spec["namespace"], lease=spec["lease"]) as fc,
        httpx.AsyncClient(timeout=10) as http,
    ):
        chat = fc_openai.coalesce(
            openai.AsyncOpenAI(base_url=f"{spec['upstream']}/v1", api_key="sk-b", max_retries=0),
            fc,
        )
        claude = fc_anthropic.coalesce(
            anthropic.AsyncAnthropic(base_url=spec["upstream"], api_key="ak-b", max_retries=0),
            fc,
        )
        await fc.ping()
        for item in spec["bursts"][:3]:  # warm both SDKs' paths (lazy imports, connections)
            warm = {**item, "kwargs": _fresh(item["kwargs"], f"warm {spec['index']}")}
            await burst(chat if item["sdk"] == "openai" else claude, warm, 1)
        barrier(r, f"{spec['namespace']}:warm", spec["workers"])
        if spec["index"] == 0:
            stats = (await http.get(f"{spec['upstream']}/stats")).json()
            out["calls_before"] = stats["calls"]
        for item in spec["bursts"]:
            client = chat if item["sdk"] == "openai" else claude
            barrier(r, f"{spec['namespace']}:{item['name']}:go", spec["workers"])
            records = await burst(client, item, spec["callers"])
            out["bursts"][item["name"]] = records
            barrier(r, f"{spec['namespace']}:{item['name']}:done", spec["workers"])
            if spec["index"] == 0:
                stats = (await http.get(f"{spec['upstream']}/stats")).json()
                out["calls_after"].append(stats["calls"])
        out["stats"] = fc.stats
        await chat.close()
        await claude.close()
    r.close()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))), flush=True)
