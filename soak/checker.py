"""The checker: reads every record of a soak run afterwards and verifies five properties.

1. ``bound``: no caller waited past its bound, ``2 x (timeout + lease) + 1`` s (the library's
   documented wait bound) plus ``slack``; the time the caller's own process spent stopped
   (SIGSTOP) is not counted.
2. ``provenance``: every value a caller received was made for that key by a loader run (or
   a ``set()``) that exists in the runs' records, and that had finished before the caller
   returned (so a caller that was not the owner got the value of an owner that completed);
   a stream is the whole sequence of one producer run, in order.
3. ``fresh``: after an ``invalidate()``/``set()`` returned, no read that started later
   returned a value it replaced: a value stored before the invalidation started (a
   ``set()`` that had returned by then, or a loader run that started before it, read from
   the store, i.e. by a call that started after its owner's call had returned).
4. ``runs``: loader runs <= flights + owner faults. A run is hit by a fault when its
   process was killed or stopped, its link cut or slowed, or the server restarted or failed
   over, during the run or within ``AROUND_S`` of it, or when it ran in fail-open (no
   token: no flight on the server had it). The runs hit by no fault are the flights: no two
   of one key may overlap in time (single flight), and every run whose value no caller
   received must have been hit by a fault (an owner that completed delivers its value), or
   have taken over from a run that was.
5. ``exceptions``: no operation raised an exception outside the ``FlightError`` tree.

Some cases of (3) are documented limits of the library, not violations; they are counted as
excused: a value a process computed alone in fail-open (no token) and served from its own
fallback store; anything across a Cluster failover (replication is asynchronous); and a
server restart (which empties the live set) while the reader's process was stopped or its
link cut or slowed, so that it could not hear the restart.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .records import read, read_all

CHECKS = {
    "bound": "no caller waited past its bound",
    "provenance": "every value came from a finished run of its key",
    "fresh": "no read after an invalidate/set returned its old value",
    "order": "no read went back to a run older than one already read",
    "runs": "loader runs <= flights + owner faults",
    "exceptions": "no exception outside FlightError",
}
READS = ("do", "get", "stream")
# A fault hits a run when it comes this close to the run's start or end (an owner's claim
# comes just before its loader starts, its result write just after it ends).
AROUND_S = 0.5


@dataclass
class Run:
    """One loader run, producer run or ``set()`` of a worker process."""

    id: str
    key: str
    kind: str  # do, stream, set
    w: int
    pid: int
    start: float
    tok: int | None = None
    end: float | None = None
    cancelled: float | None = None
    of: int | None = None  # a producer's chunk count


@dataclass
class Violation:
    check: str
    what: str
    records: list[Any] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"[{self.check}] {self.what}"]
        lines += ["    " + json.dumps(r, default=str)[:600] for r in self.records]
        return "\n".join(lines)


@dataclass
class Report:
    config: dict[str, Any]
    ops: dict[str, Counter[str]]  # op kind -> outcome ("ok" or exception type) -> count
    faults: Counter[str]
    violations: dict[str, list[Violation]]
    excused: Counter[str]
    figures: dict[str, Any]

    @property
    def ok(self) -> bool:
        return not any(self.violations.values())

    def summary(self) -> dict[str, Any]:
        return {
            "seed": self.config.get("seed"),
            "mode": self.config.get("mode"),
            "ops": {kind: dict(c) for kind, c in self.ops.items()},
            "faults": dict(self.faults),
            "violations": {name: len(v) for name, v in self.violations.items()},
            "excused": dict(self.excused),
            "figures": self.figures,
        }


def _overlap(intervals: Iterable[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in intervals)


def _hits(intervals: Iterable[tuple[float, float]], a: float, b: float) -> bool:
    return any(x <= b and a <= y for x, y in intervals)


def _at(intervals: Iterable[tuple[float, float]], t: float) -> bool:
    return any(x <= t <= y for x, y in intervals)


def run_of(value: Any) -> str | None:
    """The run id a received value names (a stream: its first chunk's)."""
    if isinstance(value, list):
        value = value[0] if value else None
    if isinstance(value, dict) and {"w", "p", "n"} <= value.keys():
        return f"w{value['w']}.{value['p']}.{value['n']}"
    return None


class Faults:
    """The nemesis log as intervals: when each process was stopped, when it died, when each
    worker's link was cut or slow, when the server was out."""

    def __init__(self, records: list[dict[str, Any]], t_end: float) -> None:
        self.counts: Counter[str] = Counter()
        self.stopped: dict[int, list[tuple[float, float]]] = defaultdict(list)
        self.death: dict[int, float] = {}
        self.link: dict[int, list[tuple[float, float]]] = defaultdict(list)
        self.server: list[tuple[float, float]] = []  # restarts and failovers, down to up
        self.restarts: list[float] = []
        self.failovers: list[tuple[float, float]] = []
        self.end = t_end
        open_stop: dict[int, float] = {}
        open_link: dict[tuple[int, str], float] = {}
        down: float | None = None
        failover: float | None = None
        last = t_end
        for r in sorted(records, key=lambda r: r["t"]):
            kind, t = r["kind"], r["t"]
            last = max(last, t)
            if kind in ("kill", "stop", "server-down", "failover", "cut", "slow"):
                self.counts[kind + ("-owner" if r.get("run") else "")] += 1
            if kind == "stop":
                open_stop[r["pid"]] = t
            elif kind == "cont":
                self.stopped[r["pid"]].append((open_stop.pop(r["pid"], t), t))
            elif kind in ("kill", "straggler-kill"):
                self.death[r["pid"]] = t
                if r["pid"] in open_stop:
                    self.stopped[r["pid"]].append((open_stop.pop(r["pid"]), t))
            elif kind in ("cut", "slow"):
                open_link[(r["w"], kind)] = t
            elif kind in ("heal", "fast"):
                begun = open_link.pop((r["w"], "cut" if kind == "heal" else "slow"), t)
                self.link[r["w"]].append((begun, t))
            elif kind == "server-down":
                down = t
                self.restarts.append(t)
            elif kind == "server-up" and down is not None:
                self.server.append((down, t))
                down = None
            elif kind == "failover":
                failover = t
            elif kind == "cluster-settled" and failover is not None:
                self.server.append((failover, t))
                self.failovers.append((failover, t))
                failover = None
        for pid, t in open_stop.items():
            self.stopped[pid].append((t, last))
        for (w, _kind), t in open_link.items():
            self.link[w].append((t, last))
        if down is not None:
            self.server.append((down, last))
        if failover is not None:
            self.server.append((failover, last))
            self.failovers.append((failover, last))

    def hit(self, run: Run, a: float, b: float) -> str | None:
        """The fault that hit ``run``'s process, link or server between ``a`` and ``b``."""
        death = self.death.get(run.pid)
        if death is not None and a <= death <= b:
            return "killed"
        if _hits(self.stopped.get(run.pid, ()), a, b):
            return "stopped"
        if _hits(self.link.get(run.w, ()), a, b):
            return "link"
        if _hits(self.server, a, b):
            return "server"
        return None


def load(folder: Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Run], Faults]:
    config = json.loads((folder / "config.json").read_text())
    ops = read_all(folder, "ops")
    runs: dict[str, Run] = {}
    for r in read_all(folder, "runs"):
        if r["ev"] in ("start", "set"):
            w, pid, _n = r["run"][1:].split(".")
            runs[r["run"]] = Run(
                r["run"], r["key"], r["kind"], int(w), int(pid), r["t"], of=r.get("of")
            )
        elif r["run"] in runs:
            run = runs[r["run"]]
            if r["ev"] == "tok":
                run.tok = r["tok"]
            elif r["ev"] == "end":
                run.end = r["t"]
            elif r["ev"] == "cancelled":
                run.cancelled = r["t"]
    nemesis = list(read(folder / "nemesis.jsonl")) if (folder / "nemesis.jsonl").exists() else []
    return config, ops, runs, Faults(nemesis, config["t_end"])


