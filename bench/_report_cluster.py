"""Reporting sections 5 and 6: the stampede on a Redis Cluster, the consistent-hash ring
(keys per shard, keys moved when a shard is added, lookup cost), and the protections (the
Bloom filter's false-positive rate and throughput, refresh-ahead against a plain hot key),
each printed and judged against its targets."""

from __future__ import annotations

from typing import Any

from ._report import _row, _target, _wake_target

RING_TARGET = 1.10  # max / mean keys per shard
REMAP_TARGET = 1.2  # x the ideal 1 / (N + 1)
BLOOM_TARGET = 1.2  # x the configured error rate
RUNS_PER_TTL_TARGET = 1.25  # refresh-ahead: one run per expiry, started somewhat early


def print_cluster(c: dict[str, Any], standalone: dict[str, Any] | None) -> None:
    cfg = c["config"]
    print()
    print(
        f"5. Scale-out: stampede on a Redis Cluster ({cfg['masters']} masters + "
        f"{cfg['replicas']} replicas, embedded, started in {cfg['startup_s']:.1f} s), "
        f"{cfg['processes']} processes x {cfg['callers_per_process']} callers, loader "
        f"{cfg['loader_s'] * 1000:.0f} ms, {cfg['rounds']} rounds"
    )
    print(f"   loader runs per round: {' '.join(map(str, c['loader_runs_per_round']))}")
    if c["errors"]:
        print(f"   caller errors: {len(c['errors'])}, first: {c['errors'][0]}")
    shown = ", ".join(f"{k} {v}" for k, v in sorted(c["masters_used"].items()))
    print(
        f"   rounds' flights by master: {shown}; arrival spread median "
        f"{c['arrival_spread_ms']:.2f} ms"
    )
    print("   wake lag (ms)                                      n     p50     p99     max")
    for label, field in (
        ("owner-process callers", "owner"),
        ("remote-follower-process callers", "remote"),
        ("  first caller woken, each remote process", "remote_first"),
    ):
        print(_row(label, c["wake_lag_ms"][field]))
        if standalone is not None:
            indent = " " * (len(label) - len(label.lstrip()) + 2)
            print(_row(f"{indent}baseline: one server (section 1)", standalone[field]))
    f, o = c["follower_process_commands"], c["owner_process_commands"]
    print(
        f"   commands per process (fc.stats['commands']): remote follower median "
        f"{f['median']:g} (max {f['max']:g}), owner median {o['median']:g} (max {o['max']:g})"
    )


def print_ring(r: dict[str, Any]) -> None:
    cfg = r["config"]
    pts = cfg["points"]
    print()
    print(
        f"   ring: flightcache.HashRing (ketama), {cfg['keys']} random keys, shards named "
        f"{cfg['names']}; other name sets: {cfg['other_name_sets']} per N (exact circle share)"
    )
    p0, p1 = (str(p) for p in pts)
    print(
        "     N   keys per shard, max/mean   other name sets over 1.10    keys moved adding 1 shard"
    )
    print(
        f"          {p0:>3} points  {p1:>3} points    {p0:>3} points   {p1:>3} points"
        f"     ideal  {p0:>3} points      {p1:>3} points"
    )
    sets = cfg["other_name_sets"]
    for row in r["by_shards"]:
        a, b = row[p0], row[p1]
        ideal = row["ideal_moved"]
        others = "  ".join(
            f"{x['other_name_sets_over_target']:2d}/{sets} ({x['other_name_sets_arc_worst']:.3f})"
            for x in (a, b)
        )
        moved = "  ".join(f"{x['moved']:.4f} {x['moved'] / ideal:4.2f}x" for x in (a, b))
        print(
            f"    {row['shards']:2d}      {a['max_over_mean']:6.3f}     {b['max_over_mean']:6.3f}"
            f"   {others}    {ideal:.4f}  {moved}"
        )
    between = sum(row[str(p)]["moved_between_old_shards"] for row in r["by_shards"] for p in pts)
    print(f"     keys moved between two old shards (must be 0): {between}")
    us = r["lookup_us"]
    parts = [
        f"node_for {us['node_for']:.2f} us",
        f"of which MD5 alone {us['md5']:.2f} us and bisect (node_at) {us['node_at']:.2f} us",
    ]
    if "uhashring" in us:
        parts.append(
            f"uhashring get_node {us['uhashring']:.2f} us (same node for "
            f"{r['uhashring_agrees']}/{cfg['timed_keys']} keys)"
        )
    print(
        f"     per key, 10 shards x 160 points, {cfg['timed_keys']} keys, median of "
        f"{cfg['timing_rounds']}: " + "; ".join(parts)
    )


