"""A stand-in for an SDK client: the coalesced ``create`` methods, everything else the
client's own.

:func:`wrap` returns a :class:`ClientProxy` whose resources on the coalesced paths
(``chat.completions``, ``responses``, ``messages``, ...) are proxies with a ``create`` of
ours; any other attribute, method or resource is looked up on the wrapped client (or
resource) at each use, and attributes set on a proxy are set on it. ``with_options()`` and
``copy()`` return the new client wrapped the same way; ``with``/``async with`` and
``close()`` are the client's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from ._core import Coalescer, Endpoint

__all__ = ["ClientProxy", "Proxy", "wrap"]


class Proxy:
    """Used like ``target``; the names in ``overrides`` are ours."""

    __slots__ = ("_flightcache_overrides", "_flightcache_target")

    def __init__(self, target: Any, overrides: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_flightcache_target", target)
        object.__setattr__(self, "_flightcache_overrides", dict(overrides))

    def __getattr__(self, name: str) -> Any:
        overrides = object.__getattribute__(self, "_flightcache_overrides")
        if name in overrides:
            return overrides[name]
        return getattr(object.__getattribute__(self, "_flightcache_target"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._flightcache_target, name, value)

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self._flightcache_target)) | set(self._flightcache_overrides))

    def __repr__(self) -> str:
        return f"<flightcache coalesced {self._flightcache_target!r}>"


class ClientProxy(Proxy):
    """A wrapped client: also a context manager, as the client is."""

    __slots__ = ()

    def __enter__(self) -> ClientProxy:
        self._flightcache_target.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._flightcache_target.__exit__(*exc)

    async def __aenter__(self) -> ClientProxy:
        await self._flightcache_target.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._flightcache_target.__aexit__(*exc)


def _create(coalescer: Coalescer, endpoint: Endpoint, resource: Any, is_async: bool) -> Any:
    original = resource.create
    if is_async:

        async def acreate(**kwargs: Any) -> Any:
            return await coalescer.acall(endpoint, original, kwargs)

        return functools.wraps(original)(acreate)

    def create(**kwargs: Any) -> Any:
        return coalescer.call(endpoint, original, kwargs)

    return functools.wraps(original)(create)


def wrap(
    client: Any,
    coalescer: Coalescer,
    endpoints: Mapping[tuple[str, ...], Endpoint],
    *,
    is_async: bool,
    rewrap: Callable[[Any], Any],
) -> ClientProxy:
    """``client`` with the ``create`` of each resource path in ``endpoints`` coalesced."""
    tree: dict[str, Any] = {}  # name -> subtree, or the Endpoint at a leaf
    for path, endpoint in endpoints.items():
        node = tree
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = endpoint

    def build(target: Any, node: Mapping[str, Any]) -> dict[str, Any]:
        overrides: dict[str, Any] = {}
        for name, child in node.items():
            resource = getattr(target, name)
            if isinstance(child, Endpoint):
                create = _create(coalescer, child, resource, is_async)
                overrides[name] = Proxy(resource, {"create": create})
            else:
                overrides[name] = Proxy(resource, build(resource, child))
        return overrides

    overrides = build(client, tree)

    def with_options(**kwargs: Any) -> Any:
        return rewrap(client.with_options(**kwargs))

    def copy(**kwargs: Any) -> Any:
        return rewrap(client.copy(**kwargs))

    overrides |= {"with_options": with_options, "copy": copy}
    return ClientProxy(client, overrides)


def coalesce_client(
    client: Any,
    fc: Any,
    coalescer: Callable[[Any], Coalescer],
    endpoints: Mapping[tuple[str, ...], Endpoint],
    *,
    is_async: bool,
) -> ClientProxy:
    """Check that ``fc`` is the door that fits the client, and wrap it."""
    from .._cache import FlightCache
    from .._errors import ConfigError
    from .._sync import FlightCacheSync

    if is_async and not isinstance(fc, FlightCache):
        raise ConfigError(
            f"{type(client).__name__} is async: wrap it with a FlightCache "
            f"(not {type(fc).__name__})"
        )
    if not is_async and not isinstance(fc, FlightCacheSync):
        raise ConfigError(
            f"{type(client).__name__} blocks: wrap it with a FlightCacheSync "
            f"(not {type(fc).__name__}), or use the SDK's async client with a FlightCache"
        )

    def rewrap(new_client: Any) -> Any:
        return coalesce_client(new_client, fc, coalescer, endpoints, is_async=is_async)

    return wrap(client, coalescer(client), endpoints, is_async=is_async, rewrap=rewrap)
