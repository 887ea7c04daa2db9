"""What the scale phases read off the server while they run: how many connections a
process holds (``CLIENT LIST``) and which commands the server ran (``INFO commandstats``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from ._util import CONTROL_COMMANDS, SETUP_COMMANDS, command_calls

BLOCKING = frozenset({"xread", "xreadgroup", "blpop", "brpop", "blmove", "bzpopmin", "wait"})


class ConnectionPeak:
    """Samples ``CLIENT LIST`` every ``interval`` while in use: the most connections whose
    client name names process ``pid`` (``flightcache:<host>:<pid>:<hex>[:listen]``), the
    most of them in a blocking command, and the most listener connections."""

    def __init__(self, ctl: aioredis.Redis, pid: int, interval: float = 0.1) -> None:
        self.ctl, self.pid, self.interval = ctl, pid, interval
        self.peak = self.blocked = self.listeners = self.samples = 0

    async def sample(self) -> None:
        mark = f":{self.pid}:"
        mine = [c for c in await self.ctl.client_list() if mark in str(c.get("name", ""))]
        self.peak = max(self.peak, len(mine))
        self.blocked = max(self.blocked, sum(c.get("cmd") in BLOCKING for c in mine))
        self.listeners = max(self.listeners, sum(str(c["name"]).endswith(":listen") for c in mine))
        self.samples += 1

    async def _run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sample()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[ConnectionPeak]:
        # Stopped by an event, not by cancelling it mid-command: redis-py may turn a
        # cancellation inside a command into a timeout, which its retry then swallows.
        stop = asyncio.Event()
        task = asyncio.create_task(self._run(stop))
        try:
            yield self
        finally:
            stop.set()
            try:
                await asyncio.wait_for(task, 10)
            finally:
                task.cancel()
            await self.sample()

    def figures(self) -> dict[str, int]:
        return {
            "peak": self.peak,
            "blocked_peak": self.blocked,
            "listeners": self.listeners,
            "samples": self.samples,
        }


async def _commandstats(ctl: aioredis.Redis) -> dict[str, int]:
    """``INFO commandstats`` calls, without the bench's own and connection setup."""
    calls = command_calls(await ctl.info("commandstats"))
    return {n: v for n, v in calls.items() if n not in CONTROL_COMMANDS | SETUP_COMMANDS}
