"""Printing the figures and judging them against the project's targets."""

from __future__ import annotations

from collections import Counter
from typing import Any

from . import _near, _sync
from ._hitpath import LABELS, VARIANTS
from ._util import median

HIT_RATIO_TARGET = 0.8
WAKE_P99_TARGET_MS = 5.0
FOLLOWER_COMMANDS_TARGET = 4
TTFT_P99_TARGET_MS = 5.0
NEAR_RATIO_TARGET = 50.0
RING_TARGET = 1.10  # max / mean keys per shard
REMAP_TARGET = 1.2  # x the ideal 1 / (N + 1)
BLOOM_TARGET = 1.2  # x the configured error rate
RUNS_PER_TTL_TARGET = 1.25  # refresh-ahead: one run per expiry, started somewhat early
WAKE_RATIO_TARGET = 2.0  # many keys' wake lag / one key's, p50 and p99
# A wave of 1,000 ending at once: its wake lag / the same wave's with plain redis-py.
TOGETHER_PLAIN_TARGET = 1.5
MISS_RATIO_TARGET = 0.8  # fc.do misses/s / GET-then-SET misses/s
FLIGHT_BYTES_TARGET = 1024  # server memory per in-flight key
STREAM_WALL_TARGET = 1.3  # 1,000 streams via two gateways / the same clients direct


def _ms(x: float) -> str:
    return f"{x:7.2f}"


def print_header(env: dict[str, Any]) -> None:
    print(
        f"flightcache bench: {env['server']} on {env['server_url']} (embedded, loopback), "
        f"Python {env['python']}, redis-py {env['redis_py']}, {env['cpus']} CPUs"
    )
    print(f"source: {env['source']}; load average at start: {env['loadavg']}")


def print_stampede(s: dict[str, Any]) -> None:
    c = s["config"]
    print()
    print(
        f"1. Stampede: {c['processes']} processes x {c['callers_per_process']} callers on one "
        f"fresh key, loader sleeps {c['loader_s'] * 1000:.0f} ms, {c['rounds']} rounds"
    )
    print(f"   loader runs per round: {' '.join(map(str, s['loader_runs_per_round']))}")
    if s["errors"]:
        print(f"   caller errors: {len(s['errors'])}, first: {s['errors'][0]}")
    a = s["arrival_spread_ms"]
    print(
        f"   arrival spread of all callers (first to last start), per round: "
        f"median {a['p50']:.2f} ms, max {a['max']:.2f} ms"
    )
    print("   wake lag = caller's return - loader's end (ms)      n     p50     p99     max")
    rows = (
        ("owner-process callers", "owner"),
        ("remote-follower-process callers", "remote"),
        ("  first caller woken, owner process", "owner_first"),
        ("  first caller woken, each remote process", "remote_first"),
    )
    for label, field in rows:
        w = s["wake_lag_ms"][field]
        print(f"     {label:<44} {w['n']:5d} {_ms(w['p50'])} {_ms(w['p99'])} {_ms(w['max'])}")
    m = s["commands"]
    callers = c["processes"] * c["callers_per_process"]
    print("   Redis commands (medians over rounds)")
    print(
        f"     per caller, sent by clients (server MONITOR): {m['server_top_level_per_caller']:.3f}"
        f"  ({m['server_top_level_per_round']:g} per round of {callers} callers;"
        f" connection setup {m['server_top_level_setup_per_round']:g})"
    )
    print(
        f"     per caller, all run by the server incl. inside Lua (INFO commandstats): "
        f"{m['server_all_per_caller']:.3f}  ({m['server_all_per_round']:g} per round)"
    )
    for label, field in (
        ("per remote follower process", "follower_process"),
        ("per owner process", "owner_process"),
    ):
        cl, sv = m[f"{field}_client"], m[f"{field}_server"]
        print(
            f"     {label:<28} fc.stats['commands'] median {cl['median']:g} "
            f"(min {cl['min']:g}, max {cl['max']:g}); server-attributed median {sv['median']:g} "
            f"(max {sv['max']:g})"
        )
    top = ", ".join(f"{n} {v:g}" for n, v in m["top_level_by_name"].items())
    lua = ", ".join(f"{n} {v:g}" for n, v in m["in_lua_by_name"].items())
    print(f"     sent by clients, per round: {top}")
    print(f"     run inside Lua, per round:  {lua}")


def print_hitpath(h: dict[str, Any]) -> None:
    c = h["config"]
    print()
    print(
        f"2. Hit path: cached {c['value_bytes']}-byte value, {c['rounds']} alternating rounds, "
        f"each measurement up to {c['ops_per_measurement']} ops "
        f"or {c['seconds_per_measurement']:g} s"
    )
    for mode, title in (
        ("sequential", "sequential, one coroutine"),
        ("concurrent", f"concurrent, {c['concurrency']} coroutines on {c['concurrency']} keys"),
    ):
        print(f"   {title:<44} ops/s median     best  x raw GET  CPU us/op")
        for name in VARIANTS:
            r = h[mode][name]
            print(
                f"     {LABELS[name]:<42} {r['ops_per_s']:9.0f} {r['best_ops_per_s']:8.0f}"
                f"  {r['ratio_to_raw']:9.2f}  {r['cpu_us_per_op']:9.1f}"
            )


def _row(label: str, s: dict[str, float], unit: str = "") -> str:
    return f"     {label:<44} {s['n']:5d} {_ms(s['p50'])} {_ms(s['p99'])} {_ms(s['max'])}{unit}"


