"""``@fc.flight``: every call of a function as a flight of the cache, on either front door.

The key of a call is ``{"fn": "<module>.<qualname>", "args": {name: value, ...}}`` with the
defaults applied, so equal calls share one flight however their arguments were passed.

Both ``def`` and ``async def`` functions are accepted by both doors; the decorated function
keeps its parameters and its return type, and takes the calling convention of the door:

- on ``FlightCache`` it is a coroutine function (a ``def`` body runs in a worker thread,
  ``asyncio.to_thread``, so it may block without starving the event loop);
- on ``FlightCacheSync`` it is a plain function (an ``async def`` body runs on the sync
  client's private event loop, a ``def`` body in a worker thread of its pool).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, Protocol, TypeVar, overload

from ._errors import ConfigError

P = ParamSpec("P")
R = TypeVar("R")


class AsyncFlight(Protocol):
    """What ``FlightCache.flight(ttl=...)`` returns: a decorator giving coroutine functions."""

    @overload
    def __call__(self, fn: Callable[P, Awaitable[R]], /) -> Callable[P, Coroutine[Any, Any, R]]: ...

    @overload
    def __call__(self, fn: Callable[P, R], /) -> Callable[P, Coroutine[Any, Any, R]]: ...


class SyncFlight(Protocol):
    """What ``FlightCacheSync.flight(ttl=...)`` returns: a decorator giving plain functions."""

    @overload
    def __call__(self, fn: Callable[P, Awaitable[R]], /) -> Callable[P, R]: ...

    @overload
    def __call__(self, fn: Callable[P, R], /) -> Callable[P, R]: ...


def call_key(func: Callable[..., Any]) -> Callable[..., dict[str, Any]]:
    """What gives the key of one call of ``func`` (its arguments must be canonical)."""
    signature = inspect.signature(func)
    name = f"{func.__module__}.{func.__qualname__}"

    def key(*args: Any, **kwargs: Any) -> dict[str, Any]:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return {"fn": name, "args": bound.arguments}

    return key


def _check(func: Any) -> None:
    if not callable(func):
        raise ConfigError(f"@flight needs a function, not {func!r}")
    if inspect.isasyncgenfunction(func) or inspect.isgeneratorfunction(func):
        raise ConfigError(
            f"@flight caches what a function returns; {func!r} is a generator: use "
            "fc.stream(key, producer) for a stream of chunks"
        )
    try:
        inspect.signature(func)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"@flight needs a function with a signature: {func!r}") from exc


def flight_decorator(
    do: Callable[..., Any],
    *,
    ttl: float | None,
    lease: float | None,
    timeout: float | None,
    blocking: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator that runs each call through ``do`` (``FlightCache.do``, or with
    ``blocking`` the sync client's ``do``, which accepts plain and async loaders alike)."""

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        _check(func)
        key_of = call_key(func)

        if blocking:

            @functools.wraps(func)
            def call(*args: Any, **kwargs: Any) -> Any:
                loader = functools.partial(func, *args, **kwargs)
                return do(key_of(*args, **kwargs), loader, ttl=ttl, lease=lease, timeout=timeout)

            return call

        is_async = inspect.iscoroutinefunction(func)

        @functools.wraps(func)
        async def acall(*args: Any, **kwargs: Any) -> Any:
            if is_async:
                loader: Callable[[], Awaitable[Any]] = functools.partial(func, *args, **kwargs)
            else:  # a def body may block: a worker thread, not the event loop
                loader = functools.partial(asyncio.to_thread, func, *args, **kwargs)
            key = key_of(*args, **kwargs)
            return await do(key, loader, ttl=ttl, lease=lease, timeout=timeout)

        return acall

    return decorate
