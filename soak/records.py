"""The soak's records: JSON lines, one file per worker process and kind, and the nemesis log.

Every record carries ``time.monotonic()`` instants, which all processes of one Linux machine
share. Files, in the run's directory:

- ``ops-w<i>-<pid>.jsonl``: one line per finished operation of a worker process (``op``,
  ``key``, ``t0``/``t1``, ``ok``, ``value`` or ``exc``, ``how`` for invalidations);
- ``runs-w<i>-<pid>.jsonl``: what the loaders, producers and ``set()`` calls of that process
  made (``ev``: ``start``, ``tok``, ``end``, ``cancelled``, ``set``), written when it
  happens, so that a process killed mid-loader still leaves its run's start behind;
- ``nemesis.jsonl``: every fault, with its time;
- ``config.json``: the run's settings, seed and times.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson


class Journal:
    """An append-only JSON-lines file; each record is one ``write`` system call, so a
    SIGKILL leaves whole lines behind (and nothing buffered in the process is lost)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, **record: Any) -> None:
        os.write(self._fd, orjson.dumps(record) + b"\n")

    def close(self) -> None:
        os.close(self._fd)


def read(path: Path) -> Iterator[dict[str, Any]]:
    """The records of one file; a torn last line (if any) is skipped."""
    with path.open("rb") as f:
        for line in f:
            if line.endswith(b"\n"):
                yield orjson.loads(line)


def read_all(directory: Path, prefix: str) -> list[dict[str, Any]]:
    """Every record of every ``<prefix>-*.jsonl`` file in ``directory``."""
    out: list[dict[str, Any]] = []
    for path in sorted(directory.glob(f"{prefix}-*.jsonl")):
        out.extend(read(path))
    return out
