"""The fencing token in the loader's hands: ``FlightContext`` and ``set(..., if_token=)``.

docs/protocol.md, "The fencing token in the loader's hands", makes these claims, each
checked here against real servers: a loader that declares one parameter gets a context
whose token is the one in the flight's meta (the token every owner write carries); its
attempt counts takeovers; its lease left is what the renewer last proved; it is told when
its run is called off; ``set(key, value, if_token=t)`` writes only while ``t`` owns the
key's flight, refusing a stale owner with ``LeaseLost`` while the current owner's write
lands, and still waits for near caches like ``set``.
"""

from __future__ import annotations

import asyncio
import functools
import math
from typing import Any

import pytest
import redis.asyncio as aioredis

from flightcache import MISSING, FlightContext, FlightTimeout, LeaseLost
from flightcache._protocol.context import wants_context


async def wait_until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


# -- which loaders get a context ---------------------------------------------------------


def test_a_loader_gets_a_context_only_when_it_declares_one_required_parameter() -> None:
    async def none() -> int:
        return 1

    async def one(flight: FlightContext) -> int:
        return 1

    async def two(a: Any, b: Any) -> int:
        return 1

    class Loader:
        async def method(self, flight: FlightContext) -> int:
            return 1

        async def __call__(self, flight: FlightContext) -> int:
            return 1

    async def partial_of(x: int, flight: FlightContext) -> int:
        return x

    assert not wants_context(none)
    assert wants_context(one)
    assert not wants_context(two)
    assert not wants_context(lambda v=1: v)  # a closure's default is not a parameter for us
    assert wants_context(lambda flight: flight)
    assert wants_context(Loader().method)
    assert wants_context(Loader())
    assert wants_context(functools.partial(partial_of, 1))
    assert not wants_context(functools.partial(partial_of, 1, None))


def test_the_answer_is_remembered_per_call_site() -> None:
    """Closures made anew for each call share their code object: asked once."""
    from flightcache._protocol import context

    def make(i: int) -> Any:
        async def loader(flight: FlightContext) -> int:
            return i

        return loader

    context._wants.clear()
    for i in range(50):
        assert wants_context(make(i))
    assert len(context._wants) == 1


# -- the context on every backend ---------------------------------------------------------


async def test_the_context_token_is_the_one_in_meta(backend_url: str, make_cache: Any) -> None:
    fc = make_cache(backend_url, lease=1.0)
    seen: list[FlightContext] = []
    info: list[Any] = []

    async def loader(flight: FlightContext) -> str:
        seen.append(flight)
        info.append(await fc.inspect("k"))  # while the flight runs
        return f"v{flight.token}"

    value = await fc.do("k", loader)
    (ctx,) = seen
    assert value == f"v{ctx.token}"
    assert ctx.key == "k" and ctx.attempt == 1 and not ctx.cancelled
    assert info[0].state == "running"
    assert info[0].token == ctx.token
    if backend_url == "memory://":
        assert ctx.lease_left == math.inf
    else:
        assert 0 < ctx.lease_left <= 1.0
    assert await fc.do("k", loader) == value  # a hit: the loader did not run again
    assert len(seen) == 1


async def test_the_owner_writes_under_its_token_and_nobody_else_does(
    backend_url: str, make_cache: Any
) -> None:
    """The owner's own ``set(if_token=)`` lands while it owns the flight; a token that owns
    no flight of the key (none runs, or it is over) is refused and changes nothing."""
    fc = make_cache(backend_url)
    tokens: list[int] = []
    with pytest.raises(LeaseLost) as refused:
        await fc.set("k", "x", if_token=12345)  # no flight runs
    assert refused.value.token == 12345
    assert await fc.get("k") is MISSING

    async def owner(flight: FlightContext) -> str:
        tokens.append(flight.token)
        inv = await fc.set("k", "set under the token", if_token=flight.token)
        assert inv.how in ("acked", "absent")
        assert await fc.get("k") == "set under the token"
        return "returned"

    assert await fc.do("k", owner) == "returned"  # its callers get what it returned
    assert await fc.get("k") == "set under the token"  # which was not stored over the set
    with pytest.raises(LeaseLost) as late:
        await fc.set("k", "late write", if_token=tokens[0])
    assert late.value.token == tokens[0]
    assert await fc.get("k") == "set under the token"


