"""Running a loader under a hard timeout, shared by every backend."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from .._errors import FlightError, FlightTimeout
from .._types import CallOptions

log = logging.getLogger("flightcache.loader")

CANCEL_GRACE_S = 1.0


def error_ttl_ms(exc: BaseException, opts: CallOptions) -> int:
    """How long a loader's error is negative-cached: its ``flightcache_error_ttl`` attribute
    (seconds, 0 for not at all) when it has one, else the cache's ``error_ttl``."""
    ttl = getattr(exc, "flightcache_error_ttl", None)
    if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and ttl >= 0:
        return int(min(ttl, MAX_ERROR_TTL_S) * 1000)  # inf and huge values are clamped
    return opts.error_ttl_ms


MAX_ERROR_TTL_S = 86400.0


def _ended(
    waiter: asyncio.Future[None], on_cancel: Callable[[], None] | None, t: asyncio.Future[bytes]
) -> None:
    """``wait_bounded``'s one callback for all the task's end does (a partial, not a
    closure: fewer objects a flight for the collector to walk)."""
    if on_cancel is not None and t.cancelled():
        on_cancel()
    _release(waiter)


Work = tuple["asyncio.Task[bytes]", "asyncio.Future[None]"]


def start_work(work: Coroutine[Any, Any, bytes]) -> Work:
    """``work`` in a task of its own, and a future it sets itself in its last step, for
    :func:`wait_bounded`: the waiter wakes one turn of the loop after the work ends, where a
    done callback would take two (the callback's turn, then the waiter's). Under load a
    turn is milliseconds, and every flight's end waits for it."""
    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    return asyncio.ensure_future(_telling(work, ended)), ended


async def _telling(work: Coroutine[Any, Any, bytes], ended: asyncio.Future[None]) -> bytes:
    try:
        return await work
    finally:
        _release(ended)  # (the task is done by the time its waiter runs)


async def wait_bounded(
    work: Work,
    timeout_s: float,
    digest: str,
    on_cancel: Callable[[], None] | None = None,
) -> bytes:
    """The result of ``work`` (from :func:`start_work`), or FlightTimeout after ``timeout_s``
    with its task cancelled.

    A loader that ignores cancellation is given ``CANCEL_GRACE_S`` and then abandoned, so a
    hung loader can never hold its callers (or its heartbeat) past the bound. ``on_cancel``
    is told before the task is cancelled here, and when the task ends cancelled by anyone
    (the loader's ``FlightContext``: idempotent).
    """
    loop = asyncio.get_running_loop()
    task, waiter = work  # (from start_work: the task sets the waiter itself)
    task.add_done_callback(functools.partial(_ended, waiter, on_cancel))
    timer = loop.call_later(timeout_s, _release, waiter)
    try:
        await waiter
    except asyncio.CancelledError:
        if on_cancel is not None:
            on_cancel()
        task.cancel()  # the flight itself is being cancelled (the cache is closing)
        raise
    finally:
        timer.cancel()
    if not task.done():
        if on_cancel is not None:
            on_cancel()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
        if not done:
            log.error("flight %s: loader ignored cancellation; abandoned", digest)
            task.add_done_callback(_retrieve)
        raise FlightTimeout(f"loader ran past its timeout of {timeout_s:g} s", key=digest)
    if task.cancelled():  # not by our caller: by the heartbeat, or the loader raised it itself
        raise WorkCancelled(digest)
    return task.result()


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class WorkCancelled(Exception):
    """The loader's task ended cancelled while the flight itself was not being cancelled."""


def cancelled_loader_error(digest: str) -> FlightError:
    return FlightError(
        "the loader was cancelled without a timeout, a lost lease or a close "
        "(it raised CancelledError itself)",
        key=digest,
    )


def _retrieve(task: asyncio.Future[bytes]) -> None:
    if not task.cancelled():
        task.exception()
