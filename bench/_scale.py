"""Phase 7: scale across distinct keys: what a process costs when many *different* keys are
in flight at once (docs/protocol.md, "Waiting, claiming and renewing at scale").

- Many flights followed: two worker processes (``bench._scale_worker``, ``near_cache=False``,
  lease 3 s). The owner starts ``keys`` distinct ``fc.do`` calls at once, each loader
  sleeping ``loader_s``; once every loader runs, the follower calls ``fc.do`` on the same
  keys. Right values, errors, the follower's server connections (``CLIENT LIST``, by the pid
  in the client names, sampled every 0.1 s) and its wake lag: the follower's return minus
  the owner's loader end for the same key, both on ``time.monotonic()`` (CLOCK_MONOTONIC,
  one clock for every process on a Linux machine; the end rides in the value). Baseline,
  same processes and run: ``single_rounds`` rounds of one key each. Three times: the ends
  spread over ``spread_s``; over ``loader_s`` (``keys / loader_s`` ends a second: what
  ``keys`` flights in flight sustain, the steady state); each wave's ends in one instant.
- Renewals: while the owner's loaders all run and nothing else happens (before the follower
  starts), ``INFO commandstats`` over ``window_s``: the owner's ``EVALSHA`` calls a second,
  next to one renewal script per flight per lease/3.
- Memory: once the follower has joined every flight (its ``follows`` counter), ``MEMORY
  USAGE`` (``SAMPLES 0``) of each flight's meta, stream and waiters keys, per flight; and
  ``INFO memory`` ``used_memory`` growth since before the flights, per flight.
- Misses: in this process, ``miss_keys`` distinct keys asked once each, ``concurrency`` at a
  time, loader returning at once: ``fc.do`` next to plain redis-py GET, then SET on a miss,
  in rounds that alternate the order; the ratio is taken within each round. Commands per
  miss: ``INFO commandstats`` (everything the server ran, inside Lua too) and
  ``fc.stats["commands"]`` over the timed rounds, and the commands sent on the wire for
  ``monitor_keys`` more misses of each, seen by ``MONITOR``.
- Streams: the gateway phase's mock upstream and two ``flightcache serve`` replicas
  (``bench._gateway``); ``streams`` distinct prompts, each asked of both replicas at once
  (``in_flight`` prompts at a time), every stream read to its end. Upstream calls (the
  mock's ``GET /stats``), clients served, the same text as the upstream's, and wall time.
  Baseline, same run: the same clients sending the same requests to the mock directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import math
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import orjson
import redis.asyncio as aioredis

from flightcache import FlightCache
from flightcache._keys import KeySpace

from . import _orders
from ._gateway import (
    CLIENT_SHARE,
    HEADERS,
    LATENCY_MS,
    TEXT_TOKENS,
    TOKENS_PER_S,
    StreamResult,
    _body,
    _cpu_seconds,
    _Mock,
    _pick,
    _server_cpu,
    _start,
    _stream,
)
from ._orders import Worker
from ._rounds import ratio
from ._services import Service, stop_all
from ._stampede import Monitor
from ._util import CONTROL_COMMANDS, SETUP_COMMANDS, command_calls, delta, median, summary

LEASE_S = 3.0
SINGLE_LOADER_S = 0.3  # the single-key baseline's loader
# The baseline's p99 is taken over 100 rounds: of 20 (the count before), the interpolated p99
# is nearly their maximum, about the 95th percentile of the distribution. The first 20 rounds'
# figures are kept next to it, to compare with runs that had 20.
FIRST_ROUNDS = 20
_PHASES = itertools.count()  # each many-keys phase its own keys
BURST_LOADER_S = 5.0  # the owner burst's loader
TTL_S = 600
BLOCKING = frozenset({"xread", "xreadgroup", "blpop", "brpop", "blmove", "bzpopmin", "wait"})
MEMORY_KEYS = ("meta", "stream", "waiters")


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


# -- many flights followed, renewals, memory ------------------------------------------------


async def _single_key(
    ctl: aioredis.Redis, owner: Worker, follower: Worker, run_id: str, rounds: int
) -> dict[str, Any]:
    """One key per round, one owner process, one follower process: the baseline."""
    lags: list[float] = []
    owner_lags: list[float] = []
    errors: list[str] = []
    right = late = 0
    peak = ConnectionPeak(ctl, follower.pid)
    async with peak.running():
        for r in range(rounds):
            prefix = f"one:{run_id}:{r}"
            order = {"op": "own", "prefix": prefix, "keys": 1, "loader_s": SINGLE_LOADER_S}
            await owner.ask({**order, "timeout": 10}, 15)
            await follower.ask({"op": "follow", "prefix": prefix, "keys": 1}, 5)
            got = await follower.ask({"op": "results", "timeout": 10}, 15)
            own = await owner.ask({"op": "results", "timeout": 10}, 15)
            lags += got["wake_lag_ms"]
            owner_lags += own["wake_lag_ms"]
            errors += got["errors"] + own["errors"]
            right += got["right"] == 1 and got["loader_runs"] == 0 and own["loader_runs"] == 1
            late += got["late"]
    return {
        "rounds": rounds,
        "loader_s": SINGLE_LOADER_S,
        "right_rounds": right,
        "errors": errors,
        "late": late,
        "wake_lag_ms": summary(lags),
        "first_rounds": min(rounds, FIRST_ROUNDS),
        "first_rounds_wake_lag_ms": summary(lags[:FIRST_ROUNDS]),
        "owner_return_lag_ms": summary(owner_lags),
        "follower_connections": peak.figures(),
    }


async def _used_memory(ctl: aioredis.Redis) -> int:
    return int((await ctl.info("memory"))["used_memory"])


async def _memory(ctl: aioredis.Redis, namespace: str, prefix: str, keys: int) -> dict[str, Any]:
    """``MEMORY USAGE <key> SAMPLES 0`` of every flight's meta, stream and waiters keys."""
    space = KeySpace(namespace)
    total = Counter[str]()
    present = Counter[str]()
    chunk = 1000
    for lo in range(0, keys, chunk):
        flights = [space.flight(f"{prefix}:{i}") for i in range(lo, min(lo + chunk, keys))]
        pipe = ctl.pipeline(transaction=False)
        for fk in flights:
            for part in MEMORY_KEYS:
                pipe.memory_usage(getattr(fk, part), samples=0)
        answers = await pipe.execute()
        for j, used in enumerate(answers):
            part = MEMORY_KEYS[j % len(MEMORY_KEYS)]
            if used is not None:
                total[part] += int(used)
                present[part] += 1
    per_flight = {part: total[part] / keys for part in MEMORY_KEYS}
    # The reference: a bare stream of one small entry, and the setting that sizes its node;
    # and the same at the servers' default node size (4 KiB), to say what a flight's stream
    # costs on a server left at its default.
    node_bytes = (await ctl.config_get("stream-node-max-bytes")).get("stream-node-max-bytes")
    bare = await _bare_stream(ctl, f"{namespace}:bench-bare-stream")
    await ctl.config_set("stream-node-max-bytes", DEFAULT_NODE_BYTES)
    try:
        bare_default = await _bare_stream(ctl, f"{namespace}:bench-bare-stream")
    finally:
        await ctl.config_set("stream-node-max-bytes", node_bytes)
    at_default = sum(per_flight.values()) + (bare_default - bare) * present["stream"] / keys
    return {
        "flights": keys,
        "bytes_per_flight": sum(per_flight.values()),
        "by_key": per_flight,
        "keys_present": dict(present),
        "bare_one_entry_stream_bytes": bare,
        "stream_node_max_bytes": int(node_bytes) if node_bytes is not None else None,
        "bytes_per_flight_at_default_node_bytes": at_default,
    }


