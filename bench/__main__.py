"""``python -m bench``: stampede, hit-path, gateway, near-cache, cluster/ring, protection
(Bloom filter, refresh-ahead) and many-distinct-keys figures against a private embedded
server and cluster."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from flightcache import EmbeddedServer

from . import (
    _batch,
    _cluster,
    _gateway,
    _hitpath,
    _near,
    _protect,
    _report,
    _report_api,
    _report_cluster,
    _report_scale,
    _scale,
    _sdk,
    _stampede,
    _sync,
    _telemetry,
)
from ._util import ROOT

SECTIONS = (
    "stampede",
    "hit",
    "gateway",
    "near",
    "cluster",
    "protect",
    "scale",
    "sync",
    "sdk",
    "batch",
    "telemetry",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer rounds and ops (about 40 s)")
    p.add_argument("--json", metavar="PATH", help="also write every figure to this JSON file")
    p.add_argument("--processes", type=int, default=4, help="stampede worker processes")
    p.add_argument("--callers", type=int, default=50, help="concurrent callers per process")
    p.add_argument("--rounds", type=int, help="stampede rounds (default 5, 2 with --quick)")
    p.add_argument("--skip-stampede", action="store_true")
    p.add_argument("--skip-hit", action="store_true")
    p.add_argument("--skip-gateway", action="store_true")
    p.add_argument("--skip-near", action="store_true")
    p.add_argument(
        "--skip-cluster", action="store_true", help="skip the cluster stampede and the ring"
    )
    p.add_argument(
        "--skip-protect", action="store_true", help="skip the Bloom filter and refresh-ahead"
    )
    p.add_argument(
        "--skip-sync", action="store_true", help="skip the sync client (FlightCacheSync)"
    )
    p.add_argument(
        "--skip-sdk", action="store_true", help="skip the OpenAI / Anthropic SDK wrappers"
    )
    p.add_argument(
        "--skip-scale", action="store_true", help="skip scale across distinct keys (section 7)"
    )
    p.add_argument("--skip-batch", action="store_true", help="skip batch loading and tags")
    p.add_argument(
        "--skip-telemetry", action="store_true", help="skip telemetry's cost on the hit path"
    )
    p.add_argument(
        "--only",
        action="append",
        choices=SECTIONS,
        metavar="SECTION",
        help=f"run only this section (repeatable): {', '.join(SECTIONS)}",
    )
    args = p.parse_args(argv)
    for section in SECTIONS:  # --only skips every section it does not name
        if args.only and section not in args.only:
            setattr(args, f"skip_{section}", True)
    if args.processes < 2 or args.callers < 1:
        p.error("need at least 2 processes and 1 caller per process")
    if args.rounds is not None and not 1 <= args.rounds <= 100:
        p.error("--rounds must be between 1 and 100")
    return args


def _source() -> str:
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return f"git {head}" + (" + uncommitted changes in src/" if dirty else "")


async def _server_version(url: str) -> str:
    client = aioredis.Redis.from_url(url)
    try:
        info = await client.info("server")
    finally:
        await client.aclose()
    if "valkey_version" in info:
        return f"Valkey {info['valkey_version']}"
    return f"Redis {info.get('redis_version', '?')}"


def _clean(obj: Any) -> Any:
    """NaN is not JSON: write null instead."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so every finally block runs: workers killed, server stopped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    gateway: dict[str, Any]
    near: dict[str, Any]
    if args.quick:
        stampede_rounds, hit = 2, {"rounds": 2, "ops": 5_000, "seconds": 0.4}
        sync_hit: dict[str, Any] = {"rounds": 2, "ops": 3_000, "seconds": 0.4}
        gateway = {
            "bursts": 2,
            "ttft_rounds": 3,
            "overhead_requests": 150,
            "overhead_s": 1.0,
            "rate_rounds": 1,
            "rate_s": 0.6,
        }
        near = {
            "rounds": 2,
            "redis_budget": (5_000, 0.25),
            "near_budget": (100_000, 0.15),
            "invalidations": 30,
            "invalidation_s": 2.0,
        }
        ring: dict[str, Any] = {"keys": 50_000, "timed_keys": 20_000}
        bloom: dict[str, Any] = {"checked": 20_000}
        ahead: dict[str, Any] = {"seconds": 2.5}
        scale: dict[str, Any] = {
            "flights": {
                "keys": 1_000,
                "loader_s": 6.0,
                "spread_s": 3.0,
                "single_rounds": 10,
                "floor_rounds": 10,
                "window_s": 2.0,
                "burst_bound_s": 12.0,
            },
            "misses": {"keys": 2_000, "rounds": 2},
            "streams": {"streams": 200},
        }
    else:
        stampede_rounds, hit = 5, {"rounds": 3, "ops": 20_000, "seconds": 1.2}
        sync_hit = {}  # the defaults of _sync.run_hits
        gateway, near = {}, {}  # the defaults of _gateway.run and _near.run
        ring, bloom, ahead = {}, {}, {}  # the defaults of _cluster.run_ring and _protect
        scale = {}  # the defaults of _scale.run
    batch: dict[str, Any] = {}  # the defaults of _batch.run
    if args.quick:
        batch = {"hits": {"rounds": 3, "seconds": 0.3}, "tags": {"tagged": 2_000}}
    started = time.monotonic()
    server = EmbeddedServer()
    stampede: dict[str, Any] | None = None
    hitpath: dict[str, Any] | None = None
    gateway_figures: dict[str, Any] | None = None
    near_figures: dict[str, Any] | None = None
    cluster: dict[str, Any] | None = None
    ring_figures: dict[str, Any] | None = None
    bloom_figures: dict[str, Any] | None = None
    ahead_figures: dict[str, Any] | None = None
    sync_figures: dict[str, Any] | None = None
    sdk_figures: dict[str, Any] | None = None
    sdk: dict[str, Any] = {"callers": 20, "rounds": 1, "hit_ops": 200} if args.quick else {}
    batch_figures: dict[str, Any] | None = None
    scale_figures: dict[str, Any] | None = None
    telemetry_figures: dict[str, Any] | None = None
    telemetry: dict[str, Any] = {"rounds": 3} if args.quick else {}
    try:
        server.start()
        env = {
            "server": asyncio.run(_server_version(server.url)),
            "server_url": server.url,
            "python": platform.python_version(),
            "redis_py": redis.__version__,
            "cpus": os.cpu_count(),
            "source": _source(),
            "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        }
        _report.print_header(env)
        if not args.skip_stampede:
            stampede = asyncio.run(
                _stampede.run(
                    server.url,
                    processes=args.processes,
                    callers=args.callers,
                    rounds=args.rounds or stampede_rounds,
                )
            )
            _report.print_stampede(stampede)
        if not args.skip_hit:
            hitpath = asyncio.run(_hitpath.run(server.url, **hit))
            _report.print_hitpath(hitpath)
        if not args.skip_gateway:
            gateway_figures = asyncio.run(_gateway.run(server.url, **gateway))
            _report.print_gateway(gateway_figures)
        if not args.skip_near:
            near_figures = asyncio.run(_near.run(server.url, **near))
            _report.print_near(near_figures)
        if not args.skip_cluster:
            cluster = _cluster.run_stampede(
                processes=args.processes,
                callers=args.callers,
                rounds=args.rounds or stampede_rounds,
            )
            _report_cluster.print_cluster(cluster, stampede["wake_lag_ms"] if stampede else None)
            ring_figures = _cluster.run_ring(**ring)
            _report_cluster.print_ring(ring_figures)
        if not args.skip_protect:
            bloom_figures = asyncio.run(_protect.run_bloom(server.url, **bloom))
            ahead_figures = asyncio.run(_protect.run_refresh_ahead(server.url, **ahead))
            _report_cluster.print_protect(bloom_figures, ahead_figures)
        if not args.skip_scale:
            scale_figures = asyncio.run(_scale.run(server.url, **scale))
            _report_scale.print_scale(scale_figures)
        if not args.skip_sync:
            sync_stampede = _sync.run_stampede(
                server.url,
                processes=args.processes,
                callers=args.callers,
                rounds=args.rounds or stampede_rounds,
            )
            sync_figures = {
                "hit_path": _sync.run_hits(server.url, **sync_hit),
                "stampede": asyncio.run(sync_stampede),
            }
            _report_api.print_sync(sync_figures)
        if not args.skip_sdk:
            sdk_figures = asyncio.run(_sdk.run(server.url, processes=args.processes, **sdk))
            _report_api.print_sdk(sdk_figures)
        if not args.skip_batch:
            batch_figures = asyncio.run(_batch.run(server.url, **batch))
            _report_api.print_batch(batch_figures)
        if not args.skip_telemetry:
            telemetry_figures = asyncio.run(_telemetry.run(server.url, **telemetry))
            _telemetry.print_telemetry(telemetry_figures)
    finally:
        server.stop()
    rows = _report.targets(stampede, hitpath, gateway_figures, near_figures)
    rows += _report_cluster.scale_targets(cluster, ring_figures, bloom_figures, ahead_figures)
    rows += _report_api.sync_targets(sync_figures)
    rows += _report_api.batch_targets(batch_figures)
    rows += _report_api.sdk_targets(sdk_figures)
    rows += _report_scale.scale_key_targets(scale_figures)
    _report.print_targets(rows)
    elapsed = time.monotonic() - started
    print(f"\n(run took {elapsed:.1f} s)")
    if args.json:
        doc = {
            "env": env,
            "quick": args.quick,
            "elapsed_s": elapsed,
            "stampede": stampede,
            "hit_path": hitpath,
            "gateway": gateway_figures,
            "near_cache": near_figures,
            "cluster_stampede": cluster,
            "ring": ring_figures,
            "bloom": bloom_figures,
            "refresh_ahead": ahead_figures,
            "sync": sync_figures,
            "batch": batch_figures,
            "sdk": sdk_figures,
            "scale_distinct_keys": scale_figures,
            "telemetry": telemetry_figures,
            "targets": rows,
        }
        Path(args.json).write_text(json.dumps(_clean(doc), indent=2) + "\n")
        print(f"figures written to {args.json}")
    broken = stampede is not None and (
        any(r != 1 for r in stampede["loader_runs_per_round"]) or stampede["errors"]
    )
    if gateway_figures is not None:
        g = gateway_figures
        broken = broken or any(c != 1 for c in g["upstream_calls_per_burst"])
        broken = broken or bool(g["burst_errors"] or g["burst_mismatched"])
    if near_figures is not None:
        broken = broken or near_figures["invalidation"]["stale_reads"] > 0
    if cluster is not None:
        broken = broken or any(r != 1 for r in cluster["loader_runs_per_round"])
        broken = broken or bool(cluster["errors"])
    if ring_figures is not None:
        broken = broken or any(
            row[str(p)]["moved_between_old_shards"]
            for row in ring_figures["by_shards"]
            for p in ring_figures["config"]["points"]
        )
    if bloom_figures is not None:
        broken = broken or bloom_figures["false_negatives"] > 0
    if ahead_figures is not None:
        for mode in ("refresh_ahead", "plain"):
            m = ahead_figures[mode]
            broken = broken or bool(m["errors"]) or m["most_runs_at_once"] > 1
    if scale_figures is not None:
        broken = broken or _report_scale.scale_keys_broken(scale_figures)
    if sync_figures is not None:
        s = sync_figures["stampede"]
        broken = broken or any(r != 1 for r in s["loader_runs_per_round"]) or bool(s["errors"])
    if sdk_figures is not None:
        calls = sdk_figures["upstream_calls_per_burst"].values()
        broken = broken or any(c != 1 for v in calls for c in v) or bool(sdk_figures["errors"])
    if batch_figures is not None:
        tags = batch_figures["tags"]["invalidate_tags"]
        broken = broken or tags["stale_reads_after"] > 0
    return 1 if broken else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted: workers killed, server stopped", file=sys.stderr)
        sys.exit(130)
