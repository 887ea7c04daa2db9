"""``flightcache demo``: one question, many processes, the owner killed mid-flight.

The parent starts a private server and ``workers`` processes (:mod:`.demo_worker`); each
fires ``callers`` concurrent ``fc.do(KEY, fake_llm)`` calls at the same moment. The parent
watches the flight with ``inspect``; once the owner's loader has run for a while it kills
the owner with SIGKILL. The owner's lease lapses, one follower takes over and runs the
loader again, and every surviving caller gets that one value. Loader runs are counted by
marker files (a killed process cannot report), everything else from the workers' reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .._backends.embedded import EmbeddedServer
from .._cache import FlightCache
from .._errors import FlightError
from .._waits import within

KEY = "demo: what is relativity?"
NAMESPACE = "demo"
READY_TIMEOUT_S = 10.0
EXIT_TIMEOUT_S = 5.0
POLL_S = 0.02
KILL_AT = 0.4  # kill the owner when its loader is this far through its work
STDOUT_LIMIT = 16 * 1024 * 1024


@dataclass(frozen=True)
class DemoConfig:
    workers: int = 4
    callers: int = 50
    loader_seconds: float = 2.0
    lease: float = 1.5
    kill: bool = True

    @property
    def bound_s(self) -> float:
        """How long the burst may take: two loader runs, two leases, and some slack."""
        return 2 * self.loader_seconds + 2 * self.lease + 4.0


@dataclass
class Worker:
    proc: asyncio.subprocess.Process
    stderr_path: Path
    killed: bool = False
    report: dict[str, Any] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_tail(self) -> str:
        with contextlib.suppress(OSError):
            lines = self.stderr_path.read_text(errors="replace").strip().splitlines()
            return lines[-1] if lines else ""
        return ""


@dataclass
class Outcome:
    config: DemoConfig
    server: str = ""
    server_pid: int = 0
    workers: list[Worker] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    killed_pid: int | None = None
    loader_pids: list[int] = field(default_factory=list)
    elapsed_s: float = 0.0

    def note(self, t0: float, text: str) -> None:
        """Add an event to the timeline, at seconds since ``t0`` (the burst)."""
        self.events.append((time.monotonic() - t0, text))

    # -- derived figures --------------------------------------------------------------------

    @property
    def survivors(self) -> list[Worker]:
        return [w for w in self.workers if not w.killed]

    def calls(self) -> list[Any]:
        return [c for w in self.survivors if w.report for c in w.report["calls"]]

    def latencies(self) -> list[float]:
        return sorted(float(c[0]) for c in self.calls() if isinstance(c, list))

    def errors(self) -> list[str]:
        return [str(c["error"]) for c in self.calls() if isinstance(c, dict)]

    def values(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for w in self.survivors:
            if w.report:
                out.update(w.report["values"])
        return out

    def distinct(self) -> set[str]:
        return {str(c[1]) for c in self.calls() if isinstance(c, list)}

    def stats(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for w in self.survivors:
            for name, n in (w.report or {}).get("stats", {}).items():
                total[name] = total.get(name, 0) + int(n)
        return total

    def value_pid(self) -> int | None:
        values = self.values()
        digests = self.distinct()
        if len(digests) != 1:
            return None
        value = values.get(next(iter(digests)))
        return int(value["pid"]) if isinstance(value, dict) and "pid" in value else None

    @property
    def expected_runs(self) -> int:
        return 2 if self.config.kill else 1

    def problems(self) -> list[str]:
        found = []
        silent = [w.pid for w in self.survivors if w.report is None]
        if silent:
            found.append(f"workers {silent} did not report")
        if self.config.kill and self.killed_pid is None:
            found.append("the owner could not be killed mid-flight")
        expected_calls = len(self.survivors) * self.config.callers
        if len(self.calls()) != expected_calls:
            found.append(f"{len(self.calls())} of {expected_calls} surviving callers reported")
        errors = self.errors()
        if errors:
            found.append(f"{len(errors)} callers failed, e.g. {errors[0]}")
        if len(self.distinct()) != 1:
            found.append(f"{len(self.distinct())} distinct values delivered, not 1")
        if len(self.loader_pids) != self.expected_runs:
            found.append(f"the loader ran {len(self.loader_pids)} times, not {self.expected_runs}")
        return found


# -- running ------------------------------------------------------------------------------


async def _spawn(config: DemoConfig, url: str, tmp: Path, markers: Path, i: int) -> Worker:
    stderr_path = tmp / f"worker-{i}.stderr"
    with stderr_path.open("wb") as err:
        options = {
            "--url": url,
            "--namespace": NAMESPACE,
            "--key": KEY,
            "--callers": config.callers,
            "--loader-seconds": config.loader_seconds,
            "--lease": config.lease,
            "--markers": markers,
            "--bound": config.bound_s - 1.0,  # report a timeout before the parent gives up
        }
        argv = [str(part) for pair in options.items() for part in pair]
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "flightcache._cli.demo_worker",
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
            limit=STDOUT_LIMIT,
        )
    return Worker(proc, stderr_path)


async def _read_event(worker: Worker, event: str) -> dict[str, Any] | None:
    """The next line of ``worker`` that is this event, or None at end of output."""
    assert worker.proc.stdout is not None
    while True:
        line = await worker.proc.stdout.readline()
        if not line:
            return None
        with contextlib.suppress(orjson.JSONDecodeError):
            record = orjson.loads(line)
            if isinstance(record, dict) and record.get("event") == event:
                return record


async def _ready(worker: Worker) -> None:
    try:
        record = await within(_read_event(worker, "ready"), READY_TIMEOUT_S)
    except asyncio.TimeoutError:
        why = f"not ready within {READY_TIMEOUT_S:g} s"
    else:
        if record is not None:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await within(worker.proc.wait(), EXIT_TIMEOUT_S)
        why = f"exited with status {worker.proc.returncode}"
    tail = worker.stderr_tail()
    raise FlightError(
        f"demo worker pid {worker.pid} did not start: {why}" + (f": {tail}" if tail else "")
    )


async def _go(worker: Worker) -> None:
    stdin = worker.proc.stdin
    assert stdin is not None
    with contextlib.suppress(ConnectionError):  # a worker that died since is reported as silent
        stdin.write(b"go\n")
        await within(stdin.drain(), EXIT_TIMEOUT_S)
        stdin.close()


async def _collect(worker: Worker) -> None:
    worker.report = await _read_event(worker, "result")


def _owner_pid(owner_node: str | None) -> int | None:
    """The pid in a node id ``hostname:pid:random``."""
    if not owner_node:
        return None
    parts = owner_node.rsplit(":", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def _loader_started(markers: Path, pid: int) -> bool:
    return any(markers.glob(f"run-{pid}-*"))


async def _watch(
    out: Outcome, fc: FlightCache, markers: Path, t0: float, collectors: list[asyncio.Task[None]]
) -> None:
    """Follow the flight through ``inspect``; kill the first owner mid-flight."""
    config = out.config
    by_pid = {w.pid: w for w in out.workers}
    deadline = t0 + config.bound_s
    tokens: set[int] = set()
    first: tuple[int, int, float] | None = None  # pid, token, when its loader was seen
    while time.monotonic() < deadline and not all(c.done() for c in collectors):
        info = await fc.inspect(KEY)
        now = time.monotonic() - t0  # when this inspect answered
        pid = _owner_pid(info.owner_node)
        if info.state == "running" and info.token is not None and info.token not in tokens:
            tokens.add(info.token)
            out.note(
                t0, f"pid {pid} owns the flight (token {info.token}, {info.followers} waiting)"
            )
        if info.state in ("cached", "error-cached"):
            out.note(t0, f"result {info.state} (ttl {info.result_ttl_ms} ms)")
            return
        if config.kill and out.killed_pid is None and info.state == "running" and pid in by_pid:
            if first is None and _loader_started(markers, pid):
                first = (pid, info.token or 0, now)
            if first and first[0] == pid and first[1] == info.token:
                if now - first[2] >= KILL_AT * config.loader_seconds:
                    victim = by_pid[pid]
                    with contextlib.suppress(ProcessLookupError):
                        victim.proc.send_signal(signal.SIGKILL)
                    victim.killed = True
                    out.killed_pid = pid
                    left = info.lease_left_ms
                    out.note(
                        t0, f"SIGKILL to owner pid {pid}; its lease ({left} ms left) must lapse"
                    )
                    with contextlib.suppress(asyncio.TimeoutError):
                        await within(victim.proc.wait(), EXIT_TIMEOUT_S)
        await asyncio.sleep(POLL_S)  # watch interval: the demo looks for an owner to kill


async def _run(config: DemoConfig) -> Outcome:
    out = Outcome(config)
    server = EmbeddedServer()  # finds the binary first: nothing to clean up if it is missing
    tmp = Path(tempfile.mkdtemp(prefix="flightcache-demo-"))
    markers = tmp / "markers"
    fc: FlightCache | None = None
    start = time.monotonic()
    try:
        markers.mkdir()
        await asyncio.to_thread(server.start)
        out.server, out.server_pid = server.url, server.pid
        out.workers = list(
            await asyncio.gather(
                *(_spawn(config, server.url, tmp, markers, i) for i in range(config.workers))
            )
        )
        started = await asyncio.gather(*(_ready(w) for w in out.workers), return_exceptions=True)
        for failure in started:
            if isinstance(failure, BaseException):
                raise failure
        fc = FlightCache(server.url, namespace=NAMESPACE, lease=config.lease)
        await fc.inspect(KEY)  # connect before the burst
        t0 = time.monotonic()
        await asyncio.gather(*(_go(w) for w in out.workers))
        out.note(t0, f"{config.workers} workers x {config.callers} callers ask at once")
        collectors = [asyncio.ensure_future(_collect(w)) for w in out.workers]
        try:
            await _watch(out, fc, markers, t0, collectors)
            left = max(0.0, t0 + config.bound_s - time.monotonic())
            await asyncio.wait(collectors, timeout=left)
        finally:
            for task in collectors:
                task.cancel()
            await asyncio.gather(*collectors, return_exceptions=True)
        reported = all(w.report for w in out.survivors)
        out.note(t0, "every surviving worker reported" if reported else "gave up waiting")
        out.loader_pids = sorted(int(p.name.split("-")[1]) for p in markers.glob("run-*"))
    finally:
        for w in out.workers:
            if w.proc.returncode is None:
                w.proc.kill()
            with contextlib.suppress(asyncio.TimeoutError, ProcessLookupError):
                await within(w.proc.wait(), EXIT_TIMEOUT_S)
        if fc is not None:
            await fc.aclose()
        await asyncio.to_thread(server.stop)
        shutil.rmtree(tmp, ignore_errors=True)
        out.elapsed_s = time.monotonic() - start
    return out


# -- reporting ----------------------------------------------------------------------------


PCTS = (50, 99, 100)
WORKER_COLUMNS = ["pid", "role", "answered", "coalesced", "follows", "takeovers", "commands"]


def _percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _summary(out: Outcome) -> list[tuple[str, str]]:
    config = out.config
    stats = out.stats()
    lat = out.latencies()
    requests = config.workers * config.callers
    surviving = len(out.survivors) * config.callers
    if out.killed_pid:
        killed = f"pid {out.killed_pid} (SIGKILL mid-flight)"
    else:
        killed = "none: the owner was not caught in time" if config.kill else "none (--no-kill)"
    pids = ", ".join(str(p) for p in out.loader_pids) or "-"
    value_pid = out.value_pid()
    by = f" (produced by pid {value_pid})" if value_pid else ""
    return [
        ("requests", f"{requests} ({config.workers} workers x {config.callers} callers)"),
        ("workers", f"{config.workers} ({len(out.survivors)} survived)"),
        ("owner killed", killed),
        ("loader runs", f"{len(out.loader_pids)} (expected {out.expected_runs}; pids {pids})"),
        ("takeovers", str(stats.get("takeovers", 0))),
        ("answered", f"{len(out.latencies())} of {surviving} surviving callers"),
        ("distinct values delivered", f"{len(out.distinct())}{by}"),
        ("latency p50 / p99 / max", " / ".join(f"{_percentile(lat, p):.3f} s" for p in PCTS)),
        ("coalesced in-process", str(stats.get("coalesced", 0))),
        ("Redis commands (survivors)", str(stats.get("commands", 0))),
        ("server", f"{out.server} (pid {out.server_pid})"),
        ("wall time", f"{out.elapsed_s:.2f} s"),
    ]


def _worker_rows(out: Outcome) -> list[list[str]]:
    value_pid = out.value_pid()
    rows = []
    for w in out.workers:
        if w.killed:
            rows.append([str(w.pid), "killed owner", "-", "-", "-", "-", "-"])
            continue
        stats = (w.report or {}).get("stats", {})
        calls = (w.report or {}).get("calls", [])
        ok = sum(1 for c in calls if isinstance(c, list))
        role = "follower"
        if w.pid == value_pid:
            role = "new owner" if out.killed_pid else "owner"
        if w.report is None:
            role = "no report"
        counters = [str(stats.get(k, 0)) for k in WORKER_COLUMNS[3:]]
        rows.append([str(w.pid), role, f"{ok}/{out.config.callers}", *counters])
    return rows


def _verdict(out: Outcome) -> tuple[bool, str]:
    problems = out.problems()
    everyone = len(out.calls()) == len(out.survivors) * out.config.callers
    same = everyone and len(out.distinct()) == 1 and not out.errors()
    line = "every surviving caller got the same value: " + ("yes" if same else "NO")
    if problems:
        return False, line + "\nFAIL: " + "; ".join(problems)
    return True, line + f"\nOK: loader runs = {len(out.loader_pids)}, as expected"


def _render_rich(out: Outcome) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    console.print("[bold]flightcache demo[/bold]: " + KEY)
    for t, text in out.events:
        console.print(f"  {t:6.3f} s  {text}")
    table = Table(show_header=False, title="what happened", title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for name, value in _summary(out):
        table.add_row(name, value)
    console.print(table)
    per_worker = Table(*WORKER_COLUMNS, title="per worker (fc.stats)", title_justify="left")
    for row in _worker_rows(out):
        per_worker.add_row(*row)
    console.print(per_worker)
    ok, verdict = _verdict(out)
    console.print(verdict, style="green" if ok else "bold red")


def _render_plain(out: Outcome) -> None:
    print(f"flightcache demo: {KEY}")
    for t, text in out.events:
        print(f"  {t:6.3f} s  {text}")
    print()
    summary = _summary(out)
    width = max(len(name) for name, _ in summary)
    for name, value in summary:
        print(f"{name:<{width}}  {value}")
    print()
    rows = [WORKER_COLUMNS, *_worker_rows(out)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(WORKER_COLUMNS))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    print()
    print(_verdict(out)[1])


def render(out: Outcome) -> None:
    try:
        import rich  # noqa: F401
    except ImportError:
        _render_plain(out)
    else:
        _render_rich(out)


def run_demo(config: DemoConfig) -> int:
    """Run the demo, print what happened; 0 when the single-flight promise held, else 1."""
    out = asyncio.run(_run(config))
    render(out)
    return 0 if not out.problems() else 1