DEFAULT_NODE_BYTES = 4096  # stream-node-max-bytes as Redis and Valkey ship


async def _bare_stream(ctl: aioredis.Redis, scratch: str) -> int:
    await ctl.xadd(scratch, {"t": "claimed"})
    bare = int(await ctl.memory_usage(scratch, samples=0))
    await ctl.delete(scratch)
    return bare


async def _wait_joined(follower: Worker, keys: int, until: float) -> dict[str, Any]:
    """Polls the follower until it has joined every flight (or a call ended, or ``until``)."""
    while True:
        seen = await follower.ask({"op": "progress"}, 10)
        follows = seen["stats"]["follows"]
        if follows >= keys or seen["ended"] or time.monotonic() >= until:
            return {"follows": follows, "ended": seen["ended"], "at": time.monotonic()}
        await asyncio.sleep(0.1)


async def _many_keys(
    ctl: aioredis.Redis,
    owner: Worker,
    follower: Worker,
    *,
    namespace: str,
    run_id: str,
    keys: int,
    loader_s: float,
    window_s: float,
    wave: int,
    spread_s: float,
) -> dict[str, Any]:
    prefix = f"many:{run_id}:{next(_PHASES)}"
    memory_before = await _used_memory(ctl)
    order = {
        "op": "own",
        "prefix": prefix,
        "keys": keys,
        "loader_s": loader_s,
        "spread_s": spread_s,
        "wave": wave,
    }
    claimed = await owner.ask({**order, "timeout": loader_s / 2}, loader_s)
    # Renewals: only the owner's heartbeats run now (the follower has not started).
    await asyncio.sleep(0.2)
    before, stats_before = await _commandstats(ctl), await owner.ask({"op": "progress"}, 10)
    cpu_before = (await _server_cpu(ctl), _cpu_seconds(owner.pid))
    t0 = time.monotonic()
    await asyncio.sleep(window_s)
    after, stats_after = await _commandstats(ctl), await owner.ask({"op": "progress"}, 10)
    cpu_after = (await _server_cpu(ctl), _cpu_seconds(owner.pid))
    window = time.monotonic() - t0
    renewals = delta(before, after)
    owner_commands = stats_after["stats"]["commands"] - stats_before["stats"]["commands"]

    follower_peak = ConnectionPeak(ctl, follower.pid)
    owner_peak = ConnectionPeak(ctl, owner.pid, interval=0.5)
    follow_cpu = (_cpu_seconds(follower.pid), _cpu_seconds(owner.pid), await _server_cpu(ctl))
    async with follower_peak.running(), owner_peak.running():
        started = await follower.ask({"op": "follow", "prefix": prefix, "keys": keys}, 10)
        first_end = claimed["all_running_at"] - claimed["claim_s"] + loader_s  # at the earliest
        joined = await _wait_joined(follower, keys, until=first_end - 0.5)
        memory = await _memory(ctl, namespace, prefix, keys)
        memory["used_memory_growth_per_flight"] = (await _used_memory(ctl) - memory_before) / keys
        left = loader_s + spread_s + 60
        got = await follower.ask({"op": "results", "timeout": left}, left + 10)
    own = await owner.ask({"op": "results", "timeout": 60}, 70)
    followed_cpu = (_cpu_seconds(follower.pid), _cpu_seconds(owner.pid), await _server_cpu(ctl))
    follow_s = time.monotonic() - started["started_at"]
    # The follower's return minus the owner's own return, per key: what the wake channel
    # adds once the owner's complete_flight has answered (negative: the follower was first).
    after_owner = [
        (f_t1 - o_t1) * 1000
        for f_t1, o_t1 in zip(got.pop("returns"), own.pop("returns"), strict=True)
        if f_t1 is not None and o_t1 is not None
    ]
    return {
        "keys": keys,
        "loader_s": loader_s,
        "spread_s": spread_s,
        "lease_s": LEASE_S,
        "wave": wave,
        "claim_s": claimed["claim_s"],
        "lease_lost_while_claiming": claimed["lease_lost"],
        "follow_started_at": started["started_at"],  # time.monotonic(), as the warnings'
        "renewal_window_lease_lost": stats_after["stats"]["lease_lost"],
        "running_at_once": claimed["running"],
        "join_s": joined["at"] - started["started_at"],
        "joined_before_first_end": joined["follows"],
        "all_in_flight_at_once": (
            own["loader_last_start"] is not None
            and own["loader_first_end"] is not None
            and own["loader_last_start"] < own["loader_first_end"]
            and joined["follows"] >= keys
            and joined["at"] < own["loader_first_end"]
        ),
        "owner": {k: v for k, v in own.items() if k != "wake_lag_ms"},
        # The owner's own callers: their return (once complete_flight answered) - loader end.
        "owner_return_lag_ms": summary(own["wake_lag_ms"]),
        "follower_after_owner_ms": summary(after_owner),
        # Woken well after the owner's return: the wake message was missed or came late, and
        # the lease-bounded re-check (one lease later at the most) found the end.
        "follower_after_owner_over_1s": sum(x > 1000 for x in after_owner),
        "follower": {k: v for k, v in got.items() if k != "wake_lag_ms"},
        "right": got["right"],
        "unfinished": got["unfinished"] + own["unfinished"],
        "errors": got["errors"] + own["errors"],
        "error_count": got["error_count"] + own["error_count"],
        "wake_lag_ms": summary(got["wake_lag_ms"]),
        "follower_connections": follower_peak.figures(),
        "owner_connections": owner_peak.figures(),
        # From the follower's start to the end of both processes' calls: CPU seconds spent.
        "follow_phase": {
            "seconds": follow_s,
            **{
                f"{name}_cpu_s": after - before
                for name, before, after in zip(
                    ("follower", "owner", "server"), follow_cpu, followed_cpu, strict=True
                )
            },
        },
        "memory": memory,
        "renewals": {
            "window_s": window,
            "flights": claimed["running"],
            "evalsha_per_s": renewals.get("evalsha", 0) / window,
            "one_script_per_flight_per_s": claimed["running"] / (LEASE_S / 3),
            "server_commands_per_s": sum(renewals.values()) / window,
            "by_name_per_s": {n: v / window for n, v in renewals.items()},
            "owner_client_commands_per_s": owner_commands / window,
            "server_cpu_share": (cpu_after[0] - cpu_before[0]) / window,
            "owner_cpu_share": (cpu_after[1] - cpu_before[1]) / window,
        },
    }