def check(folder: Path) -> Report:
    config, ops, runs, faults = load(folder)
    cache = config["cache"]
    lease, timeout = cache["lease"], cache["timeout"]
    bound = 2 * (timeout + lease) + 1.0
    slack = config["slack_s"]
    violations: dict[str, list[Violation]] = {name: [] for name in CHECKS}
    excused: Counter[str] = Counter()

    # 1. the wait bound, the caller's own stopped time excluded
    waits: list[float] = []
    for op in ops:
        stopped = _overlap(faults.stopped.get(op["pid"], ()), op["t0"], op["t1"])
        waited = op["t1"] - op["t0"] - stopped
        waits.append(waited)
        if waited > bound + slack:
            violations["bound"].append(
                Violation(
                    "bound",
                    f"{op['op']} {op['key']!r} waited {waited:.2f} s "
                    f"(bound {bound:g} s + {slack:g} s slack; {stopped:.2f} s stopped)",
                    [op],
                )
            )

    # 2. provenance
    reads = [op for op in ops if op["op"] in READS and op["ok"] and op.get("value")]
    for op in reads:
        problem = _provenance(op, runs)
        if problem:
            rid = run_of(op["value"])
            evidence = [op] + ([runs[rid]] if rid in runs else [])
            violations["provenance"].append(Violation("provenance", problem, evidence))

    # 3. fresh after invalidate/set
    # When each run's value was certainly stored by: its owner's call returned with it (or
    # the owner's process died); a set: when that set() returned.
    stored_by: dict[str, float] = {}
    for op in ops:
        if op["op"] == "set" and op["ok"]:
            stored_by[run_of(op["set"]) or ""] = op["t1"]
    for op in reads:
        rid = run_of(op["value"])
        run = runs.get(rid or "")
        if run is not None and run.kind != "set" and op["pid"] == run.pid:
            stored_by[run.id] = min(stored_by.get(run.id, op["t1"]), op["t1"])
    for run in runs.values():
        death = faults.death.get(run.pid)
        if run.kind != "set" and death is not None:
            stored_by[run.id] = min(stored_by.get(run.id, death), death)
    invalidations: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for op in ops:
        if op["op"] in ("invalidate", "set") and op["ok"]:
            invalidations[op["key"]].append(op)
    asked = _asked(reads)
    for op in reads:
        rid = run_of(op["value"])
        run = runs.get(rid or "")
        if run is None or rid not in stored_by:
            continue
        began = asked[id(op)]
        for inv in invalidations.get(op["key"], ()):
            if inv["t1"] >= began or run_of(inv.get("set")) == rid:
                continue
            if run.kind == "set":
                replaced = stored_by[run.id] < inv["t0"]
            else:
                replaced = run.start < inv["t0"] and stored_by[run.id] < began
            if not replaced:
                continue
            excuse = _excuse(op, run, inv, faults)
            if excuse:
                excused["fresh: " + excuse] += 1
            else:
                violations["fresh"].append(
                    Violation(
                        "fresh",
                        f"{op['op']} {op['key']!r} started {op['t0'] - inv['t1']:.3f} s after "
                        f"{inv['op']} returned, and got {rid}, which it replaced",
                        [op, inv, run],
                    )
                )
            break

    # 3b. no read goes back to an older value once a newer one was read: the newer one is a
    # loader run (of a server flight) or a set(), by when it started
    by_key_reads: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for op in reads:
        if run_of(op["value"]) in runs:
            by_key_reads[op["key"]].append(op)
    for key, key_reads in by_key_reads.items():
        finished = [(op["t1"], runs[run_of(op["value"]) or ""]) for op in key_reads]
        finished = [(t1, r) for t1, r in finished if r.kind == "set" or r.tok is not None]
        for op in key_reads:
            older = runs[run_of(op["value"]) or ""]
            began = asked[id(op)]
            if older.kind == "set" or older.tok is None or stored_by.get(older.id, began) >= began:
                continue  # (a set's value has no start to compare; or it may follow the flight)
            newest = max(
                (r for t1, r in finished if t1 < began), key=lambda r: r.start, default=None
            )
            if newest is None or newest.start <= older.start:
                continue
            excuse = _excuse_order(op, older, newest, began, invalidations.get(key, []), faults)
            if excuse:
                excused["order: " + excuse] += 1
                continue
            violations["order"].append(
                Violation(
                    "order",
                    f"{op['op']} {key!r} got {older.id} after a read had finished with "
                    f"{newest.id}, which started {newest.start - older.start:.3f} s later",
                    [op, older, newest],
                )
            )

    # 4. loader runs <= flights + owner faults
    received = {run_of(op["value"]) for op in reads}
    loads = [r for r in runs.values() if r.kind != "set"]
    faulted: dict[str, str] = {}
    for run in loads:
        why = faults.hit(run, run.start - AROUND_S, _finish(run, faults) + AROUND_S)
        if why is None and _finish(run, faults) >= faults.end:
            why = "shutdown"  # still running when the soak ended
        if why is None and run.tok is None:
            why = "fail-open"  # a run of this process alone: no flight on the server had it
        if why:
            faulted[run.id] = why
    # A run that took over from an owner hit by a fault may find its callers gone (stream
    # callers that had the first owner's chunks got StreamRestarted), and go unread.
    takeover_s = lease + 1.0
    for run in loads:
        if run.id in received or run.id in faulted:
            continue
        if any(
            other.id in faulted
            and other.key == run.key
            and other.start < run.start <= _finish(other, faults) + takeover_s
            for other in loads
        ):
            continue
        violations["runs"].append(
            Violation(
                "runs",
                f"run {run.id} of {run.key!r}: no caller got its value, and no fault hit it",
                [run],
            )
        )

    # Runs hit by no fault are the flights: two of one key must never overlap in time.
    clean_by_key: dict[str, list[Run]] = defaultdict(list)
    for run in loads:
        if run.id not in faulted:
            clean_by_key[run.key].append(run)
    for key_runs in clean_by_key.values():
        key_runs.sort(key=lambda r: r.start)
        before = key_runs[0]
        for after in key_runs[1:]:
            if after.start < _finish(before, faults):
                violations["runs"].append(
                    Violation(
                        "runs",
                        f"two runs of {before.key!r} at once, neither hit by a fault",
                        [before, after],
                    )
                )
            if _finish(after, faults) > _finish(before, faults):
                before = after  # the run that ends last is the one later runs must follow
    flights = sum(len(v) for v in clean_by_key.values())

    # 5. exceptions outside the FlightError tree
    for op in ops:
        exc = op.get("exc")
        if exc and not exc["flight"]:
            violations["exceptions"].append(
                Violation("exceptions", f"{op['op']} raised {exc['module']}.{exc['type']}", [op])
            )

    outcome: dict[str, Counter[str]] = defaultdict(Counter)
    for op in ops:
        outcome[op["op"]]["ok" if op["ok"] else op["exc"]["type"]] += 1
    waits.sort()
    figures = {
        "operations": len(ops),
        "loader_runs": len(loads),
        "flights": flights,
        "owner_faults": len(faulted),
        "owner_faults_by_kind": dict(Counter(faulted.values())),
        "runs_received": len([r for r in loads if r.id in received]),
        "invalidations": sum(len(v) for v in invalidations.values()),
        "wait_p50_s": round(waits[len(waits) // 2], 3) if waits else None,
        "wait_max_s": round(waits[-1], 3) if waits else None,
        "bound_s": bound,
    }
    return Report(config, dict(outcome), faults.counts, violations, excused, figures)


def _finish(run: Run, faults: Faults) -> float:
    """When a run ended: returned, cancelled, its process killed, or the soak over."""
    return run.end or run.cancelled or faults.death.get(run.pid) or faults.end


def _asked(reads: list[dict[str, Any]]) -> dict[int, float]:
    """When each read's answer was asked for: a call that found an earlier call of its own
    process, same key, still waiting (and got the same answer) may have joined it (local
    single-flight), so its answer may have been asked for when that one started."""
    asked: dict[int, float] = {}
    waiting: dict[tuple[int, str, str], list[dict[str, Any]]] = defaultdict(list)
    for op in sorted(reads, key=lambda o: o["t0"]):
        began = op["t0"]
        slot = (op["pid"], op["key"], op["op"] if op["op"] == "stream" else "do")
        for other in waiting[slot]:
            if other["t1"] >= op["t0"] and run_of(other["value"]) == run_of(op["value"]):
                began = min(began, asked[id(other)])
        waiting[slot] = [o for o in waiting[slot] if o["t1"] >= op["t0"]] + [op]
        asked[id(op)] = began
    return asked


def _provenance(op: dict[str, Any], runs: dict[str, Run]) -> str | None:
    value, key = op["value"], op["key"]
    rid = run_of(value)
    if rid is None:
        return f"{op['op']} {key!r} got a value naming no run: {value!r:.200}"
    if op["op"] == "stream":
        if not isinstance(value, list):
            return f"stream {key!r} got a non-list value"
        first = value[0]
        for i, chunk in enumerate(value):
            if run_of(chunk) != rid or chunk.get("i") != i or chunk.get("of") != first.get("of"):
                return f"stream {key!r}: chunk {i} is not chunk {i} of run {rid}"
        if len(value) != first.get("of"):
            return f"stream {key!r}: {len(value)} chunks of run {rid}'s {first.get('of')}"
        value = first
    if value.get("k") != key:
        return f"{op['op']} {key!r} got a value made for {value.get('k')!r} ({rid})"
    run = runs.get(rid)
    if run is None:
        return f"{op['op']} {key!r} got {rid}, which no loader, producer or set() made"
    if run.key != key:
        return f"{op['op']} {key!r} got {rid}, a run of {run.key!r}"
    if run.kind == "set":
        if run.start > op["t1"]:
            return f"{op['op']} {key!r} got {rid} before that set() began"
        return None
    if (op["op"] == "stream") != (run.kind == "stream"):
        return f"{op['op']} {key!r} got {rid}, a {run.kind} run"
    if run.end is None:
        return f"{op['op']} {key!r} got {rid}, whose loader never finished"
    if run.end > op["t1"]:
        return f"{op['op']} {key!r} returned {rid} before its loader finished"
    if value.get("tok") != run.tok:
        return f"{op['op']} {key!r} got {rid} with token {value.get('tok')}, not {run.tok}"
    return None


def _excuse_order(
    op: dict[str, Any],
    older: Run,
    newest: Run,
    began: float,
    invalidations: list[dict[str, Any]],
    faults: Faults,
) -> str | None:
    """What explains a read of ``older`` after ``newest`` was read, if anything does.

    A newer run starts only after the older run's result left the store: by expiry (no lease
    outlives it), or by an invalidation, which near caches may still be serving until it
    returns. Else as for ``fresh``: failovers, and restarts the reader could not hear."""
    for inv in invalidations:
        if inv["t0"] <= newest.start and inv["t1"] > began:
            return "invalidation still under way"
    if _hits(faults.failovers, older.start - 1.0, op["t1"]):
        return "failover (replication is asynchronous)"
    for t in faults.restarts:
        if older.start <= t <= began and (
            _at(faults.stopped.get(op["pid"], ()), t) or _at(faults.link.get(op["w"], ()), t)
        ):
            return "server restart the reader could not hear"
    return None


def _excuse(op: dict[str, Any], run: Run, inv: dict[str, Any], faults: Faults) -> str | None:
    """A documented limit of the library that explains a stale read, if one does."""
    if run.kind != "set" and run.tok is None and run.pid == op["pid"]:
        return "fail-open value served by its own process"
    since = min(run.start, inv["t0"]) - 1.0
    if _hits(faults.failovers, since, op["t1"]):
        return "failover (replication is asynchronous)"
    for t in faults.restarts:
        if run.start <= t <= inv["t1"] and (
            _at(faults.stopped.get(op["pid"], ()), t) or _at(faults.link.get(op["w"], ()), t)
        ):
            return "server restart the reader could not hear"
    return None
