"""Printing the figures and judging them against the project's targets."""

from __future__ import annotations

from typing import Any

from ._hitpath import LABELS, VARIANTS

HIT_RATIO_TARGET = 0.8
WAKE_P99_TARGET_MS = 5.0
FOLLOWER_COMMANDS_TARGET = 4


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


def targets(s: dict[str, Any] | None, h: dict[str, Any] | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if h is not None:
        ratios = {
            f"{name} {mode[:3]}": h[mode][name]["ratio_to_raw"]
            for mode in ("sequential", "concurrent")
            for name in ("get", "do")
        }
        worst = min(ratios.values())
        out.append(
            {
                "target": f"hit path >= {HIT_RATIO_TARGET} x raw GET",
                "measured": ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()),
                "value": worst,
                "pass": worst >= HIT_RATIO_TARGET,
            }
        )
    if s is not None:
        lag = s["wake_lag_ms"]
        p99 = max(lag["owner"]["p99"], lag["remote"]["p99"])
        out.append(
            {
                "target": f"wake lag p99 <= {WAKE_P99_TARGET_MS:g} ms (loopback)",
                "measured": (
                    f"owner {lag['owner']['p99']:.2f} ms, remote {lag['remote']['p99']:.2f} ms"
                ),
                "value": p99,
                "pass": p99 <= WAKE_P99_TARGET_MS,
            }
        )
        m = s["commands"]
        cl, sv = m["follower_process_client"], m["follower_process_server"]
        worst_cmds = max(cl["max"], sv["max"])
        out.append(
            {
                "target": f"<= {FOLLOWER_COMMANDS_TARGET} Redis commands per remote follower",
                "measured": f"median {cl['median']:g}, max {worst_cmds:g} (every follower process)",
                "value": worst_cmds,
                "pass": worst_cmds <= FOLLOWER_COMMANDS_TARGET,
            }
        )
        runs = s["loader_runs_per_round"]
        out.append(
            {
                "target": "loader runs exactly once per stampede",
                "measured": f"{sum(r == 1 for r in runs)}/{len(runs)} rounds",
                "value": max(runs),
                "pass": all(r == 1 for r in runs) and not s["errors"],
            }
        )
    return out


def print_targets(rows: list[dict[str, Any]]) -> None:
    print()
    print("3. Targets")
    for row in rows:
        verdict = "PASS" if row["pass"] else "MISS"
        print(f"   {verdict}  {row['target']:<44} {row['measured']}")