async def _plain_together(
    owner: Worker, follower: Worker, run_id: str, keys: int, rounds: int
) -> dict[str, Any]:
    """The ending-together wave done with plain redis-py by the same two processes
    (``bench._scale_plain``): ``keys`` events in one instant, ``rounds`` times. The
    follower's wake-up minus the key's end, and the owner's own return minus it (ms)."""
    lags: list[float] = []
    own_lags: list[float] = []
    for r in range(rounds):
        channel = f"bench-plain:{run_id}:{r}"
        await follower.ask({"op": "plain_follow", "channel": channel, "keys": keys}, 10)
        order = {"channel": channel, "prefix": f"plain:{run_id}", "keys": keys, "delay_s": 0.3}
        done = await owner.ask({"op": "plain_own", **order}, 30)
        woken = (await follower.ask({"op": "plain_results", "timeout": 10}, 20))["woken"]
        for end, ret, wake in zip(done["ends"], done["returns"], woken, strict=True):
            own_lags.append((ret - end) * 1000)
            if wake is not None:
                lags.append((wake - end) * 1000)
    return {
        "keys": keys,
        "rounds": rounds,
        "woken": len(lags),
        "wake_lag_ms": summary(lags),
        "owner_return_lag_ms": summary(own_lags),
    }


async def _burst(
    url: str, namespace: str, run_id: str, keys: int, bound_s: float
) -> dict[str, Any]:
    """One fresh process starts ``keys`` calls at once (no waves), loaders of
    ``BURST_LOADER_S``: how many ended with the right value within ``bound_s``, and the
    leases lost and loader runs started meanwhile."""
    args = (namespace, f"{LEASE_S:g}")
    async with _orders.started(1, url, *args, module="bench._scale_worker") as (owner,):
        order = {"op": "own", "prefix": f"burst:{run_id}", "keys": keys, "wave": 0}
        claimed = await owner.ask({**order, "loader_s": BURST_LOADER_S, "timeout": 1}, 10)
        left = bound_s - claimed["claim_s"]
        got = await owner.ask({"op": "results", "timeout": left}, left + 30)
    return {
        "keys": keys,
        "loader_s": BURST_LOADER_S,
        "bound_s": bound_s,
        "right": got["right"],
        "unfinished": got["unfinished"],
        "error_count": got["error_count"],
        "errors": got["errors"],
        "lease_lost": got["stats"]["lease_lost"],
        "warnings": got["warnings"],
        "started_at": claimed["all_running_at"] - claimed["claim_s"],
        "loader_starts": got["loader_starts"],
        "loader_runs": got["loader_runs"],
        "seconds": got["seconds"],
    }


