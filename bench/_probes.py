"""What the scale phases read off the server while they run: how many connections a
process holds (``CLIENT LIST``) and which commands the server ran (``INFO commandstats``);
and off this machine: how much CPU a process spent (``_cpu_seconds``; the server's own
account, ``_server_cpu``) and how long it waited for one (``runqueue_wait_s``)."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import math
import os
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


async def local_server_pid(ctl: aioredis.Redis) -> int | None:
    """The server's process id, if it runs on this machine (its command line names its
    port); None otherwise."""
    info = await ctl.info("server")
    pid = int(info["process_id"])
    return pid if str(info["tcp_port"]).encode() in _cmdline(pid) else None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def runqueue_wait_s(pid: int | None) -> float:
    """Seconds the threads of process ``pid`` have spent runnable but waiting for a CPU
    (Linux ``/proc/<pid>/task/*/schedstat``, second field, ns; its threads that ended are not
    counted); NaN where the kernel does not keep it. The share of a latency tail that is the
    machine's: a process ready to run that no CPU takes."""
    paths = glob.glob(f"/proc/{pid}/task/*/schedstat") if pid is not None else []
    if not paths:
        return math.nan
    total = 0
    for path in paths:
        with contextlib.suppress(FileNotFoundError):  # (a thread that ended meanwhile)
            with open(path) as f:
                total += int(f.read().split()[1])
    return total / 1e9


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process on this machine (Linux /proc), NaN elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return math.nan


async def _server_cpu(redis: aioredis.Redis) -> float:
    info = await redis.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
