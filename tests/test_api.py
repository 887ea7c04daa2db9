"""The public API on every backend: caching, local single-flight, keys, decorator, lifecycle."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

import flightcache
from flightcache import MISSING, ConfigError, FlightCache, FlightError


def counting_loader(value: Any = "v", delay: float = 0.0) -> tuple[Callable[[], Any], list[int]]:
    runs: list[int] = []

    async def loader() -> Any:
        runs.append(1)
        await asyncio.sleep(delay)
        return value

    return loader, runs


def test_public_names_are_sorted_and_exported() -> None:
    assert flightcache.__all__ == sorted(flightcache.__all__, key=lambda n: (not n.isupper(), n))
    for name in flightcache.__all__:
        assert hasattr(flightcache, name), name
    for name in (
        "LeaseLost",
        "FlightTimeout",
        "RemoteError",
        "ValueTooLarge",
        "SerializationError",
        "BackendUnavailable",
        "ConfigError",
    ):
        assert issubclass(getattr(flightcache, name), FlightError)


async def test_do_caches_the_value_and_get_returns_it(backend_url: str, make_cache: Any) -> None:
    fc = make_cache(backend_url)
    loader, runs = counting_loader({"answer": 42})
    assert await fc.get("q") is MISSING
    assert await fc.do("q", loader) == {"answer": 42}
    assert await fc.do("q", loader) == {"answer": 42}
    assert await fc.get("q") == {"answer": 42}
    assert len(runs) == 1
    stats = fc.stats
    assert (stats["calls"], stats["hits"], stats["misses"], stats["loader_runs"]) == (2, 1, 1, 1)
    assert (stats["gets"], stats["get_hits"]) == (2, 1)


async def test_concurrent_callers_in_one_process_share_one_run(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url)
    loader, runs = counting_loader([1, 2, 3], delay=0.2)
    results = await asyncio.gather(*(fc.do("q", loader) for _ in range(100)))
    assert results == [[1, 2, 3]] * 100
    assert len(runs) == 1
    assert fc.stats["coalesced"] == 99


async def test_a_miss_returns_what_a_hit_returns(backend_url: str, make_cache: Any) -> None:
    """Every caller gets the value as decoded from storage: a tuple comes back as a list."""
    fc = make_cache(backend_url)
    loader, _ = counting_loader((1, "a"))
    assert await fc.do("q", loader) == [1, "a"]
    assert await fc.do("q", loader) == [1, "a"]


async def test_keys_are_canonical_json_and_strings_differ_from_numbers(make_cache: Any) -> None:
    fc = make_cache("memory://")
    loader, runs = counting_loader("x")
    await fc.do({"model": "m", "messages": [{"role": "user", "content": "hi"}], "t": 0}, loader)
    await fc.do({"t": 0, "messages": [{"content": "hi", "role": "user"}], "model": "m"}, loader)
    assert len(runs) == 1
    await fc.do("1", loader)
    await fc.do(1, loader)
    assert len(runs) == 3


async def test_flight_decorator_keys_on_function_and_canonical_arguments(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url)
    calls: list[tuple[str, int]] = []

    @fc.flight(ttl=60)
    async def ask(prompt: str, n: int = 1) -> str:
        calls.append((prompt, n))
        return prompt * n

    assert await ask("ab") == "ab"
    assert await ask("ab", 1) == "ab"
    assert await ask(prompt="ab", n=1) == "ab"
    assert await ask("ab", n=2) == "abab"
    assert calls == [("ab", 1), ("ab", 2)]
    with pytest.raises(ConfigError):
        fc.flight(42)  # type: ignore[call-overload]  # not a function (def and async def are)


async def test_a_cancelled_caller_does_not_cancel_the_flight(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url)
    cancelled: list[int] = []

    async def loader() -> str:
        try:
            await asyncio.sleep(0.3)
        except asyncio.CancelledError:
            cancelled.append(1)
            raise
        return "done"

    first = asyncio.ensure_future(fc.do("q", loader))
    second = asyncio.ensure_future(fc.do("q", loader))
    await asyncio.sleep(0.05)
    first.cancel()
    assert await second == "done"
    assert first.cancelled()
    assert cancelled == []
    assert await fc.get("q") == "done"


async def test_the_only_caller_cancelled_still_leaves_the_value_cached(
    backend_url: str, make_cache: Any
) -> None:
    """Cancelled once its loader runs (not by a fixed sleep: on a loaded machine the join
    may take longer, and a caller cancelled before it claimed leaves no flight at all)."""
    fc = make_cache(backend_url)
    started = asyncio.Event()
    runs: list[int] = []

    async def loader() -> str:
        runs.append(1)
        started.set()
        await asyncio.sleep(0.2)
        return "v"

    task = asyncio.ensure_future(fc.do("q", loader))
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    flights = list(fc._tasks)  # the flight goes on in a task of its own
    assert flights
    await asyncio.wait_for(asyncio.gather(*flights, return_exceptions=True), 10)
    assert await fc.get("q") == "v"
    assert len(runs) == 1


async def test_ttl_expires_and_results_get_jittered_ttls(
    make_cache: Any, redis_client: aioredis.Redis, namespace: str
) -> None:
    fc = make_cache()
    loader, _ = counting_loader("v")
    await fc.do("short", loader, ttl=0.2)
    await asyncio.sleep(0.3)
    assert await fc.get("short") is MISSING
    for i in range(20):
        await fc.do(f"k{i}", loader, ttl=100)
    ttls = [await redis_client.pttl(fc.keyspace.flight(f"k{i}").result) for i in range(20)]
    assert all(89_000 <= t <= 110_000 for t in ttls), ttls
    assert len(set(ttls)) > 10  # jittered, not one shared expiry


async def test_inspect_reports_a_running_flight_then_the_cached_result(make_cache: Any) -> None:
    owner, other = make_cache(lease=2.0), make_cache(lease=2.0)
    gate = asyncio.Event()

    async def slow() -> str:
        await gate.wait()
        return "v"

    task = asyncio.ensure_future(owner.do({"q": 1}, slow))
    for _ in range(100):
        if (await other.inspect({"q": 1})).state == "running":
            break
        await asyncio.sleep(0.01)
    follower = asyncio.ensure_future(other.do({"q": 1}, slow))
    for _ in range(100):
        info = await other.inspect({"q": 1})
        if info.state == "running" and info.followers == 1:
            break
        await asyncio.sleep(0.01)
    assert info.state == "running"
    assert info.owner_node == owner.node_id
    assert isinstance(info.token, int) and info.token > 0
    assert info.lease_left_ms is not None and 0 < info.lease_left_ms <= 2000
    assert info.attempts == 1
    assert info.key == '{"q":1}'
    gate.set()
    assert await task == await follower == "v"
    done = await other.inspect({"q": 1})
    assert done.state == "cached" and done.result_ttl_ms and done.result_ttl_ms > 0
    assert (await other.inspect("never")).state == "vacant"


async def test_context_manager_closes_and_a_closed_cache_refuses(backend_url: str) -> None:
    async with FlightCache(backend_url, namespace="ctx") as fc:
        assert await fc.do("k", counting_loader(1)[0]) == 1
    with pytest.raises(FlightError, match="closed"):
        await fc.do("k", counting_loader(1)[0])


async def test_embedded_url_starts_a_private_server_and_stops_it_on_close() -> None:
    fc = FlightCache("embedded://", namespace="emb")
    assert await fc.do("k", counting_loader("v")[0]) == "v"
    assert fc.server_url is not None and fc.server_url.startswith("redis://127.0.0.1:")
    assert fc._server is not None
    pid = fc._server.pid
    await fc.aclose()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_closing_an_owner_gives_its_flight_back_at_once(make_cache: Any) -> None:
    """An owner that is closed mid-flight releases it; a follower claims without waiting out
    the lease."""
    owner, other = make_cache(lease=5.0), make_cache(lease=5.0)
    gate = asyncio.Event()
    cancelled = asyncio.Event()

    async def never() -> str:
        try:
            await gate.wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    async def mine() -> str:
        return "mine"

    task = asyncio.ensure_future(owner.do("q", never))
    await asyncio.sleep(0.1)
    follower = asyncio.ensure_future(other.do("q", mine))
    await asyncio.sleep(0.1)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await owner.aclose()
    assert await asyncio.wait_for(follower, 3) == "mine"
    assert loop.time() - t0 < 2.0  # well under the 5 s lease
    with pytest.raises(FlightError):
        await task
    assert cancelled.is_set()  # the closed owner's loader does not run on


async def test_refresh_recomputes_and_replaces_the_stored_value(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url)
    values = iter(["old", "new"])

    async def loader() -> str:
        return next(values)

    assert await fc.do("q", loader) == "old"
    assert await fc.do("q", loader) == "old"
    assert await fc.do("q", loader, refresh=True) == "new"
    assert await fc.get("q") == "new"


async def test_refresh_joins_a_running_flight_instead_of_starting_another(make_cache: Any) -> None:
    owner, other = make_cache(), make_cache()
    runs: list[int] = []
    gate = asyncio.Event()

    async def loader() -> int:
        runs.append(1)
        await gate.wait()
        return len(runs)

    await owner.do("q", counting_loader(0)[0])  # a stored value the refresh must ignore
    first = asyncio.ensure_future(owner.do("q", loader, refresh=True))
    await asyncio.sleep(0.1)
    second = asyncio.ensure_future(other.do("q", loader, refresh=True))
    await asyncio.sleep(0.1)
    gate.set()
    assert await first == await second == 1
    assert len(runs) == 1


async def test_store_false_coalesces_but_keeps_nothing(backend_url: str, make_cache: Any) -> None:
    fc = make_cache(backend_url)
    runs: list[int] = []
    gate = asyncio.Event()

    async def loader() -> int:
        runs.append(1)
        await gate.wait()
        return len(runs)

    calls = [asyncio.ensure_future(fc.do("q", loader, store=False)) for _ in range(5)]
    await asyncio.sleep(0.05)
    gate.set()
    assert await asyncio.gather(*calls) == [1] * 5  # one run, everyone answered
    assert await fc.get("q") is MISSING  # nothing kept
    assert await fc.do("q", loader, store=False) == 2
