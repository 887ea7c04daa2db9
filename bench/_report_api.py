"""Reporting the client APIs beyond the async FlightCache: the sync client
(FlightCacheSync's hit path and stampede, against the plain threads' floor), the OpenAI and
Anthropic SDK wrappers (hit overhead, upstream calls per burst, time to first token) and
batch loading and tags (do_many, invalidate_tags), each printed and judged against its
targets."""

from __future__ import annotations

from typing import Any

from . import _sync
from ._report import _ratio_target, _row, _target, _wake_target, _worst_p99

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
