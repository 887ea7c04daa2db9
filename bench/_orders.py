"""Orders as JSON lines between the bench and its worker processes, both sides.

The bench sends one JSON object a line on a worker's stdin (``{"op": ...}``) and reads one
JSON line back on its stdout for each; ``{"op": "quit"}`` or the end of input ends the
worker, and an answer with an ``"error"`` (a traceback) ends it too. Parent side:
:class:`Worker` and :func:`started`. Worker side: :func:`serve`, the whole ``main`` of
``bench._worker`` and ``bench._near_worker``, which differ only in their cache and orders.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, NoReturn

from flightcache import FlightCache

from ._util import ROOT, python_module

READY_TIMEOUT_S = 30.0

# -- the bench's side -----------------------------------------------------------------------


class Worker:
    """One worker process, spoken to in JSON lines; killed by its own pid when in doubt."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.pid = proc.pid

    @classmethod
    async def spawn(cls, url: str, *args: str, module: str = "bench._worker") -> Worker:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        proc = await python_module(
            module,
            url,
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            limit=1 << 22,
        )
        return cls(proc)

    async def send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        await self.proc.stdin.drain()

    async def receive(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            raise RuntimeError(f"worker {self.pid} exited (code {await self.proc.wait()})")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"worker {self.pid} failed:\n{reply['error']}")
        return reply

    async def ask(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        await self.send(msg)
        return await self.receive(timeout)

    async def close(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(Exception):
                await self.send({"op": "quit"})
                await asyncio.wait_for(self.proc.wait(), 5)
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


@contextlib.asynccontextmanager
async def started(
    count: int, url: str, *args: str, module: str = "bench._worker"
) -> AsyncIterator[list[Worker]]:
    """``count`` workers of ``module``, each answered ``{"op": "warm"}``; on the way out every
    one started is closed (quit, then SIGKILL to its pid), also when starting one failed."""
    workers: list[Worker] = []
    try:
        for _ in range(count):
            workers.append(await Worker.spawn(url, *args, module=module))
        await asyncio.gather(*(w.ask({"op": "warm"}, READY_TIMEOUT_S) for w in workers))
        yield workers
    finally:
        await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)


# -- the worker's side ----------------------------------------------------------------------

Handler = Callable[[FlightCache, dict[str, Any]], Awaitable[dict[str, Any]]]


async def _answer(make_cache: Callable[[], FlightCache], handlers: Mapping[str, Handler]) -> int:
    fc = make_cache()
    try:
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                return 0
            msg = json.loads(line)
            op = msg.get("op")
            if op == "quit":
                return 0
            try:
                handler = handlers.get(op)
                if handler is None:
                    reply = {"error": f"unknown op {op!r}"}
                else:
                    reply = await handler(fc, msg)
            except Exception:
                reply = {"error": traceback.format_exc()}
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
            if "error" in reply:
                return 1
    finally:
        await fc.aclose()


def serve(make_cache: Callable[[], FlightCache], handlers: Mapping[str, Handler]) -> NoReturn:
    """A worker's main: one cache (made inside the event loop) for the process's whole life,
    each order answered by ``handlers[op](fc, order)``; exits 0, 1 after an error, 130 on
    Ctrl-C (which reaches the whole process group: it leaves quietly)."""
    try:
        sys.exit(asyncio.run(_answer(make_cache, handlers)))
    except KeyboardInterrupt:
        sys.exit(130)
