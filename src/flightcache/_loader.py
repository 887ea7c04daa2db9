"""Running a loader under a hard timeout, shared by every backend."""

from __future__ import annotations

import asyncio
import logging

from ._codec import Envelope
from ._errors import FlightTimeout
from ._types import Loader

log = logging.getLogger("flightcache.loader")

CANCEL_GRACE_S = 1.0


async def call_and_encode(loader: Loader, envelope: Envelope, digest: str) -> bytes:
    """Await the loader and encode its value (ValueTooLarge / SerializationError raise here)."""
    value = await loader()
    return envelope.encode(value, key=digest)


async def wait_bounded(task: asyncio.Future[bytes], timeout_s: float, digest: str) -> bytes:
    """The task's result, or FlightTimeout after ``timeout_s`` with the task cancelled.

    A loader that ignores cancellation is given ``CANCEL_GRACE_S`` and then abandoned, so a
    hung loader can never hold its callers (or its heartbeat) past the bound.
    """
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()  # the flight itself is being cancelled (the cache is closing)
        raise
    if not done:
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
        if not done:
            log.error("flight %s: loader ignored cancellation; abandoned", digest)
            task.add_done_callback(_retrieve)
        raise FlightTimeout(f"loader ran past its timeout of {timeout_s:g} s", key=digest)
    return task.result()


def _retrieve(task: asyncio.Future[bytes]) -> None:
    if not task.cancelled():
        task.exception()