async def run_flights(
    url: str,
    *,
    keys: int = 10_000,
    loader_s: float = 20.0,
    single_rounds: int = 100,
    window_s: float = 3.0,
    wave: int = 1_000,
    spread_s: float = 10.0,
    burst_bound_s: float = 20.0,
) -> dict[str, Any]:
    """The many-keys phase three times: the loaders' ends spread over ``spread_s`` (as
    distinct LLM calls end), then over ``loader_s`` (the ends per second that ``keys``
    flights in flight sustain with loaders of ``loader_s``: the steady state), then every
    wave of ``wave`` loaders ending in the same instant (the worst case: the owner completes
    a wave at once), with its baseline (a wave of ``wave`` events done with plain redis-py
    by the same processes); then the owner burst."""
    run_id = uuid.uuid4().hex[:8]
    namespace = f"bench-scale-{run_id}"
    ctl = aioredis.Redis.from_url(url)
    args = (namespace, f"{LEASE_S:g}")
    try:
        async with _orders.started(2, url, *args, module="bench._scale_worker") as workers:
            owner, follower = workers
            single = await _single_key(ctl, owner, follower, run_id, single_rounds)
            many, steady, together = [
                await _many_keys(
                    ctl,
                    owner,
                    follower,
                    namespace=namespace,
                    run_id=run_id,
                    keys=keys,
                    loader_s=loader_s,
                    window_s=window_s,
                    wave=wave,
                    spread_s=spread,
                )
                for spread in (spread_s, loader_s, 0.0)
            ]
            plain = await _plain_together(owner, follower, run_id, wave, rounds=3)
    finally:
        await ctl.aclose()
    burst = await _burst(url, namespace, run_id, keys, burst_bound_s)
    base, first = single["wake_lag_ms"], single["first_rounds_wake_lag_ms"]
    for phase in (many, steady, together):
        phase["wake_lag_ratio"] = {q: phase["wake_lag_ms"][q] / base[q] for q in ("p50", "p99")}
        phase["wake_lag_ratio_first_rounds"] = {
            q: phase["wake_lag_ms"][q] / first[q] for q in ("p50", "p99")
        }
    plain_lag = plain["wake_lag_ms"]
    together["plain"] = plain
    together["plain_ratio"] = {q: together["wake_lag_ms"][q] / plain_lag[q] for q in ("p50", "p99")}
    return {
        "single_key": single,
        "many_keys": many,
        "many_keys_steady": steady,
        "many_keys_ending_together": together,
        "owner_burst": burst,
    }