async def test_on_a_cluster_the_owner_writes_under_its_token_before_its_claim_is_confirmed(
    cluster: Any, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a Cluster the loader starts before ``confirm_claim`` has attached its token to
    meta; a ``set(if_token=)`` made at once waits for that confirmation (held back here for
    0.3 s) instead of being refused for a token meta does not have yet."""
    from flightcache import FlightCache
    from flightcache._backends.redis import RedisConnection

    real = RedisConnection.script

    async def slow_confirm(self: Any, lua: Any, fk: Any, keys: Any, args: Any) -> Any:
        if lua.name == "confirm_claim":
            await asyncio.sleep(0.3)
        return await real(self, lua, fk, keys, args)

    monkeypatch.setattr(RedisConnection, "script", slow_confirm)
    fc = FlightCache(cluster.url, namespace=namespace, near_cache=False)
    try:

        async def owner(flight: FlightContext) -> str:
            await fc.set("k", "set under the token", if_token=flight.token)
            return "returned"

        assert await fc.do("k", owner) == "returned"
        assert await fc.get("k") == "set under the token"
    finally:
        await fc.aclose()


async def test_a_timed_out_run_is_told_it_is_cancelled(backend_url: str, make_cache: Any) -> None:
    fc = make_cache(backend_url, lease=1.0)
    seen: list[FlightContext] = []
    told: list[bool] = []

    async def loader(flight: FlightContext) -> str:
        seen.append(flight)
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            told.append(flight.cancelled)
            raise
        return "never"

    with pytest.raises(FlightTimeout):
        await fc.do("k", loader, timeout=0.2)
    assert told == [True]
    assert seen[0].cancel_event.is_set()


# -- on a real server: takeover, renewals, a lost lease, a stale owner ----------------------


async def test_a_takeover_is_the_next_attempt_with_a_new_token(make_cache: Any) -> None:
    first, second = make_cache(lease=1.0), make_cache(lease=1.0)
    contexts: list[FlightContext] = []
    started = asyncio.Event()

    async def slow(flight: FlightContext) -> str:
        contexts.append(flight)
        started.set()
        await asyncio.sleep(30)
        return "never"

    async def quick(flight: FlightContext) -> str:
        contexts.append(flight)
        return "second"

    call = asyncio.ensure_future(first.do("k", slow))
    await started.wait()
    await first.aclose()  # the owner gives its flight back
    with pytest.raises(Exception):  # noqa: B017 (the closed cache's caller fails; any error)
        await call
    assert await second.do("k", quick) == "second"
    assert [c.attempt for c in contexts] == [1, 2]
    assert contexts[1].token != contexts[0].token
    assert contexts[0].cancelled  # the closed owner's run was called off


async def test_lease_left_follows_the_renewals(make_cache: Any) -> None:
    """(Lease 0.6 s: with 0.3 s, a loaded CI machine once left a renewal unanswered for a
    whole lease, and the run was called off.)"""
    fc = make_cache(lease=0.6)
    lefts: list[float] = []

    async def loader(flight: FlightContext) -> str:
        for _ in range(10):  # 2 s: three leases, renewed every 0.2 s
            lefts.append(flight.lease_left)
            await asyncio.sleep(0.2)
        return "done"

    assert await fc.do("k", loader) == "done"
    assert all(0 < left <= 0.6 for left in lefts)
    assert min(lefts[5:]) > 0.2  # renewed: a lease never ran down past one interval and a half


async def test_a_lost_lease_cancels_the_run_and_says_so(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """Another token in meta (a takeover the owner did not see): the next renewal is refused,
    the context turns cancelled before the loader's task is, and the loader can check it
    from a thread that cancellation cannot reach."""
    fc = make_cache(lease=0.3)
    fk = fc.keyspace.flight("k")
    seen: list[FlightContext] = []
    in_thread: list[bool] = []
    started = asyncio.Event()

    def blocking(flight: FlightContext) -> None:
        import time

        deadline = time.monotonic() + 3
        while not flight.cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
        in_thread.append(flight.cancelled)

    async def loader(flight: FlightContext) -> str:
        seen.append(flight)
        started.set()
        thread = asyncio.ensure_future(asyncio.to_thread(blocking, flight))
        try:
            await asyncio.shield(thread)
        except asyncio.CancelledError:
            await thread  # the thread sees the signal too
            raise
        return "never"

    call = asyncio.ensure_future(fc.do("k", loader))
    await started.wait()
    await redis_client.hset(fk.meta, "ownerToken", "1")  # a token not ours
    await wait_until(lambda: in_thread)
    assert in_thread == [True] and seen[0].cancelled
    assert seen[0].lease_left <= 0.3
    await redis_client.delete(fk.meta)  # let the stale owner's retry claim again
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)


async def test_a_stale_owner_cannot_overwrite_the_new_owners_value(
    make_cache: Any, redis_client: aioredis.Redis
) -> None:
    """Two nodes: the first owner's lease lapses while its loader is paused, the second
    takes over and writes with its token; the first, resuming, writes with its own, stale,
    token: refused with LeaseLost, and the second's value stays. A third node holding the
    old value in its near cache is waited for (``set`` semantics)."""
    stale, current, holder = make_cache(lease=0.5), make_cache(lease=0.5), make_cache()
    fk = stale.keyspace.flight("k")
    await stale.set("k", "old")
    assert await holder.do("k", _never) == "old"  # leased in the holder's near cache
    resume, claimed = asyncio.Event(), asyncio.Event()
    outcome: dict[str, Any] = {}

    async def paused(flight: FlightContext) -> str:
        outcome["stale_token"] = flight.token
        claimed.set()
        await resume.wait()
        try:
            await stale.set("k", "stale write", if_token=flight.token)
            outcome["stale"] = "written"
        except LeaseLost as exc:
            outcome["stale"] = exc.token
        return "stale result"

    async def fresh(flight: FlightContext) -> str:
        outcome["fresh_token"] = flight.token
        outcome["fresh_set"] = await current.set("k", "fresh", if_token=flight.token)
        return "fresh"

    first = asyncio.ensure_future(stale.do("k", paused, refresh=True))
    await claimed.wait()
    stale._flights.renewer._leases.clear()  # type: ignore[union-attr]  # a paused heartbeat
    await redis_client.delete(fk.meta)  # its lease lapses
    assert await current.do("k", fresh, refresh=True) == "fresh"
    resume.set()
    await asyncio.gather(first, return_exceptions=True)
    assert outcome["stale"] == outcome["stale_token"] != outcome["fresh_token"]
    inv = outcome["fresh_set"]
    assert inv.how == "acked" and inv.nodes >= 1 and inv.acked == inv.nodes
    assert await holder.get("k") == "fresh"
    assert await current.get("k") == "fresh"


async def _never() -> str:
    raise AssertionError("the loader must not run")


async def test_a_loader_in_a_thread_on_memory_gets_a_context(make_cache: Any) -> None:
    fc = make_cache("memory://")
    seen: list[FlightContext] = []

    async def loader(flight: FlightContext) -> int:
        seen.append(flight)
        return flight.token

    first = await fc.do("a", loader)
    second = await fc.do("b", loader)
    assert first != second  # tokens differ per flight
    assert all(c.lease_left == math.inf for c in seen)


@pytest.mark.parametrize("bad", ["7", 1.5, True])
async def test_if_token_must_be_an_int(make_cache: Any, bad: Any) -> None:
    from flightcache import ConfigError

    fc = make_cache("memory://")
    with pytest.raises(ConfigError):
        await fc.set("k", "v", if_token=bad)


def test_a_plain_loader_on_the_sync_client_gets_the_context(server: Any, namespace: str) -> None:
    """The sync door runs a plain loader in a worker thread and hands it the context; the
    thread can write under the token too."""
    from flightcache import FlightCacheSync

    with FlightCacheSync(server.url, namespace=namespace) as fcs:
        seen: list[FlightContext] = []

        def loader(flight: FlightContext) -> str:
            seen.append(flight)
            assert fcs.inspect("k").token == flight.token
            fcs.set("k", "under the token", if_token=flight.token)
            return "returned"

        assert fcs.do("k", loader) == "returned"
        assert fcs.get("k") == "under the token"
        with pytest.raises(LeaseLost):
            fcs.set("k", "late", if_token=seen[0].token)
