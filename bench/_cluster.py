"""Phase 5: scale-out: the stampede on a Redis/Valkey Cluster, and the consistent-hash ring.

- Cluster stampede: a private ``EmbeddedCluster`` (3 masters with 1 replica each, the
  bundled server binary joined by its CLI's ``--cluster create``), started and stopped here.
  The same worker processes and orders as the stampede phase (``bench._worker``, each with
  one ``FlightCache`` on the ``redis+cluster://`` URL) start their callers at one instant on
  one fresh key per round. Loader runs per round, wake lag (owner process and remote
  follower processes) and each process's own command count (``fc.stats["commands"]``) come
  from the workers; which master held each round's flight comes from redis-py's cluster
  client (``get_node_from_key`` on the flight's meta key). No ``MONITOR`` here: it would
  need one connection per master, and the standalone phase already counts the commands.
- Ring: ``flightcache.HashRing`` over N = 3..10 shards named ``10.0.0.<i>:6379`` and
  ``keys`` random keys (seeded): keys per shard (max / mean) with the default 160 points per
  server and with 640, the exact share of the circle each shard owns (no sampling), the
  fraction of keys that move when one shard joins (ideal ``1 / (N + 1)``) and whether any
  key moved between two old shards (none may). Key placement is computed as
  ``node_at(ketama_hash(key))`` (checked equal to ``node_for(key)`` on a sample), hashing
  each key once; ``node_for`` itself is timed next to the MD5 it must do and, when
  installed, uhashring's ketama ``get_node``.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster

from flightcache import HashRing
from flightcache._backends.embedded import EmbeddedCluster
from flightcache._backends.ring import ketama_hash
from flightcache._keys import KeySpace

from . import _orders
from ._stampede import caller_figures, pooled, stampede_round
from ._util import median
from ._worker import NAMESPACE as WORKER_NAMESPACE

RING_BALANCE_TARGET = 1.10
REMAP_TARGET = 1.2  # x the ideal 1 / (N + 1)
SHARDS = range(3, 11)
POINTS = (160, 640)
NAME_SETS = 20  # other random name sets, for the exact (circle share) balance


# -- cluster stampede -----------------------------------------------------------------------


def run_stampede(
    *, processes: int, callers: int, rounds: int, loader_s: float = 0.2
) -> dict[str, Any]:
    """Start a private cluster, run the stampede rounds on it, stop it (also on Ctrl-C)."""
    cluster = EmbeddedCluster(masters=3, replicas=1)
    started = time.monotonic()
    try:
        cluster.start()
        startup_s = time.monotonic() - started
        figures = asyncio.run(
            _stampede(
                cluster.url, processes=processes, callers=callers, rounds=rounds, loader_s=loader_s
            )
        )
    finally:
        cluster.stop()
    figures["config"]["startup_s"] = startup_s
    return figures


async def _stampede(
    url: str, *, processes: int, callers: int, rounds: int, loader_s: float
) -> dict[str, Any]:
    ctl = RedisCluster.from_url(url.replace("redis+cluster://", "redis://", 1))
    keyspace = KeySpace(WORKER_NAMESPACE)
    run_id = uuid.uuid4().hex[:8]
    results: list[dict[str, Any]] = []
    try:
        await ctl.initialize()
        # CLUSTER NODES, not the client's topology: CLUSTER SLOTS (which redis-py reads) may
        # leave out replicas that have only just synced.
        nodes = await ctl.cluster_nodes()
        masters = sum("master" in n["flags"] for n in nodes.values())
        replicas = sum("slave" in n["flags"] for n in nodes.values())
        async with _orders.started(processes, url) as workers:
            for number in range(1, rounds + 1):
                key = f"cluster-stampede:{run_id}:{number}"
                node = ctl.get_node_from_key(keyspace.flight(key).meta)
                start_at, replies = await stampede_round(
                    workers, key=key, callers=callers, loader_s=loader_s
                )
                seen = caller_figures(replies, start_at)
                owner = seen["owner_pid"]
                seen["master"] = f"{node.host}:{node.port}" if node is not None else "?"
                seen["processes"] = [
                    {
                        "pid": r["pid"],
                        "role": "owner" if r["pid"] == owner else "follower",
                        "client_commands": r["stats"]["commands"],
                    }
                    for r in replies
                ]
                results.append(seen)
    finally:
        await ctl.aclose()
    followers = [
        p["client_commands"] for r in results for p in r["processes"] if p["role"] != "owner"
    ]
    owners = [p["client_commands"] for r in results for p in r["processes"] if p["role"] == "owner"]
    figures = pooled(results, processes=processes, callers=callers, loader_s=loader_s)
    return {
        **figures,
        "config": {"masters": masters, "replicas": replicas, **figures["config"]},
        "masters_used": dict(Counter(r["master"] for r in results)),
        "arrival_spread_ms": median([r["arrival_spread_ms"] for r in results]),
        "follower_process_commands": {
            "median": median(followers),
            "max": max(followers, default=0),
        },
        "owner_process_commands": {"median": median(owners), "max": max(owners, default=0)},
        "rounds": results,
    }


# -- ring -----------------------------------------------------------------------------------


def _names(n: int, pattern: str = "10.0.0.{}:6379") -> list[str]:
    return [pattern.format(i) for i in range(n)]


def _arc_balance(ring: HashRing) -> float:
    """max / mean of the shards' exact shares of the 2^32 circle (no key sampling)."""
    share: Counter[str] = Counter()
    continuum = ring.continuum
    previous = continuum[-1][0] - 2**32  # the first point owns the wrap-around arc
    for point, node in continuum:
        share[node] += point - previous
        previous = point
    return max(share.values()) / (2**32 / len(ring.nodes))


