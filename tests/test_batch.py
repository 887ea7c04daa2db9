"""Batch loading: ``do_many(keys, loader)``.

docs/protocol.md, "Batch loading", makes these claims, each checked here against real
servers and real processes: values come back in the order of the keys; stored keys are
served and keys in flight elsewhere followed, so the loader gets only the keys this process
claimed, in one call; a key the loader leaves out is ``NOT_FOUND`` (cached) or a
``KeyError`` (not cached); two overlapping batches in two processes never load a key twice;
a loader failure fails the keys of that call only; a key claimed later by takeover goes into
a later, smaller call; a miss costs two round trips on one server, a hit one.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from flightcache import (
    NOT_FOUND,
    ConfigError,
    FlightContext,
    FlightError,
    FlightTimeout,
    RemoteError,
    ValueTooLarge,
)

from .helpers.flights import wait_for_flight, wait_until

WORKER = Path(__file__).with_name("helpers") / "batch_worker.py"
SRC = Path(__file__).resolve().parents[1] / "src"


class Loader:
    """A batch loader that records its calls: ``{key: key.upper()}`` except ``skip``."""

    def __init__(self, delay: float = 0.0, skip: tuple[str, ...] = ()) -> None:
        self.calls: list[list[str]] = []
        self.delay = delay
        self.skip = skip

    async def __call__(self, keys: list[str]) -> dict[str, Any]:
        self.calls.append(list(keys))
        await asyncio.sleep(self.delay)
        return {k: k.upper() for k in keys if k not in self.skip}


async def never() -> Any:
    raise AssertionError("this loader must not run")


# -- on every backend ----------------------------------------------------------------------


async def test_values_come_back_in_the_order_of_the_keys_from_one_loader_call(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url)
    load = Loader()
    assert await fc.do_many(["b", "a", "c", "a"], load) == ["B", "A", "C", "A"]
    assert len(load.calls) == 1 and sorted(load.calls[0]) == ["a", "b", "c"]
    # Stored now: served, and only the new key goes to the loader.
    assert await fc.do_many(["c", "d", "a"], load) == ["C", "D", "A"]
    assert load.calls[1] == ["d"]
    assert await fc.do_many(["a", "b", "c", "d"], load) == ["A", "B", "C", "D"]
    assert len(load.calls) == 2
    assert await fc.do("a", never) == "A"  # the same flights and results as do()
    assert await fc.do_many([], load) == []


async def test_a_key_the_loader_leaves_out_is_not_found_and_cached(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url)
    load = Loader(skip=("gone",))
    assert await fc.do_many(["here", "gone"], load) == ["HERE", NOT_FOUND]
    assert await fc.do_many(["here", "gone"], load) == ["HERE", NOT_FOUND]
    assert len(load.calls) == 1  # the NOT_FOUND was cached
    assert await fc.get("gone") is NOT_FOUND


async def test_with_missing_raise_a_left_out_key_is_a_key_error_and_not_cached(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url)
    load = Loader(skip=("gone",))
    with pytest.raises(KeyError):
        await fc.do_many(["here", "gone"], load, missing="raise")
    assert await fc.get("here") == "HERE"  # the other key was stored all the same
    with pytest.raises(KeyError):
        await fc.do_many(["gone"], load, missing="raise")
    assert load.calls == [["here", "gone"], ["gone"]]  # nothing was cached for it


async def test_a_loader_failure_fails_only_the_keys_of_that_call(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url, error_ttl=0)
    await fc.do_many(["cached"], Loader())

    async def broken(keys: list[str]) -> dict[str, Any]:
        raise ValueError(f"down for {sorted(keys)}")

    with pytest.raises(ValueError, match=r"\['x', 'y'\]"):
        await fc.do_many(["cached", "x", "y"], broken)
    assert await fc.get("cached") == "CACHED"
    assert await fc.do_many(["x", "y"], Loader()) == ["X", "Y"]  # not negative-cached


async def test_one_value_too_large_fails_only_its_key(backend_url: str, make_cache: Any) -> None:
    fc = make_cache(backend_url, max_value_bytes=100)

    async def load(keys: list[str]) -> dict[str, Any]:
        return {k: ("x" * 200 if k == "big" else k) for k in keys}

    with pytest.raises(ValueTooLarge):
        await fc.do_many(["small", "big"], load)
    assert await fc.get("small") == "small"


async def test_a_loader_that_declares_contexts_gets_each_keys_token(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url)
    seen: dict[str, int] = {}
    in_meta: dict[str, Any] = {}

    async def load(keys: list[str], flights: list[FlightContext]) -> dict[str, Any]:
        for key, flight in zip(keys, flights, strict=True):
            assert flight.key == key
            seen[key] = flight.token
            in_meta[key] = (await fc.inspect(key)).token
        return {k: k for k in keys}

    assert await fc.do_many(["a", "b"], load) == ["a", "b"]
    assert seen == in_meta and len(set(seen.values())) == 2


async def test_a_batch_past_its_timeout_fails_its_keys_and_cancels_the_loader(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url)
    cancelled: list[bool] = []

    async def slow(keys: list[str]) -> dict[str, Any]:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return {}

    with pytest.raises(FlightTimeout):
        await fc.do_many(["a", "b"], slow, timeout=0.3)
    await wait_until(lambda: cancelled, 5, "the loader call to be cancelled")


async def test_bad_arguments(make_cache: Any) -> None:
    fc = make_cache("memory://")
    with pytest.raises(ConfigError):
        await fc.do_many(["a"], Loader(), missing="ignore")
    with pytest.raises(ConfigError):
        await fc.do_many(["a"], "not callable")  # type: ignore[arg-type]

    async def not_a_mapping(keys: list[str]) -> Any:
        return [1, 2]

    with pytest.raises(FlightError, match="mapping"):
        await fc.do_many(["a"], not_a_mapping)


async def test_disabled_calls_the_loader_every_time(make_cache: Any) -> None:
    fc = make_cache("memory://")
    load = Loader(skip=("gone",))
    with fc.disabled():
        assert await fc.do_many(["a", "gone", "a"], load) == ["A", NOT_FOUND, "A"]
        assert await fc.do_many(["a"], load) == ["A"]
    assert load.calls == [["a", "gone"], ["a"]]


async def test_a_do_many_and_a_do_of_one_key_in_one_process_share_its_flight(
    backend_url: str, make_cache: Any
) -> None:
    fc = make_cache(backend_url)
    load = Loader(delay=0.2)
    many, one = await asyncio.gather(fc.do_many(["p", "q"], load), fc.do("p", never))
    assert (many, one) == (["P", "Q"], "P")
    assert load.calls == [["p", "q"]]


# -- on a server: other processes' flights, takeovers, round trips -----------------------


@pytest.mark.parametrize("where", ["redis", "cluster"])
async def test_keys_in_flight_elsewhere_are_followed_not_loaded(
    where: str, make_cache: Any, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("cluster").url if where == "cluster" else None
    other, fc = make_cache(url), make_cache(url)
    gate = asyncio.Event()

    async def elsewhere() -> str:
        await gate.wait()
        return "from the other node"

    running = asyncio.ensure_future(other.do("b", elsewhere))
    await wait_for_flight(fc, "b")
    load = Loader()
    many = asyncio.ensure_future(fc.do_many(["a", "b", "c"], load))
    await wait_until(lambda: load.calls, 10, "the batch's loader call")
    assert load.calls == [["a", "c"]]
    gate.set()
    assert await many == ["A", "from the other node", "C"]
    assert await running == "from the other node"
    assert load.calls == [["a", "c"]]


async def test_a_key_taken_over_later_goes_into_a_later_loader_call(make_cache: Any) -> None:
    """The batch follows "k" (another node owns it); that owner gives the flight back while
    the batch's first call runs; this process claims "k" and loads it in a call of its own."""
    other, fc = make_cache(lease=1.0), make_cache(lease=1.0)
    started = asyncio.Event()

    async def hangs() -> str:
        started.set()
        await asyncio.sleep(60)
        return "never"

    owner = asyncio.ensure_future(other.do("k", hangs))
    await started.wait()
    await wait_for_flight(fc, "k")
    load = Loader(delay=0.3)
    many = asyncio.ensure_future(fc.do_many(["a", "k"], load))
    await wait_until(lambda: load.calls, 10, "the first loader call")
    await other.aclose()  # gives "k" back: this process takes it over
    assert await many == ["A", "K"]
    assert load.calls == [["a"], ["k"]]
    assert fc.stats["takeovers"] == 1
    await asyncio.gather(owner, return_exceptions=True)


