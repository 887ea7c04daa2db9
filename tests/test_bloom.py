"""The Bloom filter: sizing, false positives, one round trip a call, and argument checks."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from flightcache import ConfigError, EmbeddedServer, FlightCache
from flightcache._protections.bloom import MAX_BITS, BloomFilter, bloom_keys, bloom_size

MakeCache = Callable[..., FlightCache]
BATCH = 10_000


def test_sizing_follows_the_formulas() -> None:
    m, k = bloom_size(100_000, 0.01)
    assert m == math.ceil(-100_000 * math.log(0.01) / math.log(2) ** 2) == 958_506
    assert k == round(m / 100_000 * math.log(2)) == 7
    assert bloom_size(1, 0.5) == (2, 1)


def test_expected_rate_matches_the_target(make_cache: MakeCache) -> None:
    bf = BloomFilter(make_cache("memory://"), "sizing", 100_000, 0.01)
    assert bf.false_positive_rate() == pytest.approx(0.01, rel=0.01)
    assert bf.false_positive_rate(200_000) > 0.1  # past capacity it degrades quickly


def test_keys_share_one_hash_tag() -> None:
    bitmap, params = bloom_keys("ns", "users")
    assert bitmap == "ns:bloom:{ns:bloom:users}"
    assert key_slot(bitmap.encode()) == key_slot(params.encode())


async def test_false_positive_rate_and_no_false_negatives(
    backend_url: str, make_cache: MakeCache
) -> None:
    """100k keys added at capacity 100k and p = 0.01; 100k others checked."""
    bf = BloomFilter(make_cache(backend_url), "fp", 100_000, 0.01)
    added = [f"user:{i}" for i in range(100_000)]
    others = [f"other:{i}" for i in range(100_000)]

    start = time.perf_counter()
    for i in range(0, len(added), BATCH):
        await bf.add_many(added[i : i + BATCH])
    add_s = time.perf_counter() - start
    start = time.perf_counter()
    present: list[bool] = []
    for i in range(0, len(added), BATCH):
        present += await bf.contains_many(added[i : i + BATCH])
    check_s = time.perf_counter() - start
    false_positives = 0
    for i in range(0, len(others), BATCH):
        false_positives += sum(await bf.contains_many(others[i : i + BATCH]))

    assert all(present)  # no false negatives
    rate = false_positives / len(others)
    print(
        f"{backend_url.split(':')[0]}: false positives {rate:.4%} (target 1%), "
        f"add_many {len(added) / add_s:,.0f} keys/s, "
        f"contains_many {len(added) / check_s:,.0f} keys/s in batches of {BATCH}"
    )
    assert 0.01 / 1.2 <= rate <= 0.01 * 1.2


async def test_one_round_trip_per_call(private_server: EmbeddedServer) -> None:
    """Each call is one EVALSHA: counted by the cache and by the server."""
    fc = FlightCache(private_server.url, namespace="rt", node_ttl=60.0)
    admin = aioredis.Redis.from_url(private_server.url)
    try:
        bf = BloomFilter(fc, "trips", 1000, 0.01)
        # Start the cache, and load both scripts: the first EVALSHA of a script on a server
        # meets NOSCRIPT, and redis-py loads it and sends it again.
        await bf.add("warm-up")
        await bf.contains("warm-up")

        async def evalsha_calls() -> int:
            stats = await admin.info("commandstats")
            return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))

        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: bf.add("a"),
            lambda: bf.contains("a"),
            lambda: bf.add_many(f"k{i}" for i in range(1000)),
            lambda: bf.contains_many([f"k{i}" for i in range(1000)]),
        ]
        for call in calls:
            commands, server_calls = fc.stats["commands"], await evalsha_calls()
            await call()
            assert fc.stats["commands"] - commands == 1
            assert await evalsha_calls() - server_calls == 1
        commands = fc.stats["commands"]
        assert await bf.add_many([]) == [] and await bf.contains_many(iter(())) == []
        assert fc.stats["commands"] == commands  # nothing to send, nothing sent
    finally:
        await admin.aclose()
        await fc.aclose()


async def test_add_reports_whether_the_key_was_new(backend_url: str, make_cache: MakeCache) -> None:
    bf = BloomFilter(make_cache(backend_url), "new", 1000, 0.001)
    assert await bf.contains("a") is False
    assert await bf.add("a") is True
    assert await bf.add("a") is False
    assert await bf.add_many(["b", "c", "b"]) == [True, True, False]
    assert await bf.contains_many(["a", "b", "c", "d"]) == [True, True, True, False]
    # Keys are canonical: the string "1" and the number 1 are different keys.
    assert bf.positions("1") != bf.positions(1)
    await bf.add({"user": 1, "org": 2})
    assert await bf.contains({"org": 2, "user": 1})


async def test_same_name_shares_the_bitmap(backend_url: str, make_cache: MakeCache) -> None:
    fc = make_cache(backend_url)
    await BloomFilter(fc, "shared", 1000, 0.01).add("x")
    assert await BloomFilter(fc, "shared", 1000, 0.01).contains("x")
    assert not await BloomFilter(fc, "elsewhere", 1000, 0.01).contains("x")


async def test_other_parameters_are_refused_until_cleared(
    backend_url: str, make_cache: MakeCache
) -> None:
    fc = make_cache(backend_url)
    first = BloomFilter(fc, "params", 1000, 0.01)
    await first.add("x")
    second = BloomFilter(fc, "params", 5000, 0.01)
    with pytest.raises(ConfigError, match="exists with parameters"):
        await second.add("x")
    with pytest.raises(ConfigError, match="exists with parameters"):
        await second.contains("x")
    await first.clear()
    assert await first.contains("x") is False
    assert await second.add("x") is True


async def test_contains_creates_nothing(
    make_cache: MakeCache, redis_client: aioredis.Redis, namespace: str
) -> None:
    bf = BloomFilter(make_cache(), "untouched", 1000, 0.01)
    assert await bf.contains_many(["a", "b"]) == [False, False]
    assert await redis_client.exists(bf.key, bf.params_key) == 0


async def test_foreign_value_at_the_key_is_a_config_error(
    make_cache: MakeCache, redis_client: aioredis.Redis
) -> None:
    bf = BloomFilter(make_cache(), "foreign", 1000, 0.01)
    await redis_client.rpush(bf.key, "not a bitmap")
    with pytest.raises(ConfigError, match="did not write"):
        await bf.add("x")


@pytest.mark.parametrize("capacity", [0, -1, 1.5, True, "100"])
def test_bad_capacity(capacity: object, make_cache: MakeCache) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        BloomFilter(make_cache("memory://"), "bad", capacity, 0.01)  # type: ignore[arg-type]


@pytest.mark.parametrize("error_rate", [0, 1, 0.0, 1.0, -0.1, 1.5, math.nan, True, "0.01"])
def test_bad_error_rate(error_rate: object, make_cache: MakeCache) -> None:
    with pytest.raises(ConfigError, match="error_rate"):
        BloomFilter(make_cache("memory://"), "bad", 1000, error_rate)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", "a{b}", "with space", "x" * 129, 7])
def test_bad_name(name: object, make_cache: MakeCache) -> None:
    with pytest.raises(ConfigError, match="name"):
        BloomFilter(make_cache("memory://"), name, 1000, 0.01)  # type: ignore[arg-type]


def test_bitmaps_over_512_mb_are_refused(make_cache: MakeCache) -> None:
    fc = make_cache("memory://")
    with pytest.raises(ConfigError, match="512 MB"):
        BloomFilter(fc, "huge", 1_000_000_000, 1e-6)
    near_limit = BloomFilter(fc, "large", 440_000_000, 0.01)  # nothing is allocated yet
    assert near_limit.bits <= MAX_BITS == 2**32


async def test_single_call_rate(make_cache: MakeCache) -> None:
    """Reported, not asserted: sequential add/contains calls per second on the local server."""
    bf = BloomFilter(make_cache(), "rate", 100_000, 0.01)
    await bf.add("warm-up")
    rounds = 2000
    start = time.perf_counter()
    for i in range(rounds):
        await bf.add(i)
    add_rate = rounds / (time.perf_counter() - start)
    start = time.perf_counter()
    for i in range(rounds):
        await bf.contains(i)
    check_rate = rounds / (time.perf_counter() - start)
    print(f"single calls: add {add_rate:,.0f}/s, contains {check_rate:,.0f}/s (one task)")
