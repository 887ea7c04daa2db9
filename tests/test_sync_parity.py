"""The two front doors cannot drift: every public ``FlightCache`` method has a ``FlightCacheSync``
twin with the same parameters (names, kinds, defaults), coroutines become plain methods, and
every public attribute and property exists on both (redis-py's sync and asyncio trees, and
httpx's two clients, drifted where no test compared them)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from flightcache import FlightCache, FlightCacheSync, FlightStream, FlightStreamSync

# Async name -> its sync twin's name, where they differ.
RENAMED = {"aclose": "close", "__aenter__": "__enter__", "__aexit__": "__exit__"}
STREAM_RENAMED = {"aclose": "close", "__aiter__": "__iter__", "__anext__": "__next__"}


def public(cls: type) -> dict[str, Any]:
    return {n: v for n, v in vars(cls).items() if not n.startswith("_")}


def params(fn: Any) -> list[tuple[str, Any, Any]]:
    """Names, kinds and defaults; annotations differ on purpose (plain vs async loaders)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_constructors_take_the_same_arguments_with_the_same_defaults() -> None:
    assert params(FlightCacheSync.__init__) == params(FlightCache.__init__)


ASYNC_METHODS = sorted(
    name
    for name, value in [*public(FlightCache).items(), ("__aenter__", None), ("__aexit__", None)]
    if inspect.iscoroutinefunction(getattr(FlightCache, name))
)


def test_there_are_coroutines_to_compare() -> None:
    assert {"do", "get", "set", "invalidate", "inspect", "ping", "aclose"} <= set(ASYNC_METHODS)


@pytest.mark.parametrize("name", ASYNC_METHODS)
def test_every_coroutine_has_a_blocking_twin_with_the_same_signature(name: str) -> None:
    twin_name = RENAMED.get(name, name)
    twin = getattr(FlightCacheSync, twin_name, None)
    assert twin is not None, f"FlightCacheSync has no {twin_name} (the twin of {name})"
    assert callable(twin) and not inspect.iscoroutinefunction(twin), twin_name
    assert params(twin) == params(getattr(FlightCache, name)), twin_name


@pytest.mark.parametrize(
    "name",
    sorted(
        n
        for n, v in public(FlightCache).items()
        if callable(v) and not inspect.iscoroutinefunction(v)
    ),
)
def test_every_plain_method_has_a_twin_with_the_same_signature(name: str) -> None:
    twin = getattr(FlightCacheSync, name, None)
    assert twin is not None, f"FlightCacheSync has no {name}"
    assert params(twin) == params(getattr(FlightCache, name)), name


def test_every_public_name_of_an_instance_exists_on_both() -> None:
    """Attributes set in ``__init__``, properties and methods, on live instances."""
    fc, fcs = FlightCache("memory://", namespace="p"), FlightCacheSync("memory://", namespace="p")
    try:
        async_names = {RENAMED.get(n, n) for n in dir(fc) if not n.startswith("_")}
        sync_names = {n for n in dir(fcs) if not n.startswith("_")}
        assert async_names == sync_names
        for name in sorted(n for n in dir(fc) if not n.startswith("_")):
            value = getattr(fc, name)
            if isinstance(value, (str, int, float, type(None))) and name != "node_id":
                assert getattr(fcs, name) == value, name  # the same settings, read alike
        assert type(fcs.keyspace) is type(fc.keyspace) and type(fcs.envelope) is type(fc.envelope)
        assert fcs.stats.keys() == fc.stats.keys()
    finally:
        fcs.close()


def test_the_streams_match_too() -> None:
    async_names = {
        STREAM_RENAMED.get(n, n)
        for n in dir(FlightStream)
        if not n.startswith("_") or n in STREAM_RENAMED
    }
    sync_names = {
        n for n in dir(FlightStreamSync) if not n.startswith("_") or n in STREAM_RENAMED.values()
    }
    assert async_names <= sync_names
    assert params(FlightStreamSync.opened) == params(FlightStream.opened)