async def test_a_miss_is_two_round_trips_and_a_hit_one(make_cache: Any) -> None:
    fc = make_cache(near_cache=False)
    await fc.get("warm-up")
    keys = [f"k{i}" for i in range(100)]
    before = fc.stats["commands"]
    assert await fc.do_many(keys, Loader()) == [k.upper() for k in keys]
    assert fc.stats["commands"] - before == 2  # the joins together, the completions together
    before = fc.stats["commands"]
    assert await fc.do_many(keys, Loader()) == [k.upper() for k in keys]
    assert fc.stats["commands"] - before == 1


async def test_a_follower_in_another_process_gets_the_batch_error(make_cache: Any) -> None:
    owner, follower = make_cache(), make_cache()
    gate = asyncio.Event()

    async def broken(keys: list[str]) -> dict[str, Any]:
        await gate.wait()
        raise ValueError("upstream down")

    failing = asyncio.ensure_future(owner.do_many(["e"], broken))
    await wait_for_flight(follower, "e")
    following = asyncio.ensure_future(follower.do("e", never))
    await wait_for_flight(owner, "e", followers=1)
    gate.set()
    with pytest.raises(ValueError):
        await failing
    with pytest.raises(RemoteError, match="upstream down"):
        await following


# -- real processes --------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["redis", "cluster"])
def test_two_overlapping_batches_in_two_processes_never_load_a_key_twice(
    where: str, namespace: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("cluster" if where == "cluster" else "server").url
    keys = [f"k{i}" for i in range(60)]
    sets = [keys[:40], keys[20:], keys[10:50]]  # every key in two or three batches
    start_at = time.monotonic() + 2.0
    env = dict(os.environ, PYTHONPATH=str(SRC), PYTHONUNBUFFERED="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                json.dumps(
                    {
                        "url": url,
                        "namespace": namespace,
                        "keys": ks,
                        "markers": str(tmp_path),
                        "loader_s": 0.3,
                        "start_at": start_at,
                    }
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for ks in sets
    ]
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err[-3000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    loaded = [line for path in tmp_path.glob("loaded-*") for line in path.read_text().splitlines()]
    assert sorted(loaded) == sorted(set(keys))  # every key loaded, none twice
    by_key: dict[str, int] = {}
    for ks, report in zip(sets, reports, strict=True):
        assert [v["key"] for v in report["values"]] == ks
        for v in report["values"]:
            assert by_key.setdefault(v["key"], v["pid"]) == v["pid"]  # one value per key
        assert len(report["calls"]) <= 3  # one call, plus late ones after a takeover at most


def test_the_sync_client_loads_a_batch_in_a_worker_thread(server: Any, namespace: str) -> None:
    import threading

    from flightcache import FlightCacheSync

    threads: list[str] = []

    def load(keys: list[str], flights: list[FlightContext]) -> dict[str, Any]:
        threads.append(threading.current_thread().name)
        return {k: f.token for k, f in zip(keys, flights, strict=True)}

    with FlightCacheSync(server.url, namespace=namespace) as fcs:
        tokens = fcs.do_many(["a", "b", "a"], load)
        assert tokens[0] == tokens[2] != tokens[1]
        assert fcs.do_many(["b", "a"], load) == [tokens[1], tokens[0]]
    assert len(threads) == 1 and threads[0] != threading.main_thread().name
