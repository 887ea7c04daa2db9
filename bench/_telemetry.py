"""Phase 11: what telemetry costs the hit path when nobody configured OpenTelemetry.

With ``opentelemetry-api`` installed every ``FlightCache`` is ready to make spans, but
until the app sets a tracer provider it makes none (the cache looks for one once a second
on its loop; a call reads one attribute, as with telemetry off). This phase
measures ``fc.do`` on cached keys through two caches of one run, one with telemetry off
(``instrument(fc, tracer_provider=None, meter_provider=None)``, the path without the
package) and one as a cache is made by default (on, no provider configured), both on the
server hit path (``near_cache=False``: a round trip) and on near-cache hits (about a
microsecond each, where any cost would show most). Rounds alternate the variants as in the
hit-path phase, but finer: off and on are measured back to back, in turns first, many
short times; the on/off ratio of ops/s and of this process's CPU us per op is taken
within each round and the median over rounds reported (target: on >= 0.95 x off). A
control pair, two caches with telemetry off, shows what the machine's noise alone does to
such a ratio.
"""

from __future__ import annotations

from typing import Any

from flightcache import FlightCache
from flightcache.telemetry import instrument

from ._rounds import MODES, Op, Reads, concurrent, sequential
from ._util import median

NAMESPACE = "bench-telemetry"
PAIRS = {
    "server hit": ("do-off", "do-on"),
    "near-cache hit": ("near-off", "near-on"),
    "control: server hit, off vs off": ("do-off", "do-off2"),  # what noise alone does
}


def _configured() -> bool:
    """True if this process has a global tracer provider (then 'on' would make spans)."""
    try:
        from opentelemetry import trace
    except ImportError:
        return False
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


async def run(
    url: str,
    *,
    rounds: int = 16,
    server_budget: tuple[int, float] = (5_000, 0.3),
    near_budget: tuple[int, float] = (100_000, 0.2),
    concurrency: int = 16,
) -> dict[str, Any]:
    if _configured():
        raise RuntimeError("a global tracer provider is set: 'on' would not be 'no provider'")
    caches = {
        "do-off": FlightCache(url, namespace=NAMESPACE, near_cache=False),
        "do-on": FlightCache(url, namespace=NAMESPACE, near_cache=False),
        "near-off": FlightCache(url, namespace=NAMESPACE),
        "near-on": FlightCache(url, namespace=NAMESPACE),
        "do-off2": FlightCache(url, namespace=NAMESPACE, near_cache=False),
    }
    for name in ("do-off", "near-off", "do-off2"):
        instrument(caches[name], tracer_provider=None, meter_provider=None)
    telemetry = {name: fc._tel is not None and fc._traced is None for name, fc in caches.items()}
    want = {"do-off": False, "do-on": True, "near-off": False, "near-on": True, "do-off2": False}
    if telemetry != want:
        raise RuntimeError(f"telemetry is not as the variants need: {telemetry}")
    # mode -> pair -> (off, on) -> one figure per round
    Samples = dict[str, dict[str, tuple[list[float], list[float]]]]
    rate: Samples = {m: {p: ([], []) for p in PAIRS} for m in MODES}
    cpu_us: Samples = {m: {p: ([], []) for p in PAIRS} for m in MODES}
    async with Reads(url, "bench-telemetry-raw", concurrency) as reads:
        try:
            await reads.store(caches["do-off"])
            ops: dict[str, Op] = {name: reads.through(fc)["do"] for name, fc in caches.items()}
            await reads.check_and_warm("telemetry", ops)
            reads.loader.calls = 0
            for r in range(rounds):  # off and on back to back, in turns first
                for label, pair in PAIRS.items():
                    n_ops, seconds = near_budget if pair[0].startswith("near") else server_budget
                    for mode in MODES:
                        for side in (0, 1) if r % 2 == 0 else (1, 0):
                            op = ops[pair[side]]
                            await sequential(op, 100, 0.1)  # warm this variant's path again
                            if mode == "sequential":
                                n, dt, cpu = await sequential(op, n_ops, seconds)
                            else:
                                n, dt, cpu = await concurrent(op, n_ops, seconds, concurrency)
                            rate[mode][label][side].append(n / dt)
                            cpu_us[mode][label][side].append(cpu / n * 1e6)
            if reads.loader.calls:
                raise RuntimeError(f"fc.do on cached keys ran the loader {reads.loader.calls}x")
        finally:
            for fc in caches.values():
                await fc.aclose()
    result: dict[str, Any] = {
        "config": {
            "rounds": rounds,
            "server_budget": server_budget,
            "near_budget": near_budget,
            "concurrency": concurrency,
        },
    }
    for mode in MODES:
        result[mode] = {}
        for label in PAIRS:
            (off, on), (cpu_off, cpu_on) = rate[mode][label], cpu_us[mode][label]
            result[mode][label] = {
                "ops_per_s_off": median(off),
                "ops_per_s_on": median(on),
                "ratio_on_off": median([b / a for a, b in zip(off, on, strict=True)]),
                "cpu_us_off": median(cpu_off),
                "cpu_us_on": median(cpu_on),
                "cpu_ratio_on_off": median([b / a for a, b in zip(cpu_off, cpu_on, strict=True)]),
                "samples_off": off,
                "samples_on": on,
            }
    return result


def print_telemetry(t: dict[str, Any]) -> None:
    c = t["config"]
    print()
    print(
        f"11. Telemetry: fc.do on cached keys, telemetry off vs on without a provider, "
        f"{c['rounds']} rounds, off and on back to back"
    )
    for mode, title in (
        ("sequential", "sequential, one coroutine"),
        ("concurrent", f"concurrent, {c['concurrency']} coroutines on as many keys"),
    ):
        print(f"   {title:<40} ops/s off      on  on/off   CPU us off     on  on/off")
        for label, r in t[mode].items():
            print(
                f"     {label:<38} {r['ops_per_s_off']:9.0f} {r['ops_per_s_on']:7.0f}"
                f"  {r['ratio_on_off']:6.3f}   {r['cpu_us_off']:10.2f} {r['cpu_us_on']:6.2f}"
                f"  {r['cpu_ratio_on_off']:6.3f}"
            )
    worst = min(
        t[m][label]["ratio_on_off"] for m in MODES for label in PAIRS if "control" not in label
    )
    print(f"   worst ops/s ratio on/off: {worst:.3f} (target >= 0.95)")