def print_gateway(g: dict[str, Any]) -> None:
    c = g["config"]
    print()
    print(
        "3. Gateway: 2 `flightcache serve` processes on the bench's server, one "
        "`flightcache mock-upstream`, httpx clients"
    )
    print(
        f"   mock upstream: first token after {c['mock_latency_ms']:g} ms, then "
        f"{c['mock_tokens_per_s']:g} tokens/s, {c['mock_text_tokens']} tokens"
    )
    calls = " ".join(map(str, g["upstream_calls_per_burst"]))
    bp = g["bypass_burst"]
    print(
        f"   upstream calls per burst of {c['burst_size']} identical stream requests "
        f"(half to each gateway): {calls}"
    )
    print(
        f"     baseline, the same burst with X-Flightcache-Coalesce: off: "
        f"{bp['upstream_calls']} upstream calls"
    )
    caches = Counter[str]()
    for b in g["bursts"]:
        caches.update(b["x_cache"])
    shown = ", ".join(f"{k} {v}" for k, v in sorted(caches.items()))
    print(
        f"     X-Cache over {len(g['bursts'])} bursts: {shown}; client errors "
        f"{g['burst_errors']}, bursts with differing texts {g['burst_mismatched']}; "
        f"burst wall time median {median([b['seconds'] for b in g['bursts']]) * 1000:.0f} ms"
    )
    t = g["ttft"]
    print(
        f"   time to first token, {c['ttft_rounds']} rounds of {c['per_gateway']} identical "
        f"stream requests to each gateway at once (ms)        n     p50     p99     max"
    )
    print(_row("owner (X-Cache: MISS) TTFT", t["owner_ttft_ms"]))
    d = t["follower_minus_owner_ms"]
    print(_row("follower TTFT - owner TTFT, all followers", d["all"]))
    print(_row("  local (owner's gateway)", d["local"]))
    print(_row("  remote (the other gateway)", d["remote"]))
    gap = t["first_token_gap_ms"]
    print(_row("follower's first token - owner's, local", gap["local"]))
    print(_row("follower's first token - owner's, remote", gap["remote"]))
    worst = " ".join(f"{x:.1f}" for x in t["worst_follower_minus_owner_ms_per_round"])
    print(f"     largest follower TTFT - owner TTFT, per round (ms): {worst}")
    shown = ", ".join(f"{k} {v}" for k, v in t["x_cache"].items())
    print(
        f"     X-Cache: {shown}; upstream calls per round: "
        f"{' '.join(map(str, t['upstream_calls_per_round']))}"
    )
    if t["errors"]:
        print(f"     errors: {t['errors']}")
    o = g["overhead"]
    print(
        f"   overhead of a hit, mock latency 0, sequential non-stream requests, "
        f"{o['requests_each']} each (ms)       p50     p99"
    )
    dm, gm = o["direct_ms"], o["gateway_hit_ms"]
    print(f"     {'mock upstream directly':<44}       {_ms(dm['p50'])} {_ms(dm['p99'])}")
    print(f"     {'gateway, X-Cache: HIT':<44}       {_ms(gm['p50'])} {_ms(gm['p99'])}")
    print(f"     {'difference':<44}       {_ms(o['overhead_p50_ms'])} {_ms(o['overhead_p99_ms'])}")
    if o["not_hit"] or o["errors"]:
        print(f"     not HIT: {o['not_hit']}, errors: {o['errors']}")
    r = g["hit_rate"]
    print(
        f"   requests/s on cached hits, {c['concurrency']} concurrent clients, one gateway, "
        f"{c['rate_rounds']} x {c['rate_s']:g} s"
    )
    cpu = r["cpu_us_per_request"]
    print(
        f"     gateway (HIT) {r['gateway_rps']:7.0f} req/s; the mock upstream directly "
        f"{r['direct_rps']:7.0f} req/s; ratio {r['ratio_to_direct']:.2f}"
    )
    for name, label in (("gateway", "gateway (HIT)"), ("direct", "mock directly")):
        print(
            f"     CPU per request, {label:<14} server {cpu[name]['server']:6.0f} us, "
            f"Redis {cpu[name]['redis']:5.0f} us, this client (httpx) "
            f"{cpu[name]['client']:5.0f} us"
        )
    if r["errors"] or r["not_hit"]:
        print(f"     errors: {r['errors']}, not HIT: {r['not_hit']}")


def print_near(n: dict[str, Any]) -> None:
    h, inv, mem = n["hits"], n["invalidation"], n["memory"]
    c = h["config"]
    print()
    print(
        f"4. Near cache: cached {c['value_bytes']}-byte value, lease {c['near_lease_s']:g} s, "
        f"{c['rounds']} alternating rounds, each measurement up to "
        f"{c['redis_ops_per_measurement']} ops or {c['redis_seconds_per_measurement']:g} s "
        f"(near cache: {c['near_ops_per_measurement']} or "
        f"{c['near_seconds_per_measurement']:g} s)"
    )
    for mode, title in (
        ("sequential", "sequential, one coroutine"),
        ("concurrent", f"concurrent, {c['concurrency']} coroutines on {c['concurrency']} keys"),
    ):
        print(f"   {title:<44} ops/s median  x raw GET  x Redis-served  CPU us/op")
        for name in _near.VARIANTS:
            r = h[mode][name]
            redis_served = r["ratio_to_redis_served"]
            shown = f"{redis_served:14.1f}" if redis_served == redis_served else " " * 14
            print(
                f"     {_near.LABELS[name]:<42} {r['ops_per_s']:9.0f}  {r['ratio_to_raw']:9.2f}"
                f"  {shown}  {r['cpu_us_per_op']:9.2f}"
            )
    print(
        f"     near-cache hit ratio while measured: {h['near_hit_ratio']:.5f} "
        f"({h['near_misses']} reads went to the server as leases ran out)"
    )
    ic = inv["config"]
    print(
        f"   invalidation, {ic['nodes']} worker nodes holding the key + the writer "
        f"({inv['live_nodes_seen']} live nodes seen), {ic['rounds']} rounds; fallback bound "
        f"lease + skew = {ic['lease_bound_s']:g} s"
    )
    print("     latency of the call (ms)                        n     p50     p99     max")
    lat = inv["latency_ms"]
    print(_row("fc.invalidate(key), 4 nodes hold it", lat["invalidate"]))
    print(_row("fc.set(key, new), 4 nodes hold the old value", lat["set"]))
    print(_row("baseline: fc.invalidate, no other node", lat["alone"]))
    hows = "; ".join(
        f"{name} " + ", ".join(f"{k} {v}" for k, v in sorted(inv["how"][name].items()))
        for name in ("invalidate", "set", "alone")
    )
    print(f"     finished by: {hows}")
    holders = inv["holders_before"]
    print(
        f"     nodes holding the key before the call: median {holders['invalidate']['p50']:g} "
        f"(invalidate), {holders['set']['p50']:g} (set); nodes waited for: "
        f"{inv['nodes_waited_for']['invalidate']}"
    )
    print(
        f"     stale reads after the call returned: {inv['stale_reads']} of {inv['probes']} "
        f"probes; reads served from a near cache right after: "
        f"{inv['near_served_after_return']}"
    )
    parts = mem["parts"]
    rest = mem["bytes_per_entry"] - sum(parts.values())
    shown = ", ".join(f"{k} {v}" for k, v in parts.items())
    print(
        f"   memory per near-cache entry ({mem['entries']} entries read through fc.get, "
        f"{mem['value_bytes']:.0f}-byte encoded values): {mem['bytes_per_entry']:.0f} bytes "
        f"(tracemalloc)"
    )
    print(f"     {shown}, the ordered dict's share {rest:.0f}")
    print(
        f"     near_max_bytes counts {mem['accounted_bytes_per_entry']:.0f} bytes of it "
        f"(the encoded value)"
    )


