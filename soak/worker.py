"""One worker process of the soak: ``python -m soak.worker '<json config>'``.

A few client tasks share one ``FlightCache`` and call ``do()``, ``get()``, ``stream()``,
``invalidate()`` and ``set()`` on a small set of keys until the run's end, each operation
recorded (``ops-*.jsonl``). Every value carries its provenance: the key, the worker, the
process, the flight's token when the loader could see it, and a counter of this process;
the loaders, producers and ``set()`` calls record what they made (``runs-*.jsonl``), so the
checker can tell who produced each value a caller received.

Config keys: ``url``, ``namespace``, ``dir``, ``worker``, ``incarnation``, ``seed``,
``clients``, ``cache`` (FlightCache settings), ``do_keys``, ``stream_keys``, ``weights``
(per operation), ``loader_s``, ``chunks``, ``chunk_s``, ``ttl_s``, ``think_s`` (ranges),
``drain_s``, ``mutant`` (or null). The run's end comes from ``go.json`` in ``dir``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import sys
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from flightcache import MISSING, FlightCache, FlightError

from . import mutants
from .records import Journal

Loader = Callable[[], Awaitable[Any]]


def describe(exc: BaseException) -> dict[str, Any]:
    """An exception as the checker sees it: type, module, whether it is a FlightError (and,
    when it is not, where it came from, for the bug report)."""
    out = {
        "type": type(exc).__name__,
        "module": type(exc).__module__,
        "flight": isinstance(exc, FlightError),
        "msg": str(exc)[:300],
    }
    if not out["flight"]:
        out["where"] = "".join(traceback.format_exception(exc)[-12:])[-3000:]
    return out


class Worker:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.w = int(cfg["worker"])
        self.pid = os.getpid()
        folder = Path(cfg["dir"])
        self.ops = Journal(folder / f"ops-w{self.w}-{self.pid}.jsonl")
        self.runs = Journal(folder / f"runs-w{self.w}-{self.pid}.jsonl")
        self.counter = itertools.count(1)
        self.fc = FlightCache(cfg["url"], namespace=cfg["namespace"], **cfg["cache"])
        self.t_end = 0.0

    def run_id(self, n: int) -> str:
        return f"w{self.w}.{self.pid}.{n}"

    def mark(self, n: int, key: str, tok: int | None) -> dict[str, Any]:
        """A value's provenance: its key, this worker and process, the flight's token,
        and this process's counter (worker, process and counter name the run)."""
        return {"k": key, "w": self.w, "p": self.pid, "n": n, "tok": tok}

    async def token(self, key: str) -> int | None:
        """The token of the flight this process owns for ``key``, as the server says; None
        when it cannot tell (no answer in time, or not ours: a fail-open run, for one)."""
        try:
            info = await asyncio.wait_for(self.fc.inspect(key), 0.5)
        except (FlightError, asyncio.TimeoutError):
            return None
        if info.state == "running" and info.owner_node == self.fc.node_id:
            return info.token
        return None

    def loader(self, key: str, rng: random.Random) -> Loader:
        async def load() -> dict[str, Any]:
            n = next(self.counter)
            run = self.run_id(n)
            self.runs.write(ev="start", run=run, key=key, kind="do", t=time.monotonic())
            try:
                tok = await self.token(key)
                self.runs.write(ev="tok", run=run, tok=tok, t=time.monotonic())
                # One timer: shorter than a third of the lease, so an owner frozen in it
                # wakes with its loader due before its heartbeat (the race of a stale write).
                await asyncio.sleep(rng.uniform(*self.cfg["loader_s"]))
            except asyncio.CancelledError:
                self.runs.write(ev="cancelled", run=run, t=time.monotonic())
                raise
            self.runs.write(ev="end", run=run, t=time.monotonic())
            return self.mark(n, key, tok)

        return load

    def producer(self, key: str, rng: random.Random) -> Callable[[], AsyncIterator[Any]]:
        async def produce() -> AsyncIterator[Any]:
            n = next(self.counter)
            run = self.run_id(n)
            count = rng.randint(*self.cfg["chunks"])
            self.runs.write(
                ev="start", run=run, key=key, kind="stream", t=time.monotonic(), of=count
            )
            try:
                tok = await self.token(key)
                self.runs.write(ev="tok", run=run, tok=tok, t=time.monotonic())
                for i in range(count):
                    await asyncio.sleep(rng.uniform(*self.cfg["chunk_s"]))
                    yield {**self.mark(n, key, tok), "i": i, "of": count}
            except (asyncio.CancelledError, GeneratorExit):
                self.runs.write(ev="cancelled", run=run, t=time.monotonic())
                raise
            self.runs.write(ev="end", run=run, t=time.monotonic())

        return produce

    async def op(self, c: int, rng: random.Random) -> None:
        weights = self.cfg["weights"]
        kind = rng.choices(list(weights), list(weights.values()))[0]
        keys = self.cfg["stream_keys"] if kind == "stream" else self.cfg["do_keys"]
        if kind == "invalidate":
            keys = self.cfg["do_keys"] + self.cfg["stream_keys"]
        key = rng.choice(keys)
        ttl = rng.uniform(*self.cfg["ttl_s"])
        rec: dict[str, Any] = {"op": kind, "key": key, "c": c, "pid": self.pid, "w": self.w}
        t0 = time.monotonic()
        try:
            if kind == "do":
                rec["value"] = await self.fc.do(key, self.loader(key, rng), ttl=ttl)
            elif kind == "get":
                got = await self.fc.get(key)
                rec["value"] = None if got is MISSING else got
            elif kind == "stream":
                chunks: list[Any] = []
                rec["value"] = chunks
                async for chunk in self.fc.stream(key, self.producer(key, rng), ttl=ttl):
                    chunks.append(chunk)
            elif kind == "invalidate":
                inv = await self.fc.invalidate(key)
                rec.update(how=inv.how, nodes=inv.nodes, acked=inv.acked)
            elif kind == "set":
                n = next(self.counter)
                value = {**self.mark(n, key, None), "set": 1}
                self.runs.write(ev="set", run=self.run_id(n), key=key, kind="set", t=t0)
                rec["set"] = value
                inv = await self.fc.set(key, value, ttl=ttl)
                rec.update(how=inv.how, nodes=inv.nodes, acked=inv.acked)
            rec["ok"] = True
        except Exception as exc:  # recorded for the checker to judge
            rec["ok"] = False
            rec["exc"] = describe(exc)
        rec["t0"], rec["t1"] = t0, time.monotonic()
        self.ops.write(**rec)

    async def client(self, c: int) -> None:
        rng = random.Random(f"{self.cfg['seed']}:{self.w}:{self.cfg['incarnation']}:{c}")
        while time.monotonic() < self.t_end:
            await self.op(c, rng)
            await asyncio.sleep(rng.uniform(*self.cfg["think_s"]))

    async def main(self) -> None:
        folder = Path(self.cfg["dir"])
        with contextlib.suppress(Exception):  # connect before the first recorded call
            await asyncio.wait_for(self.fc.get("soak:warm-up"), 5)
        (folder / f"ready-w{self.w}-{self.pid}").touch()
        go = folder / "go.json"
        while not go.exists():  # noqa: ASYNC110 (the orchestrator's start signal is a file)
            await asyncio.sleep(0.02)
        self.t_end = float(json.loads(go.read_text())["t_end"])
        tasks = [asyncio.ensure_future(self.client(c)) for c in range(self.cfg["clients"])]
        # Operations under way at the end finish (bounded); new ones do not start.
        timeout = max(0.0, self.t_end - time.monotonic()) + self.cfg["drain_s"]
        _done, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.fc.aclose(), 5)
        self.ops.close()
        self.runs.close()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if cfg.get("mutant"):
        mutants.apply(cfg["mutant"])  # before the FlightCache exists: its scripts load later
    asyncio.run(Worker(cfg).main())


if __name__ == "__main__":
    main()
