"""Reporting section 7, scale across distinct keys: many keys in flight followed by another
process (spread, steady and ending together, against one key and plain redis-py), the
owner burst, renewals, server memory per flight, misses/s against GET-then-SET and the
gateway's many distinct streams; its targets, and whether the run was broken."""

from __future__ import annotations

from typing import Any

from ._report import _row, _target

WAKE_RATIO_TARGET = 2.0  # many keys' wake lag / one key's, p50 and p99
# A wave of 1,000 ending at once: its wake lag / the same wave's with plain redis-py.
TOGETHER_PLAIN_TARGET = 1.5
MISS_RATIO_TARGET = 0.8  # fc.do misses/s / GET-then-SET misses/s
FLIGHT_BYTES_TARGET = 1024  # server memory per in-flight key
STREAM_WALL_TARGET = 1.3  # 1,000 streams via two gateways / the same clients direct


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


def _cpu(phase: dict[str, Any]) -> None:
    """A many-keys phase's CPU, and how long each process was ready to run with no CPU to
    run on: the machine's share of its lag (NaN where the kernel does not say)."""
    ph = phase["follow_phase"]
    print(
        f"     CPU from the follower's start to the last call's end ({ph['seconds']:.1f} s): "
        f"follower {ph['follower_cpu_s']:.1f} s, owner {ph['owner_cpu_s']:.1f} s, server "
        f"{ph['server_cpu_s']:.1f} s; ready to run but waiting for a CPU: follower "
        f"{ph['follower_runqueue_wait_s']:.2f} s, owner "
        f"{ph['owner_runqueue_wait_s']:.2f} s, server "
        f"{ph['server_runqueue_wait_s']:.2f} s"
    )


def _gc(phase: dict[str, Any]) -> None:
    """A many-keys phase's cyclic GC in both workers, from the owner's first claim to the
    calls' end: a pause stops the process's every thread, and one of a few hundred
    milliseconds among the ends is in every lag it overlaps."""
    first_end = phase["owner"]["loader_first_end"] or 0.0
    for role in ("owner", "follower"):
        g = phase[role]["gc"]
        ends = [ms for t, ms in g["over_20ms"] if t >= first_end]
        print(
            f"     {role}'s cyclic GC: {g['collections']} collections ({g['gen2']} full), "
            f"{g['total_ms']:.0f} ms in all, longest {g['max_ms']:.0f} ms; over 20 ms once the "
            f"first loader ended: {len(ends)}{f', longest {max(ends):.0f} ms' if ends else ''}"
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
        f"calls, {rc.get('sessions', 0)} sessions peeked, {rc['woken']} followers woken by them"
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
    _floor(m)
    _cpu(m)
    _gc(m)
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
        _floor(phase)
        _cpu(phase)
        _gc(phase)
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
        _warnings(f"{role}'s", process["warnings"], m["follow_started_at"], "the follower started")
    print(
        f"   owner burst: {burst['keys']} calls started at once by a fresh process, loader "
        f"{burst['loader_s']:g} s: {burst['right']} right within {burst['bound_s']:g} s, "
        f"{burst['unfinished']} unfinished, {burst['error_count']} errors; "
        f"{burst['lease_lost']} leases lost, {burst['loader_starts']} loader runs started"
    )
    _warnings("burst's", burst["warnings"], burst["started_at"], "the burst started")
    w = k["renewals"]
    quiet = "nothing else running" if w["flights"] == w["keys"] else "CLAIMS STILL RUNNING"
    print(
        f"   renewals: {w['flights']} owned flights, {quiet}, {w['window_s']:.1f} s"
        f" ({w['right']} right after it, {w['lease_lost']} leases lost in it,"
        f" {w.get('bound_late', 0)} bound to the session after their claim):"
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
    paths = (
        ("gateway", "via 2 gateways"),
        ("relayed", "relayed, not coalesced"),
        ("direct", "direct to the upstream"),
    )
    for name, label in paths:
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
    r = st["relayed"]
    relay_cpu = r["cpu_s"]["gateway_a"] + r["cpu_s"]["gateway_b"]
    print(
        f"     relayed (X-Flightcache-Coalesce: off, each request proxied as it is): wall "
        f"time ratio {st['relayed_wall_time_ratio']:.2f}; replicas {relay_cpu:.2f} CPU s "
        f"({relay_cpu / r['requests'] * 1000:.1f} ms per stream), mock "
        f"{r['cpu_s']['mock']:.2f}, client {r['cpu_s']['client']:.2f}"
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


def _floor(phase: dict[str, Any]) -> None:
    """A spread phase's floor: the same spread with plain redis-py, and one plain event."""
    fl = phase.get("floor")
    if fl is None:
        return
    print(
        f"     floor, the same processes with plain redis-py (SET+PUBLISH, one pub/sub reader): "
        f"{fl['spread']['keys']} events over {fl['spread']['spread_s']:g} s, and one event "
        f"{fl['one']['rounds']} times"
    )
    print(_row("  plain: wake-up - end, the spread", fl["spread"]["wake_lag_ms"]))
    print(_row("  plain: wake-up - end, one event", fl["one"]["wake_lag_ms"]))
    r, pr = fl["ratio"], phase["floor_ratio"]
    print(
        f"     plain's spread x its one event: p50 {r['p50']:.1f}x, p99 {r['p99']:.1f}x; "
        f"flightcache's spread x plain's: p50 {pr['p50']:.1f}x, p99 {pr['p99']:.1f}x"
    )


def _floor_note(phase: dict[str, Any]) -> str:
    """The floor beside a spread target's figure."""
    fl = phase.get("floor")
    if fl is None:
        return ""
    return (
        f"; floor, plain redis-py's same spread: p99 {fl['spread']['wake_lag_ms']['p99']:.1f} ms"
        f", {fl['ratio']['p99']:.1f}x its one event"
    )


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
            f"{k['single_key']['wake_lag_ms']['p99']:.2f} ms){_first_rounds(k, m)}"
            f"{_floor_note(m)}",
            worst,
            worst <= WAKE_RATIO_TARGET,
        ),
        _target(
            f"{sd['keys']} keys, ends spread over {sd['spread_s']:g} s "
            f"({sd['keys'] / sd['spread_s']:.0f}/s, steady state): wake lag <= "
            f"{WAKE_RATIO_TARGET:g} x one key's",
            f"p50 {rs['p50']:.1f}x, p99 {rs['p99']:.1f}x ({sd['wake_lag_ms']['p99']:.1f} ms vs "
            f"{k['single_key']['wake_lag_ms']['p99']:.2f} ms){_first_rounds(k, sd)}"
            f"{_floor_note(sd)}",
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
