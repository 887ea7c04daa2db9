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
  Each spread has its floor measured right after it: ``floor_rounds`` single events and
  ``keys`` events over the same spread done with plain redis-py (``SET`` + ``PUBLISH``, one
  pub/sub reader) by the same processes; the ratio of those two is what the machine alone
  does to the tail at that rate.
- Renewals: a phase of its own, the owner's ``keys`` loaders all running and nothing else
  happening, ``INFO commandstats`` over ``window_s`` (16 s: a whole cycle of a bound flight's
  own renewals, every half of the 30 s backstop, and sixteen session ticks): the owner's
  ``EVALSHA`` calls a second, next to one renewal script per flight per lease/3.
- Memory: once the follower has joined every flight (its ``follows`` counter), ``MEMORY
  USAGE`` (``SAMPLES 0``) of each flight's meta, stream and waiters keys, per flight; and
  ``INFO memory`` ``used_memory`` growth since before the flights, per flight.

The misses (``_scale_misses.py``) and the streams through two gateways
(``_scale_streams.py``) are parts of the same phase.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections import Counter
from typing import Any

import redis.asyncio as aioredis

from flightcache._keys import KeySpace

from . import _orders
from ._orders import Worker
from ._probes import (
    ConnectionPeak,
    _commandstats,
    _cpu_seconds,
    _server_cpu,
    local_server_pid,
    runqueue_wait_s,
)
from ._scale_misses import run_misses
from ._scale_streams import run_streams
from ._util import delta, summary

LEASE_S = 3.0
SINGLE_LOADER_S = 0.3  # the single-key baseline's loader
# The baseline's p99 is taken over 300 rounds. Of 100 (the count before), the interpolated p99
# is the second slowest round: in two runs of 300 rounds (the baseline alone), the p99 of each
# hundred ranged from 1.64 to 2.34 ms, that of all 300 was 2.03 and 2.09 ms. The first 100
# rounds' figures are kept next to it, to compare with runs that had 100.
FIRST_ROUNDS = 100
_PHASES = itertools.count()  # each many-keys phase its own keys
BURST_LOADER_S = 5.0  # the owner burst's loader
MEMORY_KEYS = ("meta", "stream", "waiters")


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
    await asyncio.sleep(0.2)

    follower_peak = ConnectionPeak(ctl, follower.pid)
    owner_peak = ConnectionPeak(ctl, owner.pid, interval=0.5)
    pids = (follower.pid, owner.pid, await local_server_pid(ctl))
    follow_cpu = (_cpu_seconds(follower.pid), _cpu_seconds(owner.pid), await _server_cpu(ctl))
    waits = [runqueue_wait_s(pid) for pid in pids]
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
    waits = [runqueue_wait_s(pid) - before for pid, before in zip(pids, waits, strict=True)]
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
            # ready to run, no CPU free: the machine's share of the lag (NaN off Linux)
            **{
                f"{name}_runqueue_wait_s": wait
                for name, wait in zip(("follower", "owner", "server"), waits, strict=True)
            },
        },
        "memory": memory,
    }


async def _renewals(
    ctl: aioredis.Redis, owner: Worker, run_id: str, keys: int, window_s: float
) -> dict[str, Any]:
    """The owner's renewals alone: ``keys`` flights owned and nothing else running, over
    ``window_s`` from 0.2 s after the last claim (the loaders outlast it: the claims take a
    few seconds, and a completion in the window would count as a renewal)."""
    order = {
        "op": "own",
        "prefix": f"renew:{run_id}",
        "keys": keys,
        "loader_s": window_s + 10.0,
        "spread_s": 0.0,
        "wave": 1_000,
    }
    bound_before = (await owner.ask({"op": "progress"}, 10))["bound_late"]
    claimed = await owner.ask({**order, "timeout": window_s / 2}, window_s)
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
    own = await owner.ask({"op": "results", "timeout": 60}, 70)
    return {
        "window_s": window,
        "flights": claimed["running"],
        "keys": keys,
        "right": own["right"],
        "lease_lost": stats_after["stats"]["lease_lost"] - stats_before["stats"]["lease_lost"],
        # claimed before the owner's session was up, bound by a renewal since
        "bound_late": stats_after["bound_late"] - bound_before,
        "evalsha_per_s": renewals.get("evalsha", 0) / window,
        "one_script_per_flight_per_s": claimed["running"] / (LEASE_S / 3),
        "server_commands_per_s": sum(renewals.values()) / window,
        "by_name_per_s": {n: v / window for n, v in renewals.items()},
        "owner_client_commands_per_s": owner_commands / window,
        "server_cpu_share": (cpu_after[0] - cpu_before[0]) / window,
        "owner_cpu_share": (cpu_after[1] - cpu_before[1]) / window,
    }


