"""``@fc.flight``: every call of an async function as a flight of the cache.

The key of a call is ``{"fn": "<module>.<qualname>", "args": {name: value, ...}}`` with the
defaults applied, so equal calls share one flight however their arguments were passed.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

from ._errors import ConfigError

P = ParamSpec("P")
R = TypeVar("R")


def call_key(func: Callable[..., Any]) -> Callable[..., dict[str, Any]]:
    """What gives the key of one call of ``func`` (its arguments must be canonical)."""
    signature = inspect.signature(func)
    name = f"{func.__module__}.{func.__qualname__}"

    def key(*args: Any, **kwargs: Any) -> dict[str, Any]:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return {"fn": name, "args": bound.arguments}

    return key


def flight_decorator(
    do: Callable[..., Awaitable[Any]],
    *,
    ttl: float | None,
    lease: float | None,
    timeout: float | None,
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """A decorator that runs each call through ``do`` (``FlightCache.do``)."""

    def decorate(func: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        if not inspect.iscoroutinefunction(func):
            raise ConfigError(f"@flight needs an async function, not {func!r}")
        key_of = call_key(func)

        @functools.wraps(func)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            key = key_of(*args, **kwargs)
            result: R = await do(
                key, lambda: func(*args, **kwargs), ttl=ttl, lease=lease, timeout=timeout
            )
            return result

        return wrapper

    return decorate