def _owners(ring: HashRing, hashes: Sequence[int]) -> list[str]:
    node_at = ring.node_at
    return [node_at(h) for h in hashes]


def _time_per_key(fn: Callable[[Any], Any], keys: Sequence[Any]) -> float:
    """Microseconds per call of ``fn`` over ``keys`` (one bounded pass)."""
    start = time.perf_counter()
    for key in keys:
        fn(key)
    return (time.perf_counter() - start) / len(keys) * 1e6


def run_ring(*, keys: int = 100_000, timed_keys: int = 50_000, rounds: int = 3) -> dict[str, Any]:
    rng = random.Random(20240605)
    key_list = [f"user:{rng.getrandbits(64):016x}" for _ in range(keys)]
    hashes = [ketama_hash(k) for k in key_list]
    # Other names an operator might give the same shards: addresses and host names.
    names_rng = random.Random(4242)
    other_patterns = [
        f"10.{names_rng.randrange(256)}.{names_rng.randrange(256)}.{{}}:6379"
        if s % 2
        else f"cache-{names_rng.getrandbits(16):04x}-{{}}.internal:6379"
        for s in range(NAME_SETS)
    ]
    by_n: list[dict[str, Any]] = []
    for n in SHARDS:
        row: dict[str, Any] = {"shards": n, "ideal_moved": 1 / (n + 1)}
        for points in POINTS:
            ring = HashRing(_names(n), points_per_server=points)
            checked = zip(key_list[:1000], hashes[:1000], strict=True)
            if any(ring.node_for(k) != ring.node_at(h) for k, h in checked):
                raise RuntimeError("HashRing.node_for disagrees with node_at(ketama_hash(key))")
            before = _owners(ring, hashes)
            counts = Counter(before)
            joining = f"10.0.0.{n}:6379"
            after = _owners(ring.with_node(joining), hashes)
            changed = [b for a, b in zip(before, after, strict=True) if a != b]
            moved = len(changed)
            between_old = sum(b != joining for b in changed)
            others = [
                _arc_balance(HashRing(_names(n, pattern), points_per_server=points))
                for pattern in other_patterns
            ]
            row[str(points)] = {
                "max_over_mean": max(counts.values()) / (keys / n),
                "min_over_mean": min(counts.values()) / (keys / n) if len(counts) == n else 0.0,
                "arc_max_over_mean": _arc_balance(ring),
                "moved": moved / keys,
                "moved_between_old_shards": between_old,
                "other_name_sets_arc_worst": max(others),
                "other_name_sets_over_target": sum(x > RING_BALANCE_TARGET for x in others),
            }
        by_n.append(row)

    # node_for per key, 10 shards, default points, alternating with its baselines
    ring = HashRing(_names(10))
    sample = key_list[:timed_keys]
    sample_hashes = hashes[:timed_keys]
    encoded = [k.encode() for k in sample]
    variants: dict[str, tuple[Callable[[Any], Any], Sequence[Any]]] = {
        "md5": (lambda b: hashlib.md5(b, usedforsecurity=False).digest(), encoded),
        "node_at": (ring.node_at, sample_hashes),
        "node_for": (ring.node_for, sample),
    }
    try:
        from uhashring import HashRing as UHashRing  # type: ignore[import-untyped]
    except ImportError:
        uhash = None
    else:
        uhash = UHashRing(nodes=_names(10), hash_fn="ketama")
        variants["uhashring"] = (uhash.get_node, sample)
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, args = variants[name]
            times[name].append(_time_per_key(fn, args))
    agree = None
    if uhash is not None:
        agree = sum(ring.node_for(k) == uhash.get_node(k) for k in sample)
    return {
        "config": {
            "keys": keys,
            "names": "10.0.0.<i>:6379",
            "points": list(POINTS),
            "other_name_sets": NAME_SETS,
            "timed_keys": timed_keys,
            "timing_rounds": rounds,
        },
        "by_shards": by_n,
        "lookup_us": {name: median(v) for name, v in times.items()},
        "uhashring_agrees": agree,
    }
