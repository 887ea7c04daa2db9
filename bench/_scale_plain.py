"""The plain redis-py baselines of the many-keys figures: the same events without flightcache.

When a wave of 1,000 flights ends in one instant, the owner completes 1,000 flights and the
follower wakes 1,000 callers at once; the wake lag of the last is what one process spends on
a thousand events. When ten thousand end spread over seconds, the tail of the wake lag is
what the machine does to three busy processes sharing its cores. These orders (served by
``bench._scale_worker``, in the same two processes, between the phases) do the least such
events need with redis-py alone:

- ``{"op": "plain_follow", "channel", "keys"}``: subscribe to ``channel`` (one pub/sub
  connection) and start ``keys`` tasks, each waiting on a future of its own; one reader task
  hands each message (the key's number) to its future. Answers once subscribed.
- ``{"op": "plain_own", "channel", "prefix", "keys", "delay_s", "spread_s"}``: ``keys``
  tasks sleep to one instant ``delay_s`` from now (their timers end in the same turn of the
  loop; with ``spread_s``, key ``i`` at its share of it, mixed as the many-keys phase mixes
  its ends), then each notes its end and sends ``SET`` of its key and ``PUBLISH`` of its
  number in one pipeline (a pool of 64 connections: a bounded pool, as flightcache keeps).
  Answers every key's end and its own return.
- ``{"op": "plain_results", "timeout"}``: each key's wake-up time in the follower (None if
  it never came within ``timeout``).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import Any

import redis.asyncio as aioredis

from ._util import spread_share

POOL = 64

_waits: list[Any] = []  # the last plain_follow's (client, pubsub, reader, tasks, woken)


async def plain_follow(_fc: Any, msg: dict[str, Any]) -> dict[str, Any]:
    keys = int(msg["keys"])
    client = aioredis.Redis.from_url(sys.argv[1])
    pubsub = client.pubsub()
    await pubsub.subscribe(msg["channel"])
    while (await pubsub.get_message(timeout=5.0)) is None:  # the subscribe confirmation
        pass
    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in range(keys)]
    woken: list[float | None] = [None] * keys

    async def reader() -> None:
        async for message in pubsub.listen():
            if message["type"] == "message":
                future = futures[int(message["data"])]
                if not future.done():
                    future.set_result(None)

    async def caller(i: int) -> None:
        await futures[i]
        woken[i] = time.monotonic()

    tasks = [asyncio.ensure_future(caller(i)) for i in range(keys)]
    _waits[:] = [(client, pubsub, asyncio.ensure_future(reader()), tasks, woken)]
    return {"subscribed": True}


async def plain_own(_fc: Any, msg: dict[str, Any]) -> dict[str, Any]:
    keys, channel, prefix = int(msg["keys"]), msg["channel"], msg["prefix"]
    pool = aioredis.BlockingConnectionPool.from_url(sys.argv[1], max_connections=POOL)
    client = aioredis.Redis(connection_pool=pool)
    try:
        await client.ping()
        at = time.monotonic() + float(msg["delay_s"])
        spread_s = float(msg.get("spread_s", 0.0))

        async def one(i: int) -> tuple[float, float]:
            await asyncio.sleep(at + spread_s * spread_share(i, keys) - time.monotonic())
            end = time.monotonic()
            async with client.pipeline(transaction=False) as pipe:
                pipe.set(f"{prefix}:{i}", b"x" * 32, ex=60)
                pipe.publish(channel, str(i))
                await pipe.execute()
            return end, time.monotonic()

        done = await asyncio.gather(*(one(i) for i in range(keys)))
    finally:
        await client.aclose()
        await pool.aclose()
    return {"ends": [end for end, _ in done], "returns": [ret for _, ret in done]}


async def plain_results(_fc: Any, msg: dict[str, Any]) -> dict[str, Any]:
    client, pubsub, reader, tasks, woken = _waits.pop()
    await asyncio.wait(tasks, timeout=float(msg["timeout"]))
    for task in (*tasks, reader):
        task.cancel()
    await asyncio.gather(*tasks, reader, return_exceptions=True)
    with contextlib.suppress(Exception):
        await pubsub.aclose()
    await client.aclose()
    return {"woken": woken}


OPS = {"plain_follow": plain_follow, "plain_own": plain_own, "plain_results": plain_results}
