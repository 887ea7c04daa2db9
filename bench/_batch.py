"""Batch loading and tags: what ``do_many`` and ``invalidate_tags`` cost, against baselines
measured in the same run, on the bench's server.

- ``do_many`` hits: ``keys`` (100) stored keys read by one ``fc.do_many(keys, loader)``
  (``near_cache=False``: the server answers every key) against one raw redis-py ``MGET`` of
  as many keys holding the same bytes (the baseline), and against ``asyncio.gather`` of one
  ``fc.do`` per key. Calls alternate in rounds (rotated order); calls/s per round, the ratio
  to ``MGET`` taken within each round, the median over rounds reported.
- ``do_many`` misses: ``miss_rounds`` calls of ``do_many`` over ``keys`` keys nobody has
  (fresh ones each call; the loader returns at once): the round trips this process sent
  (``stats["commands"]``: one per command or pipeline), the commands the server ran
  (``INFO commandstats``, scripts counted once), and the wall time; against ``gather`` of one
  ``fc.do`` per fresh key.
- Tags: ``tagged`` (10,000) results stored with one tag, and a second node holding a near
  cache (it must acknowledge). ``invalidate_tags([tag])``: the commands the server ran and
  the time, against ``invalidate_many`` of the same keys (stored again, untagged) as the
  baseline. And the read cost of a tag: ``fc.do`` hits of a tagged key against an untagged
  one (``near_cache=False``), alternating, sequential.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from flightcache import MISSING, FlightCache

from ._rounds import PAYLOAD, VALUE
from ._util import CONTROL_COMMANDS, command_calls, delta, median

NEVER = "the loader must not run on a hit"


async def _never(*_: Any) -> Any:
    raise AssertionError(NEVER)


async def _commands(client: aioredis.Redis) -> dict[str, int]:
    calls = command_calls(await client.info("commandstats"))
    return {k: v for k, v in calls.items() if k not in CONTROL_COMMANDS}


async def _rate(op: Callable[[], Awaitable[Any]], seconds: float, limit: int) -> float:
    """Calls per second of ``op`` one after another, for ``seconds`` or ``limit`` calls."""
    done = 0
    start = time.perf_counter()
    while done < limit:
        await op()
        done += 1
        if time.perf_counter() - start >= seconds:
            break
    return done / (time.perf_counter() - start)


async def run_hits(
    url: str, *, keys: int = 100, rounds: int = 5, seconds: float = 0.5, limit: int = 2_000
) -> dict[str, Any]:
    run = uuid.uuid4().hex[:8]
    raw = aioredis.Redis.from_url(url)
    fc = FlightCache(url, namespace=f"bench-batch-{run}", near_cache=False)
    names = [f"k{i}" for i in range(keys)]
    raw_keys = [f"bench-batch-raw:{run}:{i}" for i in range(keys)]
    try:
        await raw.mset(dict.fromkeys(raw_keys, PAYLOAD))

        async def load(missing: list[str]) -> dict[str, Any]:
            return dict.fromkeys(missing, VALUE)

        assert await fc.do_many(names, load, ttl=3600) == [VALUE] * keys
        variants: dict[str, Callable[[], Awaitable[Any]]] = {
            "mget": lambda: raw.mget(raw_keys),
            "do_many": lambda: fc.do_many(names, _never),
            "gather_do": lambda: asyncio.gather(*(fc.do(n, _never) for n in names)),
        }
        for op in variants.values():  # warm: connections, scripts, digests
            await op()
        samples: dict[str, list[float]] = {name: [] for name in variants}
        order = list(variants)
        for r in range(rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                samples[name].append(await _rate(variants[name], seconds, limit))
        stats = fc.stats
    finally:
        await raw.delete(*raw_keys)
        await raw.aclose()
        await fc.aclose()

    def ratio(name: str) -> float:
        return median([a / b for a, b in zip(samples[name], samples["mget"], strict=True)])

    return {
        "config": {"keys": keys, "rounds": rounds, "seconds_per_measurement": seconds},
        "calls_per_s": {name: median(v) for name, v in samples.items()},
        "ratio_to_mget": {"do_many": ratio("do_many"), "gather_do": ratio("gather_do")},
        "hits": stats["hits"],
    }


async def run_misses(url: str, *, keys: int = 100, miss_rounds: int = 5) -> dict[str, Any]:
    run = uuid.uuid4().hex[:8]
    control = aioredis.Redis.from_url(url)
    fc = FlightCache(url, namespace=f"bench-batch-miss-{run}", near_cache=False)
    batch_calls: list[int] = []

    async def load(missing: list[str]) -> dict[str, Any]:
        batch_calls.append(len(missing))
        return dict.fromkeys(missing, VALUE)

    async def one() -> Any:
        return VALUE

    out: dict[str, Any] = {"config": {"keys": keys, "rounds": miss_rounds}}
    try:
        await fc.get("warm-up")
        await fc.do_many(["warm-a", "warm-b"], load)
        for name in ("do_many", "gather_do"):
            trips: list[int] = []
            server: list[int] = []
            wall: list[float] = []
            by_command: dict[str, int] = {}
            for r in range(miss_rounds):
                fresh = [f"{name}-{r}-{i}" for i in range(keys)]
                before, sent = await _commands(control), fc.stats["commands"]
                start = time.perf_counter()
                if name == "do_many":
                    values = await fc.do_many(fresh, load)
                else:
                    values = await asyncio.gather(*(fc.do(k, one) for k in fresh))
                wall.append(time.perf_counter() - start)
                trips.append(fc.stats["commands"] - sent)
                assert values == [VALUE] * keys
                moved = delta(before, await _commands(control))
                moved.pop("info", None)
                server.append(sum(moved.values()))
                by_command = moved
            out[name] = {
                "round_trips": median(trips),
                "server_commands": median(server),
                "wall_ms": median(wall) * 1000,
                "commands_by_name": by_command,
            }
        out["loader_calls_per_do_many"] = batch_calls[1:]  # after the warm-up's
    finally:
        await control.aclose()
        await fc.aclose()
    return out


async def run_tags(url: str, *, tagged: int = 10_000, hit_rounds: int = 5) -> dict[str, Any]:
    run = uuid.uuid4().hex[:8]
    ns = f"bench-tags-{run}"
    control = aioredis.Redis.from_url(url)
    fc = FlightCache(url, namespace=ns)
    holder = FlightCache(url, namespace=ns)  # a second node with a near cache: it acks
    plain = FlightCache(url, namespace=ns, near_cache=False)
    keys = [f"item:{i}" for i in range(tagged)]
    out: dict[str, Any] = {"config": {"tagged_results": tagged, "hit_rounds": hit_rounds}}

    async def store(tags: list[str] | None) -> None:
        gate = asyncio.Semaphore(64)

        async def one(key: str) -> None:
            async with gate:
                await fc.set(key, VALUE, tags=tags)

        await asyncio.gather(*(one(k) for k in keys))

    try:
        await holder.get("warm-up")
        await store(["catalog"])
        assert await holder.do(keys[0], _never) == VALUE  # the holder leases a copy
        before = await _commands(control)
        start = time.perf_counter()
        inv = await fc.invalidate_tags(["catalog"])
        tags_s = time.perf_counter() - start
        tags_cmds = delta(before, await _commands(control))
        read = await asyncio.gather(*(plain.get(k) for k in keys[:100]))
        stale = sum(v is not MISSING for v in read) + (await holder.get(keys[0]) is not MISSING)
        await store(None)
        before = await _commands(control)
        start = time.perf_counter()
        invs = await fc.invalidate_many(keys)
        many_s = time.perf_counter() - start
        many_cmds = delta(before, await _commands(control))
        out["invalidate_tags"] = {
            "seconds": tags_s,
            "server_commands": sum(tags_cmds.values()),
            "commands_by_name": tags_cmds,
            "how": inv.how,
            "nodes": inv.nodes,
            "acked": inv.acked,
            "stale_reads_after": stale,  # of 100 keys read, and the holder's copy
        }
        out["invalidate_many"] = {
            "seconds": many_s,
            "server_commands": sum(many_cmds.values()),
            "commands_by_name": many_cmds,
            "how": sorted({i.how for i in invs}),
        }
        out["ratio_commands"] = out["invalidate_many"]["server_commands"] / max(
            1, out["invalidate_tags"]["server_commands"]
        )
        out["ratio_seconds"] = many_s / tags_s
        # The read cost of a tag: tagged and untagged hits, served by the server.
        await plain.do("hit-plain", lambda: asyncio.sleep(0, VALUE))
        await plain.do("hit-tagged", lambda: asyncio.sleep(0, VALUE), tags=["catalog"])
        variants: dict[str, Callable[[], Awaitable[Any]]] = {
            "untagged": lambda: plain.do("hit-plain", _never),
            "tagged": lambda: plain.do("hit-tagged", _never),
        }
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(hit_rounds):
            for name in ["untagged", "tagged"] if r % 2 == 0 else ["tagged", "untagged"]:
                samples[name].append(await _rate(variants[name], 0.4, 5_000))
        sent = plain.stats["commands"]
        await variants["tagged"]()
        tagged_cmds = plain.stats["commands"] - sent
        sent = plain.stats["commands"]
        await variants["untagged"]()
        untagged_cmds = plain.stats["commands"] - sent
        out["tagged_hit"] = {
            "calls_per_s": {name: median(v) for name, v in samples.items()},
            "ratio_tagged_to_untagged": median(
                [t / u for t, u in zip(samples["tagged"], samples["untagged"], strict=True)]
            ),
            "round_trips": {"tagged": tagged_cmds, "untagged": untagged_cmds},
        }
    finally:
        await control.aclose()
        for cache in (fc, holder, plain):
            await cache.aclose()
    return out


async def run(url: str, **config: Any) -> dict[str, Any]:
    return {
        "hits": await run_hits(url, **config.get("hits", {})),
        "misses": await run_misses(url, **config.get("misses", {})),
        "tags": await run_tags(url, **config.get("tags", {})),
    }