def _target(target: str, measured: str, value: Any, passed: bool) -> dict[str, Any]:
    return {"target": target, "measured": measured, "value": value, "pass": passed}


def _ratio_target(
    target: str, result: dict[str, Any], names: tuple[str, str], goal: float, digits: int
) -> dict[str, Any]:
    """The worst ``ratio_to_raw`` of two variants (``get``/``do``), sequential and concurrent."""
    ratios = {
        f"{name.removesuffix('-near')} {mode[:3]}": result[mode][name]["ratio_to_raw"]
        for mode in ("sequential", "concurrent")
        for name in names
    }
    worst = min(ratios.values())
    measured = ", ".join(f"{k} {v:.{digits}f}" for k, v in ratios.items())
    return _target(target, measured, worst, worst >= goal)


def _worst_p99(lag: dict[str, Any]) -> float:
    """The larger wake-lag p99 of owner-process and remote-follower callers."""
    return float(max(lag["owner"]["p99"], lag["remote"]["p99"]))


def _wake_target(prefix: str, lag: dict[str, Any]) -> dict[str, Any]:
    """The larger wake-lag p99 of owner-process and remote-follower callers."""
    p99 = _worst_p99(lag)
    return _target(
        f"{prefix}wake lag p99 <= {WAKE_P99_TARGET_MS:g} ms (loopback)",
        f"owner {lag['owner']['p99']:.2f} ms, remote {lag['remote']['p99']:.2f} ms",
        p99,
        p99 <= WAKE_P99_TARGET_MS,
    )


