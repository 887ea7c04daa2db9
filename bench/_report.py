"""Printing the figures and judging them against the project's targets: the helpers every
section's report shares (number formatting, table rows, target rows, the wake-lag target),
the header and the targets table, and sections 1 to 4 (stampede, hit path, gateway, near
cache) with their targets."""

from __future__ import annotations

from collections import Counter
from typing import Any

from . import _near
from ._hitpath import LABELS, VARIANTS
from ._util import median

HIT_RATIO_TARGET = 0.8
WAKE_P99_TARGET_MS = 5.0
FOLLOWER_COMMANDS_TARGET = 4
TTFT_P99_TARGET_MS = 5.0
NEAR_RATIO_TARGET = 50.0


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
