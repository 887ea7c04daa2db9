"""Penetration protection: negative caching of not-found, and a Bloom filter as admission."""

from __future__ import annotations

import asyncio
from typing import Any

from flightcache import NOT_FOUND, BloomFilter


async def test_a_not_found_answer_is_shared_and_negative_cached(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url, not_found_ttl=0.3)
    runs: list[int] = []

    async def lookup_user() -> Any:
        runs.append(1)
        await asyncio.sleep(0.05)
        return NOT_FOUND

    results = await asyncio.gather(*(fc.do("user:404", lookup_user) for _ in range(10)))
    assert results == [NOT_FOUND] * 10
    assert await fc.do("user:404", lookup_user) is NOT_FOUND  # cached: no second load
    assert await fc.get("user:404") is NOT_FOUND
    assert len(runs) == 1
    await asyncio.sleep(0.4)
    assert await fc.do("user:404", lookup_user) is NOT_FOUND
    assert len(runs) == 2  # the negative entry expired after not_found_ttl


async def test_a_declared_exception_means_not_found_in_every_process(make_cache: Any) -> None:
    owner, other = make_cache(), make_cache()
    gate = asyncio.Event()
    runs: list[int] = []

    async def lookup() -> str:
        runs.append(1)
        await gate.wait()
        raise KeyError("no such row")

    mine = asyncio.ensure_future(owner.do("row:9", lookup, not_found=(KeyError,)))
    await asyncio.sleep(0.1)
    theirs = asyncio.ensure_future(other.do("row:9", lookup, not_found=(KeyError,)))
    await asyncio.sleep(0.1)
    gate.set()
    assert await mine is NOT_FOUND and await theirs is NOT_FOUND
    assert await other.do("row:9", lookup, not_found=(KeyError,)) is NOT_FOUND
    assert len(runs) == 1


async def test_a_bloom_filter_admits_only_keys_it_has_seen(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url)
    users = BloomFilter(fc, "users", capacity=1000, error_rate=0.01)
    await users.add_many([f"user:{i}" for i in range(100)])
    runs: list[str] = []

    def loader_for(key: str) -> Any:
        async def load() -> str:
            runs.append(key)
            return key.upper()

        return load

    before = fc.stats["commands"]
    assert await fc.do("user:nobody", loader_for("user:nobody"), admit=users) is NOT_FOUND
    assert fc.stats["rejected"] == 1 and runs == []
    if backend_url != "memory://":
        assert fc.stats["commands"] == before + 1  # one round trip: the filter's check
    assert await fc.do("user:7", loader_for("user:7"), admit=users) == "USER:7"
    assert runs == ["user:7"]