# -- misses/s -------------------------------------------------------------------------------

Op = Callable[[str, int], Awaitable[Any]]


async def _load(i: int) -> dict[str, int]:
    return {"i": i}


async def _each_once(op: Op, prefix: str, keys: int, concurrency: int) -> dict[str, Any]:
    """``op(f"{prefix}:{i}", i)`` for every ``i`` once, ``concurrency`` at a time."""
    next_i = wrong = 0
    errors: list[str] = []

    async def one() -> None:
        nonlocal next_i, wrong
        while next_i < keys:
            i = next_i
            next_i += 1
            try:
                value = await op(f"{prefix}:{i}", i)
            except Exception as exc:  # counted, not raised: the report shows them
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            wrong += value != {"i": i}

    cpu = time.process_time()
    started = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(one() for _ in range(concurrency))), 120)
    elapsed = time.perf_counter() - started
    return {
        "keys": keys,
        "seconds": elapsed,
        "per_s": keys / elapsed,
        "cpu_us": (time.process_time() - cpu) / keys * 1e6,
        "wrong": wrong,
        "errors": errors[:5],
        "error_count": len(errors),
    }


async def _on_the_wire(
    ctl: aioredis.Redis, url: str, ops: dict[str, Op], run_id: str, keys: int, concurrency: int
) -> dict[str, dict[str, float]]:
    """Commands sent per miss (top level, connection setup left out), seen by MONITOR."""
    monitor = Monitor(url)
    out: dict[str, dict[str, float]] = {}
    try:
        await monitor.start()
        for name, op in ops.items():
            start, end = f"bench-miss-{run_id}-{name}-start", f"bench-miss-{run_id}-{name}-end"
            await ctl.echo(start)
            await _each_once(op, f"wire:{run_id}:{name}", keys, concurrency)
            await ctl.echo(end)
            lo, hi = await monitor.wait_for_marker(start), await monitor.wait_for_marker(end)
            sent = Counter(
                entry[2]
                for entry in monitor.entries[lo + 1 : hi]
                if entry[0] != "lua" and entry[2] not in SETUP_COMMANDS
            )
            out[name] = {n: v / keys for n, v in sorted(sent.items())}
    finally:
        await monitor.stop()
    return out


