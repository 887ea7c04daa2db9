"""A bounded wait that never swallows its caller's cancellation.

``asyncio.wait_for`` before Python 3.12 runs the awaited thing as a separate task and,
when the caller is cancelled in the same turn of the loop as that task completes,
returns the result instead of raising ``CancelledError``: the cancellation is lost, and a
caller that was told to stop carries on (a cancelled ``do()`` returning a value). Every
bounded wait in flightcache goes through ``within``, which awaits in the caller's own task
under a deadline, so a cancellation is always delivered. ``cancels_pending`` lets a caller
of code that may still lose one (the driver) see that it did, and raise it.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

if sys.version_info >= (3, 11):

    async def within(aw: Awaitable[T], seconds: float) -> T:
        """``await aw``, raising ``asyncio.TimeoutError`` after ``seconds``."""
        async with asyncio.timeout(seconds):
            return await aw

    def cancels_pending() -> int:
        """How many cancellations of the running task are pending (not yet delivered, or
        delivered and suppressed without ``uncancel``): compared before and after an await,
        a rise means the code awaited lost one."""
        task = asyncio.current_task()
        return task.cancelling() if task is not None else 0

else:  # pragma: no cover - Python 3.10 has no asyncio.timeout nor Task.cancelling

    async def within(aw: Awaitable[T], seconds: float) -> T:
        """``await aw``, raising ``asyncio.TimeoutError`` after ``seconds``.

        (3.10 cannot tell two cancellations of a task apart: one arriving in the same
        turn of the loop as the deadline is reported as the timeout.)
        """
        task = asyncio.current_task()
        assert task is not None, "within() is awaited in a task"
        fired = False

        def fire() -> None:
            nonlocal fired
            fired = True
            task.cancel()

        handle = asyncio.get_running_loop().call_later(seconds, fire)
        try:
            return await aw
        except asyncio.CancelledError:
            if fired:
                raise asyncio.TimeoutError from None
            raise
        finally:
            handle.cancel()

    def cancels_pending() -> int:
        """Always 0 on Python 3.10, which does not count a task's cancellations."""
        return 0
