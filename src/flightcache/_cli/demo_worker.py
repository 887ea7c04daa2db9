"""One worker process of ``flightcache demo`` (run as ``python -m flightcache._cli.demo_worker``).

It talks to the parent through lines of JSON: it prints ``{"event": "ready"}`` once its
cache answers, waits for the line ``go`` on stdin, fires ``--callers`` concurrent
``fc.do(key, fake_llm)`` calls, and prints ``{"event": "result", ...}`` with, per caller,
the latency and a digest of the value it got, each distinct value once, and ``fc.stats``.

The fake LLM writes a marker file into ``--markers`` as it starts, so the parent can count
loader runs even in a process that is killed mid-flight.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from .._cache import FlightCache
from .._errors import FlightError
from .._waits import within

ANSWER = (
    "Relativity is two theories by Einstein. Special relativity: the laws of physics are the "
    "same for every observer moving uniformly, and light always travels at the same speed, so "
    "time and space stretch with motion. General relativity: gravity is the curvature of "
    "spacetime by mass and energy."
)
STEP_S = 0.05
GO_TIMEOUT_S = 60.0


def emit(record: dict[str, Any]) -> None:
    sys.stdout.buffer.write(orjson.dumps(record) + b"\n")
    sys.stdout.buffer.flush()


def value_digest(value: Any) -> str:
    return hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def make_loader(seconds: float, markers: Path) -> Any:
    async def fake_llm() -> dict[str, Any]:
        """A slow model: writes its start marker, then "generates" word by word."""
        started = time.time()
        name = f"run-{os.getpid()}-{time.monotonic_ns()}"
        await asyncio.to_thread((markers / name).write_text, f"{os.getpid()} {started}\n")
        words = ANSWER.split()
        steps = max(1, round(seconds / STEP_S))
        out: list[str] = []
        for i in range(steps):
            await asyncio.sleep(seconds / steps)
            out = words[: len(words) * (i + 1) // steps]
        return {"answer": " ".join(out), "pid": os.getpid(), "started": started}

    return fake_llm


async def read_go(timeout: float) -> bool:
    """Wait for ``go`` on stdin without blocking the event loop; False on EOF or timeout."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), sys.stdin
    )
    try:
        line = await within(reader.readline(), timeout)
    except asyncio.TimeoutError:
        return False
    finally:
        transport.close()
    return line.strip() == b"go"


async def run(args: argparse.Namespace) -> int:
    markers = Path(args.markers)
    loader = make_loader(args.loader_seconds, markers)
    fc = FlightCache(
        args.url,
        namespace=args.namespace,
        lease=args.lease,
        timeout=args.loader_seconds * 2 + 1,
    )
    try:
        await fc.inspect(args.key)  # connect now, so the burst measures the flight only
        emit({"event": "ready", "pid": os.getpid(), "node": fc.node_id})
        if not await read_go(GO_TIMEOUT_S):
            return 3
        start = time.monotonic()
        values: dict[str, Any] = {}

        async def one_call() -> Any:
            try:
                value = await fc.do(args.key, loader)
            except FlightError as exc:
                return {"error": f"{type(exc).__name__}: {exc}"}
            digest = value_digest(value)
            values.setdefault(digest, value)
            return [round(time.monotonic() - start, 4), digest]

        try:
            calls = await within(
                asyncio.gather(*(one_call() for _ in range(args.callers))), args.bound
            )
        except asyncio.TimeoutError:
            calls = [{"error": f"no answer within {args.bound:g} s"}] * args.callers
        emit(
            {
                "event": "result",
                "pid": os.getpid(),
                "calls": calls,
                "values": values,
                "stats": fc.stats,
            }
        )
        return 0
    finally:
        await fc.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flightcache._cli.demo_worker")
    parser.add_argument("--url", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--callers", type=int, required=True)
    parser.add_argument("--loader-seconds", type=float, required=True)
    parser.add_argument("--lease", type=float, required=True)
    parser.add_argument("--markers", required=True)
    parser.add_argument("--bound", type=float, required=True, help="seconds to wait at most")
    args = parser.parse_args(argv)
    try:
        return asyncio.run(run(args))
    except FlightError as exc:
        print(f"demo worker {os.getpid()}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