async def run_misses(
    url: str, *, keys: int = 5_000, rounds: int = 3, concurrency: int = 100, monitor_keys: int = 100
) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:8]
    ctl = aioredis.Redis.from_url(url)
    raw = aioredis.Redis.from_url(url)
    fc = FlightCache(url, namespace=f"bench-miss-{run_id}", near_cache=False, node_ttl=60.0)

    async def get_then_set(key: str, i: int) -> Any:
        cached = await raw.get(key)
        if cached is not None:
            return orjson.loads(cached)
        value = await _load(i)
        await raw.set(key, orjson.dumps(value), ex=TTL_S)
        return value

    def do(key: str, i: int) -> Awaitable[Any]:
        return fc.do(key, functools.partial(_load, i), ttl=TTL_S)

    ops: dict[str, Op] = {"get-set": get_then_set, "do": do}
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in ops}
    try:
        for name, op in ops.items():  # scripts loaded, connections open
            await _each_once(op, f"warm:{run_id}:{name}", 4 * concurrency, concurrency)
        for r in range(rounds):
            for name in list(ops) if r % 2 == 0 else list(ops)[::-1]:
                before, stats = await _commandstats(ctl), fc.stats
                server_cpu = await _server_cpu(ctl)
                got = await _each_once(ops[name], f"miss:{run_id}:{r}:{name}", keys, concurrency)
                got["server_cpu_us"] = (await _server_cpu(ctl) - server_cpu) / keys * 1e6
                ran = delta(before, await _commandstats(ctl))
                got["server_commands"] = ran
                got["client_commands"] = fc.stats["commands"] - stats["commands"]
                samples[name].append(got)
        wire = await _on_the_wire(ctl, url, ops, run_id, monitor_keys, concurrency)
    finally:
        await fc.aclose()
        await raw.aclose()
        await ctl.aclose()

    def variant(name: str) -> dict[str, Any]:
        runs = samples[name]
        total = sum(r["keys"] for r in runs)
        server = Counter[str]()
        for r in runs:
            server.update(r["server_commands"])
        return {
            "misses_per_s": median([r["per_s"] for r in runs]),
            "samples": [r["per_s"] for r in runs],
            "cpu_us_per_miss": median([r["cpu_us"] for r in runs]),
            "server_cpu_us_per_miss": median([r["server_cpu_us"] for r in runs]),
            "server_commands_per_miss": sum(server.values()) / total,
            "server_by_name_per_miss": {n: v / total for n, v in sorted(server.items())},
            "sent_per_miss_monitor": sum(wire[name].values()),
            "sent_by_name_per_miss_monitor": wire[name],
            "wrong": sum(r["wrong"] for r in runs),
            "errors": [e for r in runs for e in r["errors"]][:5],
            "error_count": sum(r["error_count"] for r in runs),
        }

    result = {name: variant(name) for name in ops}
    result["do"]["client_commands_per_miss"] = sum(
        r["client_commands"] for r in samples["do"]
    ) / sum(r["keys"] for r in samples["do"])
    return {
        "config": {
            "keys": keys,
            "rounds": rounds,
            "concurrency": concurrency,
            "monitor_keys": monitor_keys,
        },
        **result,
        "ratio": ratio(result["do"]["samples"], result["get-set"]["samples"]),
    }


# -- 1,000 distinct streams through two gateways --------------------------------------------


async def _pass(
    clients: list[httpx.AsyncClient],
    targets: tuple[str, str],
    prompts: list[str],
    in_flight: int,
) -> tuple[float, list[tuple[StreamResult, StreamResult]]]:
    """Every prompt asked of both targets at once, ``in_flight`` prompts at a time; each
    stream read to its end. The wall time and each prompt's two results."""
    results: dict[int, tuple[StreamResult, StreamResult]] = {}
    next_i = 0

    async def slot(k: int) -> None:
        nonlocal next_i
        while next_i < len(prompts):
            i = next_i
            next_i += 1
            body = _body(prompts[i], stream=True)
            a, b = await asyncio.gather(
                *(_stream(_pick(clients, 2 * k + j), targets[j], j, body, HEADERS) for j in (0, 1))
            )
            results[i] = (a, b)

    started = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(slot(k) for k in range(in_flight))), 300)
    return time.perf_counter() - started, [results[i] for i in range(len(prompts))]


class CPU:
    """CPU seconds spent by the mock, the two replicas, the Redis server and this process
    over one pass (``/proc/<pid>/stat``, ``INFO cpu``, ``time.process_time``)."""

    def __init__(self, ctl: aioredis.Redis, services: dict[str, Service]) -> None:
        self.ctl, self.services = ctl, services
        self.spent: dict[str, float] = {}

    async def _now(self) -> dict[str, float]:
        now = {name: _cpu_seconds(s.pid) for name, s in self.services.items()}
        return {**now, "redis": await _server_cpu(self.ctl), "client": time.process_time()}

    @contextlib.asynccontextmanager
    async def measuring(self) -> AsyncIterator[CPU]:
        before = await self._now()
        yield self
        after = await self._now()
        self.spent = {name: after[name] - before[name] for name in before}


