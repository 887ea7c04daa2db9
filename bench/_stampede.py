"""Phase 1: a stampede of many processes on one fresh key (parent side).

Each round, every worker process starts its callers at the same ``time.monotonic()`` instant
on one fresh key. The loader's return value carries the loader's own pid and end time, so
every caller knows who owned the flight and can measure its wake lag against the one clock
all processes share. Server-side, the round is bracketed by ``ECHO`` markers that a
``MONITOR`` connection sees, which splits the server's view of the round into commands sent
by clients (top level) and commands run inside Lua scripts; ``INFO commandstats`` deltas
around the round count everything the server ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from typing import Any

import redis.asyncio as aioredis

from . import _orders
from ._orders import Worker
from ._util import CONTROL_COMMANDS, SETUP_COMMANDS, command_calls, delta, median, summary

START_DELAY_S = 0.4  # orders go out this long before the callers start
ROUND_TIMEOUT_S = 20.0
CONTAINER_COMMANDS = frozenset({"client", "script", "config", "cluster", "function", "object"})


class Monitor:
    """A MONITOR connection that records (client kind, client port, command, argument)."""

    def __init__(self, url: str) -> None:
        self.client = aioredis.Redis.from_url(url)
        self.entries: list[tuple[str, str, str, str]] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        ready = asyncio.Event()
        self._task = asyncio.create_task(self._run(ready))
        await asyncio.wait_for(ready.wait(), 10)

    async def _run(self, ready: asyncio.Event) -> None:
        async with self.client.monitor() as mon:
            ready.set()
            async for cmd in mon.listen():
                name, _, rest = cmd["command"].partition(" ")
                name = name.lower()
                arg = rest if name == "echo" else ""
                if name in CONTAINER_COMMANDS:  # named as INFO commandstats does
                    name = f"{name}|{rest.partition(' ')[0].lower()}"
                self.entries.append((cmd["client_type"], cmd["client_port"], name, arg))

    async def wait_for_marker(self, marker: str, timeout: float = 3.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i in range(len(self.entries) - 1, -1, -1):
                if self.entries[i][2] == "echo" and self.entries[i][3] == marker:
                    return i
            if self._task is not None and self._task.done():
                self._task.result()  # raises what stopped the monitor
                raise RuntimeError("MONITOR connection ended")
            await asyncio.sleep(0.01)
        raise RuntimeError(f"MONITOR did not show marker {marker!r} within {timeout} s")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self.client.aclose()


def _pid_of(name: str) -> int | None:
    """The pid in a flightcache client name (``flightcache:<host>:<pid>:<hex>``), if any."""
    parts = name.split(":")
    if len(parts) >= 4 and parts[0] == "flightcache" and parts[-2].isdigit():
        return int(parts[-2])
    return None


async def _port_owners(ctl: aioredis.Redis) -> dict[str, int]:
    owners: dict[str, int] = {}
    for client in await ctl.client_list():
        pid = _pid_of(str(client.get("name", "")))
        if pid is not None:
            owners[str(client["addr"]).rsplit(":", 1)[1]] = pid
    return owners


async def _round(
    ctl: aioredis.Redis,
    monitor: Monitor,
    workers: list[Worker],
    *,
    key: str,
    number: int,
    callers: int,
    loader_s: float,
) -> dict[str, Any]:
    before = command_calls(await ctl.info("commandstats"))
    start_marker, end_marker = f"bench-round-{number}-start", f"bench-round-{number}-end"
    await ctl.echo(start_marker)
    start_at, replies = await stampede_round(workers, key=key, callers=callers, loader_s=loader_s)
    await ctl.echo(end_marker)
    after = command_calls(await ctl.info("commandstats"))
    owners = await _port_owners(ctl)
    lo = await monitor.wait_for_marker(start_marker)
    hi = await monitor.wait_for_marker(end_marker)

    server_all = {n: v for n, v in delta(before, after).items() if n not in CONTROL_COMMANDS}
    top = Counter[str]()
    in_lua = Counter[str]()
    by_pid = Counter[int]()
    for kind, port, name, _arg in monitor.entries[lo + 1 : hi]:
        if kind == "lua":
            in_lua[name] += 1
        else:  # the markers bound the slice, so every client command here is a worker's
            top[name] += 1
            if name not in CONNECTION_SETUP:  # a process's protocol commands, not handshakes
                by_pid[owners.get(port, 0)] += 1  # pid 0: a connection closed before CLIENT LIST

    callers_seen = caller_figures(replies, start_at)
    owner_pid = callers_seen["owner_pid"]
    processes = [
        {
            "pid": r["pid"],
            "role": "owner" if r["pid"] == owner_pid else "follower",
            "client_commands": r["stats"]["commands"],
            "server_commands": by_pid.get(r["pid"], 0),
            "stats": {k: v for k, v in r["stats"].items() if v},
        }
        for r in replies
    ]
    return {
        "key": key,
        **callers_seen,
        "processes": processes,
        "server_top_level": dict(sorted(top.items())),
        "server_top_level_unattributed": by_pid.get(0, 0),
        "server_in_lua": dict(sorted(in_lua.items())),
        "server_commandstats": server_all,
    }


async def stampede_round(
    workers: list[Worker], *, key: str, callers: int, loader_s: float
) -> tuple[float, list[dict[str, Any]]]:
    """Every worker starts ``callers`` calls of ``fc.do(key)`` at one ``time.monotonic()``
    instant, ``START_DELAY_S`` from now; that instant and the workers' replies.

    Shared with the cluster stampede (``_cluster.py``).
    """
    start_at = time.monotonic() + START_DELAY_S
    order = {
        "op": "stampede",
        "key": key,
        "callers": callers,
        "start_at": start_at,
        "loader_s": loader_s,
        "timeout": ROUND_TIMEOUT_S,
    }
    await asyncio.gather(*(w.send(order) for w in workers))
    replies = await asyncio.gather(*(w.receive(ROUND_TIMEOUT_S + 5) for w in workers))
    return start_at, list(replies)


def caller_figures(replies: list[dict[str, Any]], start_at: float) -> dict[str, Any]:
    """What the callers of one round saw: loader runs, errors, the owner, wake lags (ms).

    Shared with the cluster stampede (``_cluster.py``), whose workers answer the same way.
    """
    loader_runs = sum(len(r["loader_ends"]) for r in replies)
    errors = [c[4] for r in replies for c in r["callers"] if c[4] is not None]
    owner_pids = {c[2] for r in replies for c in r["callers"] if c[2] is not None}
    owner_pid = next(iter(owner_pids)) if len(owner_pids) == 1 else None
    owner_lag: list[float] = []
    remote_lag: list[float] = []
    owner_first: list[float] = []
    remote_first: list[float] = []
    starts: list[float] = []
    for r in replies:
        lags = [(t1 - end) * 1000 for _t0, t1, _pid, end, err in r["callers"] if err is None]
        starts.extend(c[0] for c in r["callers"])
        is_owner = r["pid"] == owner_pid
        (owner_lag if is_owner else remote_lag).extend(lags)
        if lags:
            (owner_first if is_owner else remote_first).append(min(lags))
    return {
        "loader_runs": loader_runs,
        "owner_pid": owner_pid,
        "errors": errors,
        "arrival_spread_ms": (max(starts) - min(starts)) * 1000 if starts else None,
        "first_start_after_start_at_ms": (min(starts) - start_at) * 1000 if starts else None,
        "owner_lag_ms": owner_lag,
        "remote_lag_ms": remote_lag,
        "owner_first_lag_ms": owner_first,
        "remote_first_lag_ms": remote_first,
    }


def pooled(
    rounds: list[dict[str, Any]], *, processes: int, callers: int, loader_s: float
) -> dict[str, Any]:
    """What every stampede reports over its rounds (of :func:`caller_figures`): its shape,
    the loader runs of each round, every caller error, and the wake lags pooled (owner-process
    and remote callers, the first woken of each). Shared with the cluster stampede."""
    return {
        "config": {
            "processes": processes,
            "callers_per_process": callers,
            "rounds": len(rounds),
            "loader_s": loader_s,
        },
        "loader_runs_per_round": [r["loader_runs"] for r in rounds],
        "errors": [e for r in rounds for e in r["errors"]],
        "wake_lag_ms": {
            field: summary([x for r in rounds for x in r[f"{field}_lag_ms"]])
            for field in ("owner", "remote", "owner_first", "remote_first")
        },
    }


CONNECTION_SETUP = {"hello", "client|setinfo", "client|setname"}


async def run(
    url: str, *, processes: int = 4, callers: int = 50, rounds: int = 5, loader_s: float = 0.2
) -> dict[str, Any]:
    ctl = aioredis.Redis.from_url(url)
    monitor = Monitor(url)
    run_id = uuid.uuid4().hex[:8]
    try:
        async with _orders.started(processes, url) as workers:
            await monitor.start()
            results = []
            for number in range(1, rounds + 1):
                key = f"stampede:{run_id}:{number}"
                results.append(
                    await _round(
                        ctl,
                        monitor,
                        workers,
                        key=key,
                        number=number,
                        callers=callers,
                        loader_s=loader_s,
                    )
                )
    finally:
        await monitor.stop()
        await ctl.aclose()
    return _aggregate(results, processes=processes, callers=callers, loader_s=loader_s)


def _aggregate(
    rounds: list[dict[str, Any]], *, processes: int, callers: int, loader_s: float
) -> dict[str, Any]:
    total_callers = processes * callers
    followers = [p for r in rounds for p in r["processes"] if p["role"] == "follower"]
    owners = [p for r in rounds for p in r["processes"] if p["role"] == "owner"]

    def per_round(field: str, exclude: frozenset[str] = frozenset()) -> float:
        return median([sum(v for n, v in r[field].items() if n not in exclude) for r in rounds])

    top_level = per_round("server_top_level")
    top_level_setup = median(
        [sum(v for n, v in r["server_top_level"].items() if n in SETUP_COMMANDS) for r in rounds]
    )
    all_server = per_round("server_commandstats")
    return {
        **pooled(rounds, processes=processes, callers=callers, loader_s=loader_s),
        "arrival_spread_ms": summary([r["arrival_spread_ms"] for r in rounds]),
        "commands": {
            "server_top_level_per_round": top_level,
            "server_top_level_setup_per_round": top_level_setup,
            "server_top_level_per_caller": top_level / total_callers,
            "server_all_per_round": all_server,
            "server_all_per_caller": all_server / total_callers,
            "follower_process_client": _spread([p["client_commands"] for p in followers]),
            "follower_process_server": _spread([p["server_commands"] for p in followers]),
            "owner_process_client": _spread([p["client_commands"] for p in owners]),
            "owner_process_server": _spread([p["server_commands"] for p in owners]),
            "top_level_by_name": _median_counts([r["server_top_level"] for r in rounds]),
            "in_lua_by_name": _median_counts([r["server_in_lua"] for r in rounds]),
        },
        "rounds": rounds,
    }


def _spread(values: list[int]) -> dict[str, float]:
    return {
        "min": min(values, default=0),
        "median": median(values),
        "max": max(values, default=0),
    }


def _median_counts(counts: list[dict[str, int]]) -> dict[str, float]:
    names = sorted({n for c in counts for n in c})
    return {n: median([c.get(n, 0) for c in counts]) for n in names}
