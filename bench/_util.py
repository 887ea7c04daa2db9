"""Small helpers shared by the bench phases: percentiles, the server's command counters, and
``python -m`` subprocesses started from the repository root."""

from __future__ import annotations

import asyncio
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Commands the bench's own control connection sends; never counted as the library's.
CONTROL_COMMANDS = frozenset({"info", "echo", "client|list", "monitor"})
# Commands a client sends when it opens a connection, not per call.
SETUP_COMMANDS = frozenset({"hello", "client|setinfo", "client|setname", "auth", "select"})


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


SPREAD_STEP = 7919  # a prime: key i's place in a spread is i * SPREAD_STEP mod keys


def spread_share(i: int, keys: int) -> float:
    """Key ``i``'s share (0..1) of a spread of ``keys`` ends: the keys' ends spread evenly
    over it and mixed, so neighbouring keys (claimed in the same wave) end apart."""
    return (i * SPREAD_STEP % keys) / keys


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": max(values) if values else math.nan,
    }


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def command_calls(info: dict[str, Any]) -> dict[str, int]:
    """``INFO commandstats`` as {command: calls}, e.g. {"evalsha": 12, "client|setinfo": 2}."""
    out: dict[str, int] = {}
    for name, stats in info.items():
        if name.startswith("cmdstat_") and isinstance(stats, dict):
            out[name[len("cmdstat_") :]] = int(stats.get("calls", 0))
    return out


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    names = set(before) | set(after)
    out = {n: after.get(n, 0) - before.get(n, 0) for n in names}
    return {n: v for n, v in sorted(out.items()) if v}


async def python_module(module: str, *args: str, **options: Any) -> asyncio.subprocess.Process:
    """``python -m <module> <args>`` with this interpreter, run from the repository root;
    ``options`` go to :func:`asyncio.create_subprocess_exec` (pipes, env, limit)."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, *args, cwd=str(ROOT), **options
    )