def _served(results: list[tuple[StreamResult, StreamResult]]) -> dict[str, Any]:
    flat = [r for pair in results for r in pair]
    errors = [r.error for r in flat if r.error is not None]
    return {
        "requests": len(flat),
        "served": sum(r.error is None for r in flat),
        "errors": errors[:5],
        "error_count": len(errors),
        "x_cache": dict(sorted(Counter(r.cache for r in flat if r.cache).items())),
        "latency_ms": summary([(r.ended - r.started) * 1000 for r in flat]),
    }


async def run_streams(
    redis_url: str, *, streams: int = 1_000, in_flight: int = 100
) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:8]
    services: list[Service] = []
    client = httpx.AsyncClient(timeout=httpx.Timeout(60.0))
    clients = [
        httpx.AsyncClient(timeout=httpx.Timeout(60.0))
        for _ in range(math.ceil(2 * in_flight / CLIENT_SHARE))
    ]
    ctl = aioredis.Redis.from_url(redis_url)
    prompts = [f"scale {run_id} {i}" for i in range(streams)]
    try:
        await _start(redis_url, f"bench-gws-{run_id}", services)
        mock_service, gw_a, gw_b = services
        mock = _Mock(client, mock_service)
        await mock.control(
            latency_ms=LATENCY_MS, tokens_per_s=TOKENS_PER_S, text_tokens=TEXT_TOKENS
        )
        gateways = (gw_a.url, gw_b.url)
        # Every client's connections open, one flight through each replica, and the mock.
        for name, urls in (("gateways", gateways), ("mock", (mock.url, mock.url))):
            warm = [f"warm {run_id} {name} {k}" for k in range(in_flight)]
            await _pass(clients, urls, warm, in_flight)

        named = {"mock": mock_service, "gateway_a": gw_a, "gateway_b": gw_b}
        direct_cpu, via_cpu = CPU(ctl, named), CPU(ctl, named)
        before = await mock.calls()
        async with direct_cpu.measuring():
            direct_s, direct = await _pass(clients, (mock.url, mock.url), prompts, in_flight)
        direct_calls = await mock.calls() - before

        before = await mock.calls()
        peaks = [ConnectionPeak(ctl, gw.pid, interval=0.25) for gw in (gw_a, gw_b)]
        async with peaks[0].running(), peaks[1].running(), via_cpu.measuring():
            via_s, via = await _pass(clients, gateways, prompts, in_flight)
        via_calls = await mock.calls() - before
    finally:
        try:
            await stop_all(services)
        finally:
            for c in (client, *clients):
                await c.aclose()
            await ctl.aclose()
    texts = [a.text if a.error is None else b.text for a, b in direct]  # the upstream's
    same_pair = sum(a.text == b.text for a, b in via)
    same_as_upstream = sum(
        a.text == t and b.text == t for (a, b), t in zip(via, texts, strict=True)
    )
    return {
        "config": {
            "streams": streams,
            "in_flight": in_flight,
            "mock_latency_ms": LATENCY_MS,
            "mock_tokens_per_s": TOKENS_PER_S,
            "mock_text_tokens": TEXT_TOKENS,
        },
        "gateway": {
            **_served(via),
            "upstream_calls": via_calls,
            "seconds": via_s,
            "both_replicas_same_text": same_pair,
            "same_text_as_upstream": same_as_upstream,
            "connections": [p.figures() for p in peaks],
            "cpu_s": via_cpu.spent,
        },
        "direct": {
            **_served(direct),
            "upstream_calls": direct_calls,
            "seconds": direct_s,
            "cpu_s": direct_cpu.spent,
        },
        "wall_time_ratio": via_s / direct_s,
    }


async def run(
    url: str,
    *,
    flights: dict[str, Any] | None = None,
    misses: dict[str, Any] | None = None,
    streams: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The three parts in turn; each dict holds its runner's keyword arguments (none: its
    defaults, the full run's)."""
    return {
        **await run_flights(url, **(flights or {})),
        "misses": await run_misses(url, **(misses or {})),
        "streams": await run_streams(url, **(streams or {})),
    }
