"""Real OS processes for multi-process tests: each runs tests/helpers/worker.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("worker.py")
SRC = Path(__file__).resolve().parents[2] / "src"


@dataclass
class Worker:
    proc: subprocess.Popen[str]
    name: str
    report: dict[str, Any] | None = None
    stderr: str = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> dict[str, Any] | None:
        """The worker's JSON report (None if it died); kills it if it overruns ``timeout``."""
        try:
            out, err = self.proc.communicate(
                input="", timeout=timeout
            )  # closes stdin: releases a holder
        except subprocess.TimeoutExpired as exc:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(
                f"worker {self.name} overran {timeout} s; stderr:\n{err[-3000:]}"
            ) from exc
        self.stderr = err
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if lines:
            self.report = json.loads(lines[-1])
        return self.report

    def read_report(self) -> dict[str, Any]:
        """The report of a worker started with hold=True, which then keeps its connections."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("{"):
            err = ""
            if not line and self.proc.stderr is not None:  # it ended: say why
                self.proc.wait(10)
                err = self.proc.stderr.read()[-3000:]
            raise AssertionError(f"worker {self.name} gave no report: {line!r}\n{err}")
        self.report = json.loads(line)
        return self.report


@dataclass
class Fleet:
    """Worker processes started together; everything is killed on exit."""

    workers: list[Worker] = field(default_factory=list)

    def start(self, name: str, **config: Any) -> Worker:
        env = dict(os.environ, PYTHONPATH=str(SRC), PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        w = Worker(proc, name)
        self.workers.append(w)
        return w

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.kill()
            if not w.proc.stdin or not w.proc.stdin.closed:
                w.proc.communicate(timeout=10)  # reaps it and closes its pipes


def markers(directory: Path, prefix: str) -> list[Path]:
    return sorted(directory.glob(f"{prefix}-*"))


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.01) -> Any:
    """Poll a local condition (files, process state) until true; the tests' only polling."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