def print_protect(b: dict[str, Any] | None, a: dict[str, Any] | None) -> None:
    print()
    print("6. Protection: Bloom filter and refresh-ahead, on the bench's server")
    if b is not None:
        c = b["config"]
        print(
            f"   Bloom filter: capacity {c['capacity']}, error_rate {c['error_rate']:g} "
            f"({c['bits']} bits, {c['hashes']} hashes), {c['keys_added']} keys added in "
            f"batches of {c['batch']}"
        )
        print(
            f"     false-positive rate on {c['keys_probed']} keys never added: "
            f"{b['false_positive_rate']:.5f} ({b['false_positive_rate'] / c['error_rate']:.2f} x "
            f"error_rate; the formula for {c['keys_added']} adds: {b['expected_rate']:.5f})"
        )
        print(
            f"     false negatives among {c['keys_read_back']} added keys read back: "
            f"{b['false_negatives']}; add_many reported {b['added_as_new']} of "
            f"{c['keys_added']} as new"
        )
        print("     throughput                                keys    keys/s  CPU us/key")
        for name, t in b["throughput"].items():
            print(
                f"       {name:<38} {t['keys']:6d} {t['keys_per_s']:9.0f}  "
                f"{t['cpu_us_per_key']:9.2f}"
            )
    if a is not None:
        c = a["config"]
        print(
            f"   refresh-ahead: one hot key, ttl {c['ttl_s']:g} s, loader "
            f"{c['loader_s'] * 1000:.0f} ms, {c['nodes']} FlightCache nodes x "
            f"{c['coroutines_per_node']} coroutines (do, then {c['pause_s'] * 1000:g} ms "
            f"pause), {c['seconds']:g} s each way"
        )
        print(
            f"     {'':<22} {'calls':>7} {'waited':>7} {'loader':>7} {'runs/TTL':>9}"
            f" {'at once':>8} {'interval p50':>13} {'call p99 ms':>12} {'max ms':>8}"
        )
        for name, label in (
            ("refresh_ahead", "refresh_ahead=True"),
            ("plain", "without (baseline)"),
        ):
            m = a[name]
            print(
                f"     {label:<22} {m['calls']:7d} {m['waited']:7d} {m['loader_runs']:7d}"
                f" {m['runs_per_ttl']:9.2f} {m['most_runs_at_once']:8d}"
                f" {m['run_interval_ms']['p50']:10.0f} ms {m['latency_ms']['p99']:12.3f}"
                f" {m['latency_ms']['max']:8.1f}"
            )
            if m["errors"]:
                print(f"       errors: {len(m['errors'])}, first: {m['errors'][0]}")
        print(
            f"     waited: calls that took >= {c['waited_threshold_ms']:g} ms (half the loader); "
            f"refreshes started (fc.stats['refreshes_ahead']): "
            f"{a['refresh_ahead']['refreshes_ahead']}"
        )


def scale_targets(
    c: dict[str, Any] | None,
    r: dict[str, Any] | None,
    b: dict[str, Any] | None,
    a: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    """Targets of sections 5 and 6 (cluster, ring, Bloom filter, refresh-ahead)."""
    out: list[dict[str, Any]] = []
    if c is not None:
        runs = c["loader_runs_per_round"]
        out.append(
            _target(
                "cluster: loader runs exactly once per stampede",
                f"{sum(x == 1 for x in runs)}/{len(runs)} rounds, {len(c['errors'])} caller errors",
                max(runs),
                all(x == 1 for x in runs) and not c["errors"],
            )
        )
        out.append(_wake_target("cluster: ", c["wake_lag_ms"]))
    if r is not None:
        sets = r["config"]["other_name_sets"]
        for points in r["config"]["points"]:
            rows = [(row["shards"], row[str(points)]) for row in r["by_shards"]]
            n_worst, worst = max(rows, key=lambda x: x[1]["max_over_mean"])
            over = sum(x["other_name_sets_over_target"] for _, x in rows)
            other_worst = max(x["other_name_sets_arc_worst"] for _, x in rows)
            label = " (default)" if points == 160 else ""
            out.append(
                _target(
                    f"ring max/mean <= {RING_TARGET:.2f}, {points} points{label}",
                    f"{r['config']['names']}: worst {worst['max_over_mean']:.3f} (N={n_worst});"
                    f" other names: {over}/{sets * len(rows)} over (worst {other_worst:.3f})",
                    max(worst["max_over_mean"], other_worst),
                    worst["max_over_mean"] <= RING_TARGET and over == 0,
                )
            )
        ratios = [
            (row["shards"], row["160"]["moved"] * (row["shards"] + 1)) for row in r["by_shards"]
        ]
        n_worst, worst_ratio = max(ratios, key=lambda x: x[1])
        between = sum(row["160"]["moved_between_old_shards"] for row in r["by_shards"])
        out.append(
            _target(
                f"adding a shard moves <= {REMAP_TARGET:g}/(N+1) of keys",
                f"worst {worst_ratio:.2f} x 1/(N+1) (N={n_worst}, 160 points); "
                f"{between} moved between old shards",
                worst_ratio,
                worst_ratio <= REMAP_TARGET and between == 0,
            )
        )
    if b is not None:
        rate, target = b["false_positive_rate"], b["config"]["error_rate"]
        out.append(
            _target(
                f"Bloom FP rate <= {BLOOM_TARGET:g} x {target:g} at capacity",
                f"{rate:.5f} ({rate / target:.2f} x; formula "
                f"{b['expected_rate']:.5f}); {b['false_negatives']} false negatives",
                rate,
                rate <= BLOOM_TARGET * target and b["false_negatives"] == 0,
            )
        )
    if a is not None:
        on, off = a["refresh_ahead"], a["plain"]
        out.append(
            _target(
                "refresh-ahead: 0 calls wait for the loader",
                f"{on['waited']} of {on['calls']} calls "
                f"(without refresh-ahead: {off['waited']} of {off['calls']})",
                on["waited"],
                on["waited"] == 0 and not on["errors"],
            )
        )
        out.append(
            _target(
                f"refresh-ahead: <= {RUNS_PER_TTL_TARGET:g} loader runs per TTL",
                f"{on['runs_per_ttl']:.2f} runs per TTL period, every "
                f"{on['run_interval_ms']['p50']:.0f} ms (without: {off['runs_per_ttl']:.2f}); "
                f"at most {on['most_runs_at_once']} at once",
                on["runs_per_ttl"],
                on["runs_per_ttl"] <= RUNS_PER_TTL_TARGET and on["most_runs_at_once"] <= 1,
            )
        )
    return out