def targets(
    s: dict[str, Any] | None,
    h: dict[str, Any] | None,
    g: dict[str, Any] | None = None,
    n: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if h is not None:
        target = f"hit path >= {HIT_RATIO_TARGET} x raw GET"
        out.append(_ratio_target(target, h, ("get", "do"), HIT_RATIO_TARGET, 2))
    if s is not None:
        out.append(_wake_target("", s["wake_lag_ms"]))
        m = s["commands"]
        cl, sv = m["follower_process_client"], m["follower_process_server"]
        worst_cmds = max(cl["max"], sv["max"])
        out.append(
            _target(
                f"<= {FOLLOWER_COMMANDS_TARGET} Redis commands per remote follower",
                f"median {cl['median']:g}, max {worst_cmds:g} (every follower process)",
                worst_cmds,
                worst_cmds <= FOLLOWER_COMMANDS_TARGET,
            )
        )
        runs = s["loader_runs_per_round"]
        out.append(
            _target(
                "loader runs exactly once per stampede",
                f"{sum(r == 1 for r in runs)}/{len(runs)} rounds",
                max(runs),
                all(r == 1 for r in runs) and not s["errors"],
            )
        )
    if g is not None:
        calls = g["upstream_calls_per_burst"]
        size = g["config"]["burst_size"]
        out.append(
            _target(
                f"1 upstream call per burst of {size} (2 gateways)",
                f"{sum(c == 1 for c in calls)}/{len(calls)} bursts, "
                f"{g['burst_errors']} client errors "
                f"(without coalescing: {g['bypass_burst']['upstream_calls']})",
                max(calls),
                all(c == 1 for c in calls) and not g["burst_errors"] and not g["burst_mismatched"],
            )
        )
        d = g["ttft"]["follower_minus_owner_ms"]
        out.append(
            _target(
                f"follower TTFT - owner's p99 <= {TTFT_P99_TARGET_MS:g} ms",
                f"p50 {d['all']['p50']:.2f}, p99 {d['all']['p99']:.2f} ms "
                f"(local {d['local']['p99']:.2f}, remote {d['remote']['p99']:.2f})",
                d["all"]["p99"],
                d["all"]["p99"] <= TTFT_P99_TARGET_MS,
            )
        )
    if n is not None:
        goal = NEAR_RATIO_TARGET
        names = ("get-near", "do-near")
        out.append(
            _ratio_target(f"near-cache hits >= {goal:g} x raw GET", n["hits"], names, goal, 1)
        )
        inv = n["invalidation"]
        calls = sum(inv["how"]["invalidate"].values()) + sum(inv["how"]["set"].values())
        acked = inv["how"]["invalidate"].get("acked", 0) + inv["how"]["set"].get("acked", 0)
        p99 = inv["latency_ms"]["invalidate"]["p99"]
        out.append(
            _target(
                f"invalidate/set acked by {inv['config']['nodes']} live nodes",
                f"{acked}/{calls} acked; invalidate p99 {p99:.2f} ms "
                f"(lease bound {inv['config']['lease_bound_s'] * 1000:.0f} ms)",
                acked,
                calls > 0 and acked == calls,
            )
        )
        out.append(
            _target(
                "no stale read after invalidate/set returns",
                f"{inv['stale_reads']} stale of {inv['probes']} probes",
                inv["stale_reads"],
                inv["stale_reads"] == 0,
            )
        )
    return out


def print_targets(rows: list[dict[str, Any]]) -> None:
    print()
    print("8. Targets")
    for row in rows:
        verdict = "PASS" if row["pass"] else "MISS"
        print(f"   {verdict}  {row['target']:<47} {row['measured']}")


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


def _counts(by_name: dict[str, float], digits: int = 2) -> str:
    """``name value, ...`` with ``digits`` decimals, trailing zeros dropped."""

    def number(v: float) -> str:
        text = f"{v:.{digits}f}"
        return text.rstrip("0").rstrip(".") if "." in text else text

    return ", ".join(f"{n} {number(v)}" for n, v in by_name.items())


def _warnings(whose: str, rows: list[dict[str, Any]], since: float, event: str) -> None:
    """A worker's library warnings by shape (bench/_scale_worker.py counts, not prints)."""
    for row in rows[:3]:
        print(
            f"     {whose} log: {row['count']} x {row['message'][:90]!r}, first "
            f"{row['first'] - since:+.1f} s after {event}"
        )


def print_scale(k: dict[str, Any]) -> None:
    one, m, burst = k["single_key"], k["many_keys"], k["owner_burst"]
    f, o = m["follower"], m["owner"]
    print()
    print(
        f"7. Scale across distinct keys: worker processes on the bench's server "
        f"(near_cache=False, lease {m['lease_s']:g} s)"
    )
    print(
        f"   {m['keys']} keys owned by one process (started {m['wave']} at a time: all "
        f"{m['running_at_once']} loaders running after {m['claim_s']:.1f} s), loader "
        f"{m['loader_s']:g} s, their ends spread over {m['spread_s']:g} s more, followed by "
        f"another process (joined all in {m['join_s']:.1f} s; all in flight at once: "
        f"{'yes' if m['all_in_flight_at_once'] else 'NO'})"
    )
    print(
        f"     right values {m['right']}/{m['keys']}, errors {m['error_count']}, unfinished "
        f"{m['unfinished']}; follower loader runs {f['loader_runs']}; owner leases lost "
        f"{o['stats']['lease_lost']}, loader runs {o['loader_runs']}"
    )
    if m["errors"]:
        print(f"     first error: {m['errors'][0]}")
    fc, bc = m["follower_connections"], one["follower_connections"]
    print(
        f"     follower's server connections (CLIENT LIST): peak {fc['peak']} ({fc['listeners']} "
        f"listener, {fc['blocked_peak']} in a blocking command); baseline, one key: {bc['peak']}"
    )
    rc = f["rechecks"]
    print(
        f"     follower's commands per flight: {f['stats']['commands'] / m['keys']:.2f} "
        f"(fc.stats); lease re-checks: {rc['peeks']} flights peeked in {rc['calls']} script "
        f"calls, {rc['woken']} followers woken by them"
    )
    print("     wake lag (ms)                                      n     p50     p99     max")
    print(_row(f"{m['keys']} keys: follower's return - loader end", m["wake_lag_ms"]))
    print(_row(f"  baseline: one key, {one['rounds']} rounds", one["wake_lag_ms"]))
    if "first_rounds_wake_lag_ms" in one and one["first_rounds"] < one["rounds"]:
        print(_row(f"    its first {one['first_rounds']} rounds", one["first_rounds_wake_lag_ms"]))
    print(_row("  owner's own callers' return - loader end", m["owner_return_lag_ms"]))
    print(_row("    baseline: one key", one["owner_return_lag_ms"]))
    print(_row("  follower's return - owner's callers'", m["follower_after_owner_ms"]))
    r = m["wake_lag_ratio"]
    print(
        f"     ratio to the one-key baseline: p50 {r['p50']:.1f}x, p99 {r['p99']:.1f}x; followers "
        f"back more than 1 s after the owner's callers: {m['follower_after_owner_over_1s']}"
    )
    sd, t = k["many_keys_steady"], k["many_keys_ending_together"]
    for phase, how in (
        (
            sd,
            f"the ends spread over {sd['spread_s']:g} s, the loader's length ("
            f"{sd['keys'] / sd['spread_s']:.0f} ends/s, what {sd['keys']} flights in flight "
            "sustain)",
        ),
        (t, f"each wave's {t['wave']} loaders ending in one instant"),
    ):
        print(
            f"   the same with {how}: right {phase['right']}/{phase['keys']}, errors "
            f"{phase['error_count']}, follower connections peak "
            f"{phase['follower_connections']['peak']}"
        )
        _lag_rows(
            ("  follower's return - loader end", phase["wake_lag_ms"]),
            ("  owner's own callers' return - loader end", phase["owner_return_lag_ms"]),
            ("the one-key baseline", phase["wake_lag_ratio"], 1),
        )
    fl = t["plain"]
    print(
        f"     baseline, the same processes with plain redis-py: {fl['keys']} SET+PUBLISH in one "
        f"instant (pool of 64), one pub/sub reader waking {fl['keys']} tasks; {fl['rounds']} "
        f"rounds, {fl['woken']} woken"
    )
    _lag_rows(
        ("  follower's wake-up - end", fl["wake_lag_ms"]),
        ("  owner's own return - end", fl["owner_return_lag_ms"]),
        ("plain redis-py", t["plain_ratio"], 2),
    )
    for role, process in (("owner", o), ("follower", f)):
        g = process["gc"]
        late = [t for t, _ms in g["over_20ms"] if (o["loader_first_end"] or 0) <= t]
        print(
            f"     {role}'s cyclic GC: {g['collections']} collections ({g['gen2']} full), "
            f"{g['total_ms']:.0f} ms in all, longest {g['max_ms']:.0f} ms; over 20 ms once the "
            f"first loader ended: {len(late)}"
        )
    ph = m["follow_phase"]
    print(
        f"     CPU from the follower's start to the last call's end ({ph['seconds']:.1f} s): "
        f"follower {ph['follower_cpu_s']:.1f} s, owner {ph['owner_cpu_s']:.1f} s, server "
        f"{ph['server_cpu_s']:.1f} s"
    )
    for role, process in (("owner", o), ("follower", f)):
        _warnings(f"{role}'s", process["warnings"], m["follow_started_at"], "the follower started")
    print(
        f"   owner burst: {burst['keys']} calls started at once by a fresh process, loader "
        f"{burst['loader_s']:g} s: {burst['right']} right within {burst['bound_s']:g} s, "
        f"{burst['unfinished']} unfinished, {burst['error_count']} errors; "
        f"{burst['lease_lost']} leases lost, {burst['loader_starts']} loader runs started"
    )
    _warnings("burst's", burst["warnings"], burst["started_at"], "the burst started")
    w = m["renewals"]
    quiet = "nothing else running" if w["flights"] == m["keys"] else "CLAIMS STILL RUNNING"
    print(
        f"   renewals: {w['flights']} owned flights, {quiet}, {w['window_s']:.1f} s:"
        f" {w['evalsha_per_s']:.1f} EVALSHA/s (one script per flight per lease/3: "
        f"{w['one_script_per_flight_per_s']:.0f}/s); owner sends "
        f"{w['owner_client_commands_per_s']:.1f} commands/s (fc.stats)"
    )
    print(
        f"     run by the server: {w['server_commands_per_s']:.0f} commands/s incl. inside Lua "
        f"({_counts(w['by_name_per_s'], 0)}); server CPU {w['server_cpu_share'] * 100:.0f} % of a"
        f" core, owner process {w['owner_cpu_share'] * 100:.0f} %"
    )
    mem = m["memory"]
    print(
        f"   memory per in-flight key (MEMORY USAGE, {mem['flights']} flights, "
        f"{m['joined_before_first_end']} of them followed): "
        f"{mem['bytes_per_flight']:.0f} B ({_counts(mem['by_key'], 0)}); used_memory growth "
        f"{mem['used_memory_growth_per_flight']:.0f} B per flight"
    )
    print(
        f"     reference: a bare stream of one entry takes {mem['bare_one_entry_stream_bytes']} B"
        f" (stream-node-max-bytes {mem['stream_node_max_bytes']}); at the servers' default "
        f"(4096) a flight would take {mem['bytes_per_flight_at_default_node_bytes']:.0f} B"
    )
    ms = k["misses"]
    c = ms["config"]
    print(
        f"   misses/s, one process: {c['keys']} distinct keys asked once each, "
        f"{c['concurrency']} at a time, loader returns at once; median of {c['rounds']} rounds"
    )
    print(
        "     variant                    misses/s  x GET-SET  CPU us/miss  "
        "sent/miss (MONITOR)       run by server/miss"
    )
    print("                                                    client server")
    for name, label in (("get-set", "GET, then SET (redis-py)"), ("do", "fc.do(key, loader)")):
        v = ms[name]
        x = 1.0 if name == "get-set" else ms["ratio"]
        sent = f"{v['sent_per_miss_monitor']:.2f} ({_counts(v['sent_by_name_per_miss_monitor'])})"
        print(
            f"     {label:<26} {v['misses_per_s']:9.0f} {x:10.2f} {v['cpu_us_per_miss']:6.0f}"
            f" {v['server_cpu_us_per_miss']:6.0f}  {sent:<26} {v['server_commands_per_miss']:.2f}"
        )
        if v["error_count"] or v["wrong"]:
            print(f"       errors {v['error_count']}, wrong values {v['wrong']}: {v['errors'][:1]}")
    inside = _counts(ms["do"]["server_by_name_per_miss"])
    print(f"     fc.do, run by the server per miss (scripts and what they run): {inside}")
    st = k["streams"]
    c = st["config"]
    print(
        f"   gateway: {c['streams']} distinct streaming prompts, each asked of both replicas at "
        f"once, {c['in_flight']} prompts at a time (mock: {c['mock_latency_ms']:g} ms, then "
        f"{c['mock_text_tokens']} tokens at {c['mock_tokens_per_s']:g}/s)"
    )
    print(
        "     path                  wall s       served  upstream calls   p50 ms   p99 ms  X-Cache"
    )
    for name, label in (("gateway", "via 2 gateways"), ("direct", "direct to the upstream")):
        v = st[name]
        lat = v["latency_ms"]
        print(
            f"     {label:<22} {v['seconds']:6.2f}  {v['served']:5d}/{v['requests']:<5d}"
            f" {v['upstream_calls']:15d} {lat['p50']:8.0f} {lat['p99']:8.0f}  "
            f"{_counts(v['x_cache'], 0) or '-'}"
        )
        if v["error_count"]:
            print(f"       errors {v['error_count']}, first: {v['errors'][0]}")
    g, d = st["gateway"], st["direct"]
    conns = " and ".join(f"{x['peak']} ({x['blocked_peak']} blocked)" for x in g["connections"])
    print(
        f"     wall time ratio {st['wall_time_ratio']:.2f}; same text as the upstream's: "
        f"{g['same_text_as_upstream']}/{c['streams']}; replicas' connections peak {conns}"
    )
    gw_cpu = g["cpu_s"]["gateway_a"] + g["cpu_s"]["gateway_b"]
    via, direct = g["cpu_s"], d["cpu_s"]
    print(
        f"     CPU s via the gateways: replicas {gw_cpu:.2f} "
        f"({gw_cpu / g['requests'] * 1000:.1f} ms per stream served), mock {via['mock']:.2f}, "
        f"Redis {via['redis']:.2f}, client {via['client']:.2f}; direct: mock "
        f"{direct['mock']:.2f}, client {direct['client']:.2f}"
    )


def _lag_rows(
    follower: tuple[str, dict[str, Any]],
    owner: tuple[str, dict[str, Any]],
    ratio: tuple[str, dict[str, float], int],
) -> None:
    """A wave's two wake-lag rows, and its ratio to ``ratio``'s baseline."""
    for label, lag in (follower, owner):
        print(_row(label, lag))
    name, r, digits = ratio
    print(f"     ratio to {name}: p50 {r['p50']:.{digits}f}x, p99 {r['p99']:.{digits}f}x")


def _first_rounds(k: dict[str, Any], phase: dict[str, Any]) -> str:
    """The p99 ratio against the baseline's first rounds only (as many as runs before
    this one took), when the baseline took more."""
    one, r = k["single_key"], phase.get("wake_lag_ratio_first_rounds")
    if r is None or one["first_rounds"] >= one["rounds"]:
        return ""
    return (
        f"; against its first {one['first_rounds']} rounds' p99 "
        f"({one['first_rounds_wake_lag_ms']['p99']:.2f} ms): {r['p99']:.1f}x"
    )


def scale_key_targets(k: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Targets of section 7 (scale across distinct keys)."""
    if k is None:
        return []
    m, burst, ms, st = k["many_keys"], k["owner_burst"], k["misses"], k["streams"]
    t, sd = k["many_keys_ending_together"], k["many_keys_steady"]
    r, rt, rs = m["wake_lag_ratio"], t["wake_lag_ratio"], sd["wake_lag_ratio"]
    worst, worst_t, worst_s = (max(x["p50"], x["p99"]) for x in (r, rt, rs))
    mem = m["memory"]["bytes_per_flight"]
    g = st["gateway"]
    return [
        _target(
            f"{m['keys']} keys followed: every caller right",
            f"{m['right']}/{m['keys']} right, {m['error_count']} errors, "
            f"{m['unfinished']} unfinished, {m['follower']['loader_runs']} follower loads",
            m["right"],
            _many_keys_right(m),
        ),
        _target(
            f"{m['keys']} keys, ends spread over {m['spread_s']:g} s "
            f"({m['keys'] / m['spread_s']:.0f}/s): wake lag <= {WAKE_RATIO_TARGET:g} x one key's",
            f"p50 {r['p50']:.1f}x, p99 {r['p99']:.1f}x ({m['wake_lag_ms']['p99']:.1f} ms vs "
            f"{k['single_key']['wake_lag_ms']['p99']:.2f} ms){_first_rounds(k, m)}",
            worst,
            worst <= WAKE_RATIO_TARGET,
        ),
        _target(
            f"{sd['keys']} keys, ends spread over {sd['spread_s']:g} s "
            f"({sd['keys'] / sd['spread_s']:.0f}/s, steady state): wake lag <= "
            f"{WAKE_RATIO_TARGET:g} x one key's",
            f"p50 {rs['p50']:.1f}x, p99 {rs['p99']:.1f}x ({sd['wake_lag_ms']['p99']:.1f} ms vs "
            f"{k['single_key']['wake_lag_ms']['p99']:.2f} ms){_first_rounds(k, sd)}",
            worst_s,
            worst_s <= WAKE_RATIO_TARGET,
        ),
        _target(
            f"{t['keys']} keys, {t['wave']} ending at once: wake lag <= {WAKE_RATIO_TARGET:g}"
            " x one key's",
            f"p50 {rt['p50']:.1f}x, p99 {rt['p99']:.1f}x ({t['wake_lag_ms']['p99']:.1f} ms; "
            f"the owner's own callers {t['owner_return_lag_ms']['p99']:.1f} ms)",
            worst_t,
            worst_t <= WAKE_RATIO_TARGET,
        ),
        _target(
            f"{t['keys']} keys, {t['wave']} ending at once: wake lag <= "
            f"{TOGETHER_PLAIN_TARGET:g} x plain redis-py's for the same wave",
            f"p50 {t['plain_ratio']['p50']:.2f}x, p99 {t['plain_ratio']['p99']:.2f}x (plain: "
            f"p50 {t['plain']['wake_lag_ms']['p50']:.1f}, p99 "
            f"{t['plain']['wake_lag_ms']['p99']:.1f} ms)",
            max(t["plain_ratio"].values()),
            max(t["plain_ratio"].values()) <= TOGETHER_PLAIN_TARGET,
        ),
        _target(
            f"owner burst of {burst['keys']}: all right in {burst['bound_s']:g} s",
            f"{burst['right']}/{burst['keys']} right, {burst['unfinished']} unfinished, "
            f"{burst['lease_lost']} leases lost",
            burst["right"],
            burst["right"] == burst["keys"],
        ),
        _target(
            f"fc.do misses/s >= {MISS_RATIO_TARGET:g} x GET-then-SET",
            f"{ms['ratio']:.2f} ({ms['do']['misses_per_s']:.0f} vs "
            f"{ms['get-set']['misses_per_s']:.0f}/s), {ms['do']['sent_per_miss_monitor']:.2f} "
            f"sent per miss",
            ms["ratio"],
            ms["ratio"] >= MISS_RATIO_TARGET and not ms["do"]["error_count"],
        ),
        _target(
            f"server memory per in-flight key <= {FLIGHT_BYTES_TARGET} B",
            f"{mem:.0f} B (stream {m['memory']['by_key']['stream']:.0f} B, stream-node-max-bytes"
            f" {m['memory']['stream_node_max_bytes']}; at the default 4096: "
            f"{m['memory']['bytes_per_flight_at_default_node_bytes']:.0f} B)",
            mem,
            mem <= FLIGHT_BYTES_TARGET,
        ),
        _target(
            f"{st['config']['streams']} streams via 2 gateways: {st['config']['streams']} "
            f"upstream calls",
            f"{g['upstream_calls']} calls, {g['served']}/{g['requests']} clients served "
            f"(direct: {st['direct']['upstream_calls']})",
            g["upstream_calls"],
            streams_right(st) and g["upstream_calls"] == st["config"]["streams"],
        ),
        _target(
            f"{st['config']['streams']} streams: wall time <= {STREAM_WALL_TARGET:g} x direct",
            f"{st['wall_time_ratio']:.2f} ({g['seconds']:.2f} s vs "
            f"{st['direct']['seconds']:.2f} s)",
            st["wall_time_ratio"],
            st["wall_time_ratio"] <= STREAM_WALL_TARGET,
        ),
    ]


def _many_keys_right(m: dict[str, Any]) -> bool:
    return (
        m["right"] == m["keys"]
        and m["error_count"] == 0
        and m["unfinished"] == 0
        and m["follower"]["loader_runs"] == 0
    )


def streams_right(st: dict[str, Any]) -> bool:
    """Every client of the gateway pass served the upstream's text (a failure of the direct
    pass, the baseline, is shown but is not the gateway's)."""
    g = st["gateway"]
    return g["error_count"] == 0 and g["same_text_as_upstream"] == st["config"]["streams"]


def scale_keys_broken(k: dict[str, Any]) -> bool:
    """What sets the exit status in section 7: a caller that failed or got a wrong value,
    a gateway client not served or served another text, or more upstream calls than
    streams. (The owner burst's unfinished calls are a target, not a failure.)"""
    m, burst, ms, st = k["many_keys"], k["owner_burst"], k["misses"], k["streams"]
    return (
        not _many_keys_right(m)
        or not _many_keys_right(k["many_keys_ending_together"])
        or not _many_keys_right(k["many_keys_steady"])
        or bool(burst["error_count"])
        or any(ms[v]["error_count"] or ms[v]["wrong"] for v in ("get-set", "do"))
        or not streams_right(st)
        or st["gateway"]["upstream_calls"] > st["config"]["streams"]
    )


SYNC_HIT_TARGET = 0.8  # FlightCacheSync hits x raw sync redis-py GET, without near cache
SYNC_FLOOR_TARGET = 1.5  # sync stampede wake-lag p99 x plain threads woken by a raw read


def print_sync(s: dict[str, Any]) -> None:
    """The sync client's section (bench/_sync.py): hit path and stampede."""
    h, st = s["hit_path"], s["stampede"]
    c = h["config"]
    print()
    print(
        f"Sync client (FlightCacheSync): hit path, cached {c['value_bytes']}-byte value, "
        f"{c['rounds']} alternating rounds, each up to {c['ops_per_measurement']} ops or "
        f"{c['seconds_per_measurement']:g} s"
    )
    for mode, title in (
        ("sequential", "sequential, one thread"),
        ("concurrent", f"concurrent, {c['threads']} threads on {c['threads']} keys"),
    ):
        print(f"   {title:<44} ops/s median     best  x raw GET  CPU us/op")
        for name in _sync.VARIANTS:
            r = h[mode][name]
            print(
                f"     {_sync.LABELS[name]:<42} {r['ops_per_s']:9.0f} {r['best_ops_per_s']:8.0f}"
                f"  {r['ratio_to_raw']:9.2f}  {r['cpu_us_per_op']:9.1f}"
            )
    trips = h.get("round_trips")
    if trips:
        print(
            f"   round trips per fcs.do (stats commands): a miss {trips['miss']:.2f}, "
            f"a hit {trips['hit']:.2f}"
        )
    sc = st["config"]
    print(
        f"   stampede: {sc['processes']} processes x {sc['callers_per_process']} threads on one "
        f"fresh key, blocking loader {sc['loader_s'] * 1000:.0f} ms, {sc['rounds']} rounds"
    )
    print(f"     loader runs per round: {' '.join(map(str, st['loader_runs_per_round']))}")
    if st["errors"]:
        print(f"     caller errors: {len(st['errors'])}, first: {st['errors'][0]}")
    print("     wake lag = caller's return - loader's end (ms)    n     p50     p99     max")
    for label, field in (
        ("owner-process threads", "owner"),
        ("remote-follower-process threads", "remote"),
        ("  first thread woken, owner process", "owner_first"),
        ("  first thread woken, each remote process", "remote_first"),
    ):
        print(_row(label, st["wake_lag_ms"][field]))
    floor = st.get("floor_wake_lag_ms")
    if floor:
        print("     floor: the same threads woken by a raw XREAD and a threading.Event")
        print(_row("  every thread (thread wake - XADD)", floor))


def sync_targets(s: dict[str, Any] | None) -> list[dict[str, Any]]:
    if s is None:
        return []
    st = s["stampede"]
    runs = st["loader_runs_per_round"]
    return [
        _ratio_target(
            f"sync hit path >= {SYNC_HIT_TARGET} x raw sync GET",
            s["hit_path"],
            ("get", "do"),
            SYNC_HIT_TARGET,
            2,
        ),
        _target(
            "sync stampede: loader runs exactly once",
            f"{sum(r == 1 for r in runs)}/{len(runs)} rounds",
            max(runs),
            all(r == 1 for r in runs) and not st["errors"],
        ),
        _wake_target("sync stampede ", st["wake_lag_ms"]),
        *_floor_target(st),
    ]


def _floor_target(st: dict[str, Any]) -> list[dict[str, Any]]:
    """The sync stampede's wake-lag p99 over the floor's (plain threads woken by a raw
    redis-py read in the same workers, same run): what the library adds to Python's own
    cost of waking that many threads."""
    floor = st.get("floor_wake_lag_ms")
    if not floor:
        return []
    p99 = _worst_p99(st["wake_lag_ms"])
    ratio = p99 / floor["p99"]
    return [
        _target(
            f"sync stampede wake lag p99 <= {SYNC_FLOOR_TARGET:g} x plain threads' floor",
            f"{ratio:.2f} ({p99:.2f} ms vs floor {floor['p99']:.2f} ms)",
            ratio,
            ratio <= SYNC_FLOOR_TARGET,
        )
    ]


def print_sdk(k: dict[str, Any]) -> None:
    """The SDK wrappers' section (bench/_sdk.py): hit overhead, calls per burst, TTFT."""
    c = k["config"]
    print()
    print(
        "SDK wrappers: flightcache.integrations with the real openai and anthropic "
        "clients, one `flightcache mock-upstream`"
    )
    print(f"   hit overhead: {c['hit_ops']} sequential non-stream calls each, mock latency 0")
    print(f"     {'':<44} {'n':>5} {'p50':>9} {'p99':>9} {'max':>9}")
    for api, rows in k["hit_overhead_ms"].items():
        print(_row(f"{api}: the mock called directly", rows["direct"], " ms"))
        print(_row(f"{api}: the wrapped client, a hit", rows["wrapped_hit"], " ms"))
    print(
        f"   bursts: {c['processes']} processes x {c['callers']} identical wrapped calls, "
        f"{c['rounds']} per API; mock: first token after {c['mock_latency_ms']} ms, "
        f"{c['mock_tokens_per_s']} tokens/s"
    )
    for api, counts in k["upstream_calls_per_burst"].items():
        print(f"     {api:<44} upstream calls per burst: {counts}")
    print("   time to first text delta: the owner's, and each follower's minus the owner's")
    for api, owner in k["owner_ttft_ms"].items():
        print(_row(f"{api}: owner TTFT", owner, " ms"))
        lag = k["follower_ttft_minus_owner_ms"][api]
        print(_row(f"{api}: follower TTFT - owner TTFT", lag, " ms"))
    if k["errors"]:
        print(f"   errors: {k['errors']}")


def sdk_targets(k: dict[str, Any] | None) -> list[dict[str, Any]]:
    if k is None:
        return []
    counts = [c for v in k["upstream_calls_per_burst"].values() for c in v]
    hits = k["hit_overhead_ms"]
    worst = max(hits[api]["wrapped_hit"]["p50"] / hits[api]["direct"]["p50"] for api in hits)
    measured = ", ".join(
        f"{api} {hits[api]['wrapped_hit']['p50']:.2f} vs {hits[api]['direct']['p50']:.2f} ms"
        for api in hits
    )
    return [
        _target(
            "sdk wrappers: one upstream call per burst",
            f"{sum(c == 1 for c in counts)}/{len(counts)} bursts",
            max(counts),
            all(c == 1 for c in counts) and not k["errors"],
        ),
        _target("sdk wrappers: a hit's p50 <= a direct mock call's", measured, worst, worst <= 1),
    ]


def print_batch(b: dict[str, Any]) -> None:
    """Batch loading and tags (bench/_batch.py): do_many against one MGET, a batch miss's
    round trips, invalidate_tags against invalidate_many, the read cost of a tag."""
    h, m, t = b["hits"], b["misses"], b["tags"]
    n = h["config"]["keys"]
    print()
    print(f"Batch loading and tags: {n} keys a call, near cache off (the server answers)")
    print(f"   {n} stored keys, one call each, alternating rounds     calls/s  x one MGET")
    rows = (
        (f"one MGET of {n} keys (raw redis-py), the baseline", "mget", 1.0),
        (f"fc.do_many({n} keys)", "do_many", h["ratio_to_mget"]["do_many"]),
        (f"asyncio.gather of {n} fc.do", "gather_do", h["ratio_to_mget"]["gather_do"]),
    )
    for label, name, ratio in rows:
        print(f"     {label:<52} {h['calls_per_s'][name]:8.0f}  {ratio:9.3f}")
    print(f"   {n} keys nobody has, one call each        round trips  server commands  wall ms")
    for label, name in (("fc.do_many", "do_many"), (f"asyncio.gather of {n} fc.do", "gather_do")):
        r = m[name]
        print(
            f"     {label:<40} {r['round_trips']:9.0f}  {r['server_commands']:15.0f}"
            f"  {r['wall_ms']:7.1f}"
        )
    it, im = t["invalidate_tags"], t["invalidate_many"]
    k = t["config"]["tagged_results"]
    print(f"   {k} results under one tag, one other node holding a copy   commands        s")
    print(
        f"     {'invalidate_tags([tag])':<56} {it['server_commands']:8.0f}  {it['seconds']:7.4f}"
        f"   ({it['how']}, {it['acked']}/{it['nodes']} acked, stale reads after: "
        f"{it['stale_reads_after']})"
    )
    print(
        f"     {f'invalidate_many of the {k} keys, the baseline':<56} "
        f"{im['server_commands']:8.0f}  {im['seconds']:7.4f}"
    )
    print(
        f"     invalidate_tags: {t['ratio_commands']:.0f}x fewer commands, "
        f"{t['ratio_seconds']:.0f}x less time"
    )
    th = t["tagged_hit"]
    print("   a hit served by the server, sequential              calls/s  round trips")
    for name in ("untagged", "tagged"):
        print(
            f"     fc.do, {name + ' key':<45} {th['calls_per_s'][name]:8.0f}"
            f"  {th['round_trips'][name]:11d}"
        )
    print(f"     a tagged hit: x {th['ratio_tagged_to_untagged']:.2f} an untagged one's calls/s")


def batch_targets(b: dict[str, Any] | None) -> list[dict[str, Any]]:
    if b is None:
        return []
    m, t = b["misses"], b["tags"]
    it = t["invalidate_tags"]
    return [
        _target(
            "do_many miss: 2 round trips however many keys",
            f"{m['do_many']['round_trips']:.0f} for {m['config']['keys']} keys",
            m["do_many"]["round_trips"],
            m["do_many"]["round_trips"] <= 2,
        ),
        _target(
            "invalidate_tags: O(1) per tag, whatever the results under it",
            f"{it['server_commands']:.0f} commands, {it['seconds'] * 1000:.1f} ms for "
            f"{t['config']['tagged_results']} results",
            it["server_commands"],
            it["server_commands"] <= 16 and it["stale_reads_after"] == 0,
        ),
    ]
