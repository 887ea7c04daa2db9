"""Tags: ``do(..., tags=[...])``, ``set(..., tags=...)`` and ``invalidate_tags``.

docs/protocol.md, "Tags", makes these claims, each checked here against real servers and
real processes: a result stored with tags is unreadable everywhere once one of them is
invalidated (stored results on every backend, a near-cache copy in another process, and a
Cluster, where every tag has a slot of its own); a flight that started before the
invalidation delivers to its callers but what it stored is never served afterwards;
``invalidate_tags`` costs the same number of server commands for 10 tagged results as for
500; untagged reads send exactly what they sent before tags existed, a tagged hit one
command more.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from flightcache import MISSING, NOT_FOUND, ConfigError, EmbeddedServer, FlightCache

from .helpers.flights import wait_for_flight
from .test_near import holders


def counter(prefix: str = "v") -> tuple[Any, list[int]]:
    runs: list[int] = []

    async def load() -> str:
        runs.append(1)
        return f"{prefix}{len(runs)}"

    return load, runs


async def never() -> str:
    raise AssertionError("this loader must not run")


# -- on every backend ----------------------------------------------------------------------


async def test_invalidating_a_tag_makes_its_results_unreadable(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url)
    load, runs = counter()
    assert await fc.do("a", load, tags=["user:1", "org:7"]) == "v1"
    assert await fc.do("b", load, tags=["org:7"]) == "v2"
    assert await fc.do("c", load, tags=["user:2"]) == "v3"
    assert await fc.do("plain", load) == "v4"
    assert await fc.do("a", never) == "v1"  # a hit while its tags stand
    inv = await fc.invalidate_tags(["org:7"])
    assert inv.how == "acked"
    assert await fc.get("a") is MISSING and await fc.get("b") is MISSING
    assert await fc.get("c") == "v3" and await fc.get("plain") == "v4"  # other tags, none
    assert await fc.do("a", load, tags=["user:1", "org:7"]) == "v5"  # loaded again
    assert await fc.do("a", never) == "v5"  # and stored with the new versions
    assert await fc.do("b", load) == "v6"  # a call without tags reads them all the same
    assert len(runs) == 6


async def test_set_with_tags_and_not_found_with_tags(backend_url: str, make_cache: Any) -> None:
    fc = make_cache(backend_url)
    await fc.set("s", {"x": 1}, tags=["t"])
    assert await fc.get("s") == {"x": 1}

    async def nothing() -> Any:
        return NOT_FOUND

    assert await fc.do("n", nothing, tags=["t"]) is NOT_FOUND
    assert await fc.do("n", never) is NOT_FOUND  # the not-found record carries the tags too
    await fc.invalidate_tags({"t"})
    assert await fc.get("s") is MISSING
    assert await fc.do("n", counter()[0]) == "v1"


async def test_a_flight_that_started_before_delivers_but_is_not_served_after(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url)
    gate, started = asyncio.Event(), asyncio.Event()

    async def slow() -> str:
        started.set()
        await gate.wait()
        return "computed before the invalidation"

    call = asyncio.ensure_future(fc.do("k", slow, tags=["t"]))
    await started.wait()  # its versions were read before the loader started
    await fc.invalidate_tags(["t"])
    gate.set()
    assert await call == "computed before the invalidation"  # its caller gets it
    assert await fc.get("k") is MISSING  # nobody is served it afterwards
    assert await fc.do("k", counter("new")[0], tags=["t"]) == "new1"


async def test_do_many_checks_the_tags_of_what_it_finds(backend_url: str, make_cache: Any) -> None:
    fc = make_cache(backend_url)
    await fc.do("a", counter("a")[0], tags=["t"])
    await fc.do("b", counter("b")[0], tags=["u"])
    calls: list[list[str]] = []

    async def load(keys: list[str]) -> dict[str, str]:
        calls.append(sorted(keys))
        return {k: k + "-again" for k in keys}

    assert await fc.do_many(["a", "b"], load) == ["a1", "b1"]
    await fc.invalidate_tags(["t"])
    assert await fc.do_many(["a", "b"], load) == ["a-again", "b1"]
    assert calls == [["a"]]


@pytest.mark.parametrize("bad", ["user:1", [""], ["x" * 257], [1], 5, [f"t{i}" for i in range(65)]])
async def test_bad_tags_are_refused_before_anything_is_sent(make_cache: Any, bad: Any) -> None:
    fc = make_cache("memory://")
    with pytest.raises(ConfigError):
        await fc.do("k", never, tags=bad)
    with pytest.raises(ConfigError):
        await fc.set("k", "v", tags=bad)
    with pytest.raises(ConfigError):
        await fc.invalidate_tags(bad)


def test_a_custom_codec_may_not_use_the_tagged_byte() -> None:
    class T:
        tag = b"t"

        def dumps(self, value: Any) -> bytes:
            return b""

        def loads(self, data: bytes) -> Any:
            return None

    with pytest.raises(ConfigError):
        FlightCache("memory://", codec=T())


# -- on a server: near caches, other nodes, cost ------------------------------------------


async def test_other_nodes_drop_their_tagged_copies_and_acknowledge(make_cache: Any) -> None:
    writer, reader = make_cache(), make_cache()
    load, _ = counter()
    assert await writer.do("k", load, tags=["t"]) == "v1"
    assert await reader.do("k", never) == "v1"
    assert await reader.do("k", never) == "v1"  # leased: its near cache answers
    before = reader.stats["commands"]
    assert await reader.get("k") == "v1"
    assert reader.stats["commands"] == before
    inv = await writer.invalidate_tags(["t"])
    assert (inv.how, inv.nodes, inv.acked) == ("acked", 1, 1)
    assert await reader.get("k") is MISSING  # its copy is gone, and the stored one stale


def test_a_near_cache_copy_in_another_process_is_not_served_after(
    server: EmbeddedServer, namespace: str
) -> None:
    """A holder process leases a tagged value; ``invalidate_tags`` returns once it dropped
    the copy (acknowledged); its next read goes to the server, finds the stored result
    stale and loads again."""

    async def scenario() -> None:
        async with FlightCache(server.url, namespace=namespace) as fc:
            assert await fc.do("k", lambda: asyncio.sleep(0, "tagged"), tags=["t"]) == "tagged"
            with holders(1, server.url, namespace) as (holder,):
                first = holder.read("k")
                assert first["value"] == "tagged"
                assert holder.read("k")["commands"] == 0  # leased
                inv = await fc.invalidate_tags(["t"])
                assert (inv.how, inv.nodes, inv.acked) == ("acked", 1, 1)
                after = holder.read("k")
                assert after["value"].startswith("loaded-")  # loaded again, not the old one
                assert after["commands"] > 0

    asyncio.run(scenario())


async def test_on_a_cluster_a_flight_before_the_invalidation_is_stale_everywhere(
    cluster: Any, make_cache: Any
) -> None:
    owner, other = make_cache(cluster.url), make_cache(cluster.url)
    gate, running = asyncio.Event(), asyncio.Event()

    async def slow() -> str:
        running.set()
        await gate.wait()
        return "old"

    tags = [f"tag-{i}" for i in range(8)]  # in as many slots
    call = asyncio.ensure_future(owner.do("k", slow, tags=tags))
    await wait_for_flight(other, "k")
    # The flight has started once its loader runs: its tags' versions are read just before
    # (an invalidation between the claim and that read is one the loader's reads come after).
    await asyncio.wait_for(running.wait(), 10)
    inv = await other.invalidate_tags(tags[3:4])
    assert inv.how == "acked" and inv.nodes == 1
    gate.set()
    assert await call == "old"
    assert await other.get("k") is MISSING and await owner.get("k") is MISSING
    assert await other.do("k", counter("new")[0], tags=tags) == "new1"
    assert await owner.do("k", never) == "new1"


async def test_invalidate_tags_costs_the_same_for_10_and_500_results(
    private_server: EmbeddedServer, namespace: str
) -> None:
    """One counter per tag: the server commands an invalidation sends (counted by the
    server itself) do not grow with the number of results carrying the tag."""
    client = aioredis.Redis.from_url(private_server.url)
    async with FlightCache(private_server.url, namespace=namespace) as fc:

        async def cost(n: int, tag: str) -> int:
            for i in range(n):
                await fc.set(f"{tag}-{i}", i, tags=[tag])
            await client.config_resetstat()
            await fc.invalidate_tags([tag])
            stats = await client.info("commandstats")
            return sum(v["calls"] for k, v in stats.items() if k != "cmdstat_config|resetstat")

        few, many = await cost(10, "few"), await cost(500, "many")
        assert few == many
        assert few <= 8
    await client.aclose()


async def test_untagged_reads_pay_nothing_for_tags_and_a_tagged_hit_one_command(
    make_cache: Any,
) -> None:
    fc = make_cache(near_cache=False)
    await fc.do("plain", counter()[0])
    await fc.do("tagged", counter()[0], tags=["t"])
    before = fc.stats["commands"]
    await fc.do("plain", never)
    assert fc.stats["commands"] - before == 1  # the join, as before tags
    before = fc.stats["commands"]
    await fc.do("tagged", never)
    assert fc.stats["commands"] - before == 2  # the join, and one read of the versions


def test_the_sync_client_invalidates_tags(server: EmbeddedServer, namespace: str) -> None:
    from flightcache import FlightCacheSync

    with FlightCacheSync(server.url, namespace=namespace) as fcs:
        assert fcs.do("k", lambda: "one", tags=("t",)) == "one"
        fcs.set("s", "two", tags=iter(["t"]))
        assert fcs.invalidate_tags(["t"]).how == "acked"
        assert fcs.get("k") is MISSING and fcs.get("s") is MISSING
        with pytest.raises(ConfigError):
            fcs.invalidate_tags("t")  # one string is not a list of tags