async def _plain(
    owner: Worker,
    follower: Worker,
    channel: str,
    keys: int,
    rounds: int,
    spread_s: float = 0.0,
    delay_s: float = 0.3,
) -> dict[str, Any]:
    """``keys`` events done with plain redis-py by the same two processes
    (``bench._scale_plain``), ending in one instant or spread over ``spread_s``, ``rounds``
    times. The follower's wake-up minus the key's end, and the owner's own return minus it
    (ms)."""
    lags: list[float] = []
    own_lags: list[float] = []
    for r in range(rounds):
        await follower.ask({"op": "plain_follow", "channel": f"{channel}:{r}", "keys": keys}, 10)
        order = {
            "channel": f"{channel}:{r}",
            "prefix": channel,
            "keys": keys,
            "delay_s": delay_s,
            "spread_s": spread_s,
        }
        done = await owner.ask({"op": "plain_own", **order}, 30 + spread_s)
        woken = (await follower.ask({"op": "plain_results", "timeout": 10}, 20))["woken"]
        for end, ret, wake in zip(done["ends"], done["returns"], woken, strict=True):
            own_lags.append((ret - end) * 1000)
            if wake is not None:
                lags.append((wake - end) * 1000)
    return {
        "keys": keys,
        "rounds": rounds,
        "spread_s": spread_s,
        "woken": len(lags),
        "wake_lag_ms": summary(lags),
        "owner_return_lag_ms": summary(own_lags),
    }


async def _plain_spread(
    owner: Worker, follower: Worker, run_id: str, keys: int, spread_s: float, rounds: int
) -> dict[str, Any]:
    """The floor of a spread phase: ``rounds`` single events, then ``keys`` events spread
    over ``spread_s``, both with plain redis-py in the same processes, next to each other:
    how far the machine alone (three processes busy on its cores) takes the spread's wake
    lag from one event's."""
    tag = f"bench-plain:{run_id}:{spread_s:g}"
    one = await _plain(owner, follower, f"{tag}:one", 1, rounds, delay_s=0.05)
    spread = await _plain(owner, follower, f"{tag}:many", keys, 1, spread_s, delay_s=1.0)
    lag, one_lag = spread["wake_lag_ms"], one["wake_lag_ms"]
    return {
        "one": one,
        "spread": spread,
        "ratio": {q: lag[q] / one_lag[q] for q in ("p50", "p99")},
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
    single_rounds: int = 300,
    floor_rounds: int = 100,
    window_s: float = 16.0,
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
            phases = []
            for spread in (spread_s, loader_s, 0.0):
                phase = await _many_keys(
                    ctl,
                    owner,
                    follower,
                    namespace=namespace,
                    run_id=run_id,
                    keys=keys,
                    loader_s=loader_s,
                    wave=wave,
                    spread_s=spread,
                )
                if spread:  # its floor, right after it
                    phase["floor"] = await _plain_spread(
                        owner, follower, run_id, keys, spread, floor_rounds
                    )
                phases.append(phase)
            many, steady, together = phases
            plain = await _plain(owner, follower, f"bench-plain:{run_id}", wave, rounds=3)
            renewals = await _renewals(ctl, owner, run_id, keys, window_s)
    finally:
        await ctl.aclose()
    burst = await _burst(url, namespace, run_id, keys, burst_bound_s)
    base, first = single["wake_lag_ms"], single["first_rounds_wake_lag_ms"]
    for phase in (many, steady, together):
        phase["wake_lag_ratio"] = {q: phase["wake_lag_ms"][q] / base[q] for q in ("p50", "p99")}
        if "floor" in phase:  # (the spread phases) x plain redis-py's same spread
            floor = phase["floor"]["spread"]["wake_lag_ms"]
            phase["floor_ratio"] = {q: phase["wake_lag_ms"][q] / floor[q] for q in ("p50", "p99")}
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
        "renewals": renewals,
        "owner_burst": burst,
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
