"""Bad input and faults: a clear error, nothing half-written, no hung caller, no secret shown."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any, ClassVar

import pytest
import redis.asyncio as aioredis

from flightcache import (
    MISSING,
    BackendUnavailable,
    ConfigError,
    EmbeddedServer,
    FlightCache,
    FlightTimeout,
    PoolExhausted,
    RemoteError,
    SerializationError,
    Tuning,
    ValueTooLarge,
)
from flightcache._backends.embedded import free_port

from .helpers.flights import wait_for_flight


class Boom(Exception):
    pass


async def test_a_loader_error_reaches_every_caller_in_every_process(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    owner, other = make_cache(), make_cache()
    gate = asyncio.Event()
    runs: list[int] = []

    async def failing() -> str:
        runs.append(1)
        await gate.wait()
        raise Boom("the model is down")

    local = [asyncio.ensure_future(owner.do("q", failing)) for _ in range(3)]
    await wait_for_flight(owner, "q")
    remote = asyncio.ensure_future(other.do("q", failing))
    await wait_for_flight(owner, "q", followers=1)  # the other process follows the flight
    gate.set()
    for task in local:
        with pytest.raises(Boom, match="the model is down"):
            await task
    with pytest.raises(RemoteError) as info:
        await asyncio.wait_for(remote, 10)
    assert info.value.type_name == "Boom"
    assert info.value.remote_message == "the model is down"
    assert len(runs) == 1
    assert other.stats["follows"] == 1 and other.stats["loader_runs"] == 0
    assert owner.stats["coalesced"] == 2  # the other two local callers shared the first's
    fk = owner.keyspace.flight("q")
    assert not await redis_client.exists(fk.meta, fk.waiters)  # the flight is over


async def test_errors_are_negative_cached_for_error_ttl_only(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url, error_ttl=0.3)
    runs: list[int] = []

    async def failing() -> str:
        runs.append(1)
        raise Boom("no")

    with pytest.raises(Boom):
        await fc.do("q", failing)
    with pytest.raises(RemoteError, match="Boom: no"):
        await fc.do("q", failing)  # served from the negative cache
    assert len(runs) == 1
    assert await fc.get("q") is MISSING
    await asyncio.sleep(0.4)
    with pytest.raises(Boom):
        await fc.do("q", failing)
    assert len(runs) == 2


async def test_a_value_over_the_limit_is_refused_and_nothing_is_written(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url, max_value_bytes=1000)

    async def big() -> str:
        return "x" * 5000

    with pytest.raises(ValueTooLarge) as info:
        await fc.do("q", big)
    assert info.value.size > 5000 and info.value.limit == 1000
    assert await fc.get("q") is MISSING
    assert (await fc.inspect("q")).state == "vacant"

    async def small() -> str:
        return "ok"

    assert await fc.do("q", small) == "ok"  # the next call claims at once


async def test_followers_of_a_too_large_value_get_an_error_not_a_hang(make_cache: Any) -> None:
    owner, other = make_cache(max_value_bytes=1000), make_cache(max_value_bytes=1000)
    gate = asyncio.Event()

    async def big() -> str:
        await gate.wait()
        return "x" * 5000

    task = asyncio.ensure_future(owner.do("q", big))
    await wait_for_flight(owner, "q")
    remote = asyncio.ensure_future(other.do("q", big))
    await wait_for_flight(owner, "q", followers=1)
    gate.set()
    with pytest.raises(ValueTooLarge):
        await task
    with pytest.raises(RemoteError, match="ValueTooLarge"):
        await asyncio.wait_for(remote, 10)
    assert other.stats["follows"] == 1 and other.stats["loader_runs"] == 0


async def test_a_value_the_codec_cannot_encode_is_a_serialization_error(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url)

    async def odd() -> object:
        return object()

    with pytest.raises(SerializationError, match="cannot encode a object"):
        await fc.do("q", odd)
    assert await fc.get("q") is MISSING


async def test_a_key_that_is_not_json_is_refused_before_any_io(make_cache: Any) -> None:
    fc = make_cache("redis://127.0.0.1:1/0", fail_open=False)  # unreachable: nothing sent

    async def loader() -> str:
        return "v"

    with pytest.raises(SerializationError, match="key is not JSON-serialisable"):
        await fc.do({"x": object()}, loader)


async def test_an_unreachable_server_is_backend_unavailable_without_the_password(
    make_cache: Any,
) -> None:
    port = free_port()
    fc = make_cache(f"redis://alice:s3cret-pw@127.0.0.1:{port}/0", fail_open=False)

    async def loader() -> str:
        return "v"

    t0 = time.monotonic()
    with pytest.raises(BackendUnavailable) as info:
        await fc.do("q", loader)
    assert time.monotonic() - t0 < 10
    text = str(info.value)
    assert f"127.0.0.1:{port}" in text
    assert "s3cret" not in text and "s3cret" not in repr(fc)
    with pytest.raises(BackendUnavailable):
        await fc.get("q")


async def test_a_foreign_value_at_one_of_our_keys_names_the_key(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    fc = make_cache()
    result_key = fc.keyspace.flight("q").result
    await redis_client.rpush(result_key, "not ours")

    async def loader() -> str:
        return "v"

    with pytest.raises(ConfigError, match="holds a list") as info:
        await fc.do("q", loader)
    assert result_key in str(info.value)


async def test_pickle_is_never_read_unless_asked_for(make_cache: Any) -> None:
    pickler = make_cache(codec="pickle")
    reader = make_cache()  # json, the default

    async def loader() -> set[int]:
        return {1, 2}

    assert await pickler.do("q", loader) == {1, 2}
    with pytest.raises(SerializationError, match="different codecs"):
        await reader.get("q")


async def test_a_hanging_loader_times_out_for_every_caller_and_frees_the_key(
    make_cache: Any,
) -> None:
    owner, other = make_cache(timeout=1.0), make_cache(timeout=1.0)

    async def hang() -> str:
        await asyncio.sleep(3600)
        return "never"

    local = asyncio.ensure_future(owner.do("q", hang))
    await wait_for_flight(owner, "q")
    remote = asyncio.ensure_future(other.do("q", hang))
    await wait_for_flight(owner, "q", followers=1)
    with pytest.raises(FlightTimeout):
        await asyncio.wait_for(local, 10)
    with pytest.raises(FlightTimeout):
        await asyncio.wait_for(remote, 10)
    assert owner.stats["timeouts"] == 1
    assert other.stats["follows"] == 1 and other.stats["loader_runs"] == 0
    # The key is free at once: nothing cached, no flight left whose lease must lapse.
    assert (await other.inspect("q")).state == "vacant"

    async def quick() -> str:
        return "fresh"

    assert await other.do("q", quick) == "fresh"
    assert other.stats["loader_runs"] == 1


async def test_a_loader_that_ignores_cancellation_is_abandoned_at_its_timeout(
    make_cache: Any,
) -> None:
    fc = make_cache("memory://", timeout=0.2)

    async def stubborn() -> str:
        for _ in range(30):
            try:
                await asyncio.sleep(0.1)
            except asyncio.CancelledError:
                pass
        return "late"

    t0 = time.monotonic()
    with pytest.raises(FlightTimeout):
        await fc.do("q", stubborn)
    assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"ttl": -1}, "ttl"),
        ({"lease": 0}, "lease"),
        ({"timeout": "soon"}, "timeout"),
        ({"namespace": "a{b}"}, "namespace"),
        ({"namespace": ""}, "namespace"),
        ({"error_ttl": -1}, "error_ttl"),
        ({"max_value_bytes": 0}, "max_value_bytes"),
        ({"codec": "yaml"}, "codec"),
        ({"max_connections": 0}, "max_connections"),
        ({"socket_timeout": 0}, "socket_timeout"),
    ],
)
def test_bad_settings_are_config_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        FlightCache("memory://", **kwargs)


def test_unknown_url_schemes_are_config_errors_without_the_password() -> None:
    with pytest.raises(ConfigError) as info:
        FlightCache("http://bob:hunter2@example.invalid/")
    assert "hunter2" not in str(info.value)


async def test_bad_call_arguments_are_config_errors(make_cache: Any) -> None:
    fc = make_cache("memory://")
    with pytest.raises(ConfigError, match="loader"):
        await fc.do("q", "not callable")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ttl"):
        await fc.do("q", lambda: None, ttl=0)  # type: ignore[arg-type,return-value]


async def test_a_frozen_server_fails_calls_within_the_socket_timeout(
    private_server: Any, namespace: str
) -> None:
    """SIGSTOP the server: a hit, a miss and a follower each fail with BackendUnavailable
    after about socket_timeout (the follower after its failover retries), never hang; the
    owner of the flight, whose lease outlasts the freeze, finishes it once the server is
    back."""
    # No near cache: a leased copy would (rightly) answer the hit without the server.
    # A flight retries for failover_s when the server stops answering mid-flight.
    quick: dict[str, Any] = dict(
        tuning=Tuning(failover_s=1.0), socket_timeout=1.0, near_cache=False, fail_open=False
    )
    fc = FlightCache(private_server.url, namespace=namespace, **quick)
    other = FlightCache(private_server.url, namespace=namespace, **quick)
    gate = asyncio.Event()

    async def slow() -> str:
        await gate.wait()
        return "v"

    try:
        assert await fc.do("cached", slow_ok) == "ok"
        # A lease longer than the freeze: the owner's heartbeat keeps its claim through it.
        owner = asyncio.ensure_future(fc.do("q", slow, lease=20.0))
        await wait_for_flight(fc, "q")
        follower = asyncio.ensure_future(other.do("q", slow))
        await wait_for_flight(fc, "q", followers=1)
        os.kill(private_server.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()

            async def timed(call: Any) -> tuple[BaseException | None, float]:
                try:
                    await asyncio.wait_for(call, 15)
                except BaseException as exc:  # the outcome is asserted below
                    return exc, time.monotonic() - t0
                return None, time.monotonic() - t0

            (hit, hit_s), (miss, miss_s), (followed, follow_s) = await asyncio.gather(
                timed(fc.get("cached")), timed(fc.do("never-stored", slow_ok)), timed(follower)
            )
            assert isinstance(hit, BackendUnavailable), hit
            assert isinstance(miss, BackendUnavailable), miss
            assert isinstance(followed, BackendUnavailable), followed
            # About socket_timeout (1 s) each, the follower after failover_s (1 s) more; the
            # upper bounds are generous for a loaded machine, far below "hangs".
            assert 0.9 <= hit_s <= 6.0 and 0.9 <= miss_s <= 6.0, (hit_s, miss_s)
            assert follow_s <= 10.0, follow_s
        finally:
            os.kill(private_server.pid, signal.SIGCONT)
        gate.set()
        assert await asyncio.wait_for(owner, 15) == "v"
        assert fc.stats["loader_runs"] == 2  # "cached", then "q" once: no takeover
        assert await other.get("q") == "v"
    finally:
        await fc.aclose()
        await other.aclose()


async def slow_ok() -> str:
    return "ok"


def test_a_custom_codec_cannot_take_a_reserved_tag() -> None:
    class Sneaky:
        tag = b"S"

        def dumps(self, value: Any) -> bytes:
            return b""

        def loads(self, data: bytes) -> Any:
            return None

    with pytest.raises(ConfigError, match="tag"):
        FlightCache("memory://", codec=Sneaky())


async def test_error_details_and_ttls_from_a_loader_are_bounded(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """An infinite negative-cache TTL is clamped, oversized details are dropped; the error
    itself always reaches every caller."""
    owner, other = make_cache(), make_cache()
    gate = asyncio.Event()

    class Huge(Exception):
        flightcache_error_ttl = float("inf")
        flightcache_data: ClassVar[dict[str, str]] = {"blob": "x" * 200_000}

    async def failing() -> str:
        await gate.wait()
        raise Huge("too much detail")

    local = asyncio.ensure_future(owner.do("q", failing))
    await wait_for_flight(owner, "q")
    remote = asyncio.ensure_future(other.do("q", failing))
    await wait_for_flight(owner, "q", followers=1)
    gate.set()
    with pytest.raises(Huge):
        await local
    with pytest.raises(RemoteError, match="too much detail") as info:
        await asyncio.wait_for(remote, 10)
    assert info.value.data is None
    assert other.stats["follows"] == 1
    fk = owner.keyspace.flight("q")  # the clamped TTL: a day at most, not forever
    assert 0 < await redis_client.pttl(fk.result) <= 86_400_000


async def test_an_exhausted_pool_says_so(server: EmbeddedServer) -> None:
    from flightcache._backends.redis import RedisConnection
    from flightcache._types import Stats

    conn = RedisConnection(server.url, stats=Stats(), max_connections=1, socket_timeout=0.2)
    conn.client.connection_pool._wait_timeout = 0.2  # type: ignore[attr-defined]
    held = await conn.client.connection_pool.get_connection()
    try:
        with pytest.raises(PoolExhausted, match="stayed busy") as info:
            await conn.run(lambda: conn.client.get("x"))
        # A BackendUnavailable (documented), of its own kind: busy, not down, so fail-open
        # does not take over for it.
        assert isinstance(info.value, BackendUnavailable)
    finally:
        await conn.client.connection_pool.release(held)
        await conn.aclose()
