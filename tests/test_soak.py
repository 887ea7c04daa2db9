"""The fault soak (``soak/``, ``make soak``): its checker, and a short run of it.

The checker is shown to catch what it claims twice over: on small hand-made records (one
per check), and end to end, where a deliberately broken build (``--mutant skip-fence``: the
workers remove the token check from ``complete_flight`` at run time) must make a short soak
with a SIGSTOP-heavy nemesis fail, while the same soak of the real library passes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from soak import checker
from soak.records import Journal

ROOT = Path(__file__).resolve().parents[1]  # where `python -m soak` runs

# -- the checker on hand-made records ------------------------------------------------------

T = 1000.0  # a monotonic instant the made-up records start at
CACHE = {"lease": 2.0, "timeout": 3.0}  # a wait bound of 11 s


def records(
    folder: Path,
    ops: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    faults: list[dict[str, Any]] | None = None,
) -> checker.Report:
    (folder / "config.json").write_text(
        json.dumps({"cache": CACHE, "slack_s": 5.0, "t_end": T + 100, "seed": 0})
    )
    by_pid: dict[int, tuple[Journal, Journal]] = {}
    for pid in {op["pid"] for op in ops} | {int(r["run"].split(".")[1]) for r in runs}:
        by_pid[pid] = (
            Journal(folder / f"ops-w{pid % 10}-{pid}.jsonl"),
            Journal(folder / f"runs-w{pid % 10}-{pid}.jsonl"),
        )
    for op in ops:
        by_pid[op["pid"]][0].write(**op)
    for r in runs:
        by_pid[int(r["run"].split(".")[1])][1].write(**r)
    nemesis = Journal(folder / "nemesis.jsonl")
    for f in faults or []:
        nemesis.write(**f)
    return checker.check(folder)


def value(pid: int, n: int, key: str = "k", tok: int | None = 7) -> dict[str, Any]:
    return {"k": key, "w": pid % 10, "p": pid, "n": n, "tok": tok}


def run(
    pid: int, n: int, start: float, end: float | None, key: str = "k", tok: int = 7
) -> list[dict[str, Any]]:
    rid = f"w{pid % 10}.{pid}.{n}"
    out = [
        {"ev": "start", "run": rid, "key": key, "kind": "do", "t": T + start},
        {"ev": "tok", "run": rid, "tok": tok, "t": T + start},
    ]
    if end is not None:
        out.append({"ev": "end", "run": rid, "t": T + end})
    return out


def op(kind: str, pid: int, t0: float, t1: float, key: str = "k", **more: Any) -> dict[str, Any]:
    return {
        "op": kind,
        "key": key,
        "pid": pid,
        "w": pid % 10,
        "t0": T + t0,
        "t1": T + t1,
        "ok": "exc" not in more,
        **more,
    }


def test_clean_records_pass(tmp_path: Path) -> None:
    report = records(
        tmp_path,
        [op("do", 11, 0.0, 0.5, value=value(11, 1)), op("do", 12, 0.1, 0.5, value=value(11, 1))],
        run(11, 1, 0.05, 0.45),
    )
    assert report.ok, report.violations


@pytest.mark.parametrize(
    ("check", "ops", "runs", "faults"),
    [
        pytest.param(
            "bound",
            [op("do", 11, 0.0, 17.0, value=value(11, 1))],
            run(11, 1, 16.0, 16.5),
            [],
            id="a caller waited 17 s (bound 11 + 5)",
        ),
        pytest.param(
            "provenance",
            [op("do", 12, 0.0, 0.5, value=value(11, 1))],
            run(11, 1, 0.1, None),
            [],
            id="a follower got the value of a loader that never finished",
        ),
        pytest.param(
            "provenance",
            [op("do", 12, 0.0, 0.5, key="other", value=value(11, 1))],
            run(11, 1, 0.1, 0.4),
            [],
            id="a value of another key",
        ),
        pytest.param(
            "fresh",
            [
                op("do", 11, 0.0, 0.5, value=value(11, 1)),
                op("invalidate", 12, 1.0, 1.1, how="acked"),
                op("do", 13, 2.0, 2.01, value=value(11, 1)),
            ],
            run(11, 1, 0.1, 0.4),
            [],
            id="a read after invalidate returned got the value it deleted",
        ),
        pytest.param(
            "order",
            [
                op("do", 11, 0.0, 4.5, value=value(11, 1)),
                op("do", 12, 3.0, 3.5, value=value(12, 1)),
                op("do", 13, 5.0, 5.01, value=value(11, 1)),
            ],
            run(11, 1, 0.1, 4.4) + run(12, 1, 3.1, 3.4),
            [
                {"t": T + 0.2, "kind": "stop", "w": 1, "pid": 11},
                {"t": T + 4.3, "kind": "cont", "w": 1, "pid": 11},
            ],
            id="a stale owner's value after the new owner's was read",
        ),
        pytest.param(
            "runs",
            [op("do", 11, 0.0, 0.5, value=value(11, 1))],
            run(11, 1, 0.1, 0.4) + run(12, 1, 1.0, 1.4, tok=8),
            [],
            id="a loader run nobody got, with no fault",
        ),
        pytest.param(
            "runs",
            [
                op("do", 11, 0.0, 0.5, value=value(11, 1)),
                op("do", 12, 0.0, 0.5, value=value(12, 1, tok=8)),
            ],
            run(11, 1, 0.1, 0.4) + run(12, 1, 0.2, 0.45, tok=8),
            [],
            id="two runs of one key at once, with no fault",
        ),
        pytest.param(
            "exceptions",
            [
                op(
                    "do",
                    11,
                    0.0,
                    0.5,
                    exc={"type": "OSError", "module": "builtins", "flight": False},
                )
            ],
            [],
            [],
            id="a redis-py exception reached the caller",
        ),
    ],
)
def test_each_check_catches_its_case(
    tmp_path: Path, check: str, ops: Any, runs: Any, faults: Any
) -> None:
    report = records(tmp_path, ops, runs, faults)
    found = {name: len(v) for name, v in report.violations.items() if v}
    assert list(found) == [check], found


def test_a_stopped_callers_own_time_is_not_counted(tmp_path: Path) -> None:
    report = records(
        tmp_path,
        [op("do", 11, 0.0, 17.0, value=value(11, 1))],
        run(11, 1, 16.0, 16.5),
        [
            {"t": T + 1.0, "kind": "stop", "w": 1, "pid": 11},
            {"t": T + 9.0, "kind": "cont", "w": 1, "pid": 11},
        ],
    )
    assert report.ok, report.violations


# -- a short soak, of the library and of a broken build -----------------------------------

SHORT = ["--seconds", "12", "--workers", "5", "--nemesis", "stops", "--seed", "7"]


def soak(folder: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    folder.mkdir(parents=True, exist_ok=True)
    summary = folder / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "soak", *SHORT, "--json", str(summary), "--dir", str(folder), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
    )
    found = json.loads(summary.read_text()) if summary.exists() else {}
    return proc.returncode, found, proc.stdout[-6000:] + proc.stderr[-3000:]


@pytest.mark.timeout(60)
def test_the_short_soak_finds_no_violation(tmp_path: Path) -> None:
    code, summary, output = soak(tmp_path)
    assert code == 0, output
    assert summary["faults"].get("stop-owner", 0) >= 2, output  # owners were stopped mid-loader
    assert summary["figures"]["owner_faults"] >= 2, output
    assert summary["ops"]["do"]["ok"] >= 50, output


@pytest.mark.timeout(280)
def test_the_soak_catches_a_complete_flight_without_its_token_check(tmp_path: Path) -> None:
    # A stale write becomes visible when an owner wakes with its loader done after its lease
    # lapsed, and an invalidation ran or another owner's value was read meanwhile: one 12 s
    # run shows it about 9 times in 10 on a quiet machine (measured; seeds 7 to 12 all did on
    # 2026-12-03), so a silent run gets another, with another seed. Two silent runs in a row
    # failed CI once, and three did once more (seeds 7 to 9 during a CI run on 2026-12-03,
    # all three caught when run again alone): five make it about 1 in 100,000 at that rate,
    # and 1 in 250 if a loaded machine's were two in three.
    for attempt in range(5):
        code, summary, output = soak(
            tmp_path / str(attempt), "--mutant", "skip-fence", "--seed", str(7 + attempt)
        )
        if code != 0:
            break
    assert code == 1, output
    v = summary["violations"]
    # A stale owner's result was stored over an invalidation or a newer owner's result.
    assert v["fresh"] + v["order"] > 0, output
    assert v["exceptions"] == 0 and v["provenance"] == 0, output
