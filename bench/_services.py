"""Server subprocesses for the gateway phase: ``flightcache mock-upstream`` and ``serve``.

Each is started with ``--port 0`` and prints one line with its real address once its socket
listens; :meth:`Service.start` waits for that line. Its stderr goes to a temporary file whose
tail is shown if it fails. :meth:`Service.stop` sends SIGTERM (both commands stop cleanly on
it), then SIGKILL to that one pid if it has not exited within a few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import tempfile
from pathlib import Path

from ._util import python_module

_ADDRESS = re.compile(rb"listening on (http://\S+)")


class Service:
    """One ``python -m flightcache <command> ... --port 0`` subprocess and its address."""

    def __init__(
        self, name: str, proc: asyncio.subprocess.Process, log_path: Path, drain: asyncio.Task[None]
    ) -> None:
        self.name = name
        self.proc = proc
        self.pid = proc.pid
        self.log_path = log_path
        self.url = ""
        self._drain = drain

    @classmethod
    async def start(cls, name: str, args: list[str], timeout: float = 20.0) -> Service:
        fd, log_name = tempfile.mkstemp(prefix=f"bench-{name}-", suffix=".log")
        log_path = Path(log_name)
        try:
            proc = await python_module(
                "flightcache",
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=fd,
            )
        except BaseException:
            _remove(log_path)
            raise
        finally:
            os.close(fd)
        assert proc.stdout is not None
        first = asyncio.get_running_loop().create_future()
        service = cls(name, proc, log_path, asyncio.create_task(_drain(proc.stdout, first)))
        try:
            try:
                line: bytes = await asyncio.wait_for(asyncio.shield(first), timeout)
            except asyncio.TimeoutError:
                line = b"(nothing within %g s)" % timeout
            match = _ADDRESS.search(line)
            if match is None:
                raise RuntimeError(
                    f"{name} did not print its address (got {line!r}); its log ends:\n"
                    + service.log_tail()
                )
            service.url = match[1].decode().rstrip(".,)")
        except BaseException:
            await service.stop()
            raise
        return service

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"

    async def stop(self, timeout: float = 8.0) -> None:
        proc = self.proc
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        self._drain.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._drain
        _remove(self.log_path)

    def kill_now(self) -> None:
        """Last resort, without an event loop: SIGKILL this service's own pid."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, 9)
        _remove(self.log_path)


async def stop_all(services: list[Service]) -> None:
    """Stop every service at once; one that fails to stop, or all of them if stopping is
    interrupted (Ctrl-C), gets SIGKILL to its own pid."""
    try:
        stopped = await asyncio.gather(*(s.stop() for s in services), return_exceptions=True)
        for service, outcome in zip(services, stopped, strict=True):
            if isinstance(outcome, BaseException):
                service.kill_now()
    except BaseException:
        for service in services:
            service.kill_now()
        raise


async def _drain(stdout: asyncio.StreamReader, first: asyncio.Future[bytes]) -> None:
    """Hand the first line to ``first``, then read the rest so the pipe never fills."""
    line = await stdout.readline()
    if not first.done():
        first.set_result(line)
    while await stdout.read(65536):
        pass


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
