"""Run an ASGI app under uvicorn: bind first, print the address, stop cleanly on SIGTERM.

:func:`serve` is for the command line (``flightcache serve``, ``flightcache mock-upstream``):
it binds the socket itself, so ``--port 0`` works and the printed address is the real one,
and the line is printed only once the socket accepts connections (a script may connect as
soon as it reads it). SIGTERM and SIGINT stop the server gracefully (open requests get
``graceful_timeout`` seconds, then are cancelled); SIGTERM then exits with status 0, SIGINT
raises :class:`KeyboardInterrupt` as usual.

:class:`ServerThread` serves an app in a background thread of the current process, for
tests and benchmarks: ``with ServerThread(app) as server: ... server.url``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import socket
import sys
import threading
import time
from types import FrameType, TracebackType
from typing import Any

import uvicorn
from starlette.types import ASGIApp

__all__ = ["ServerThread", "bind_socket", "format_url", "serve"]

_BACKLOG = 2048


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: any free port). Raises OSError."""
    family = socket.AF_INET
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            family = socket.AF_INET6
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(_BACKLOG)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


def format_url(sock: socket.socket) -> str:
    """``http://host:port`` for a bound socket (IPv6 hosts in brackets)."""
    host, port = sock.getsockname()[:2]
    if sock.family == socket.AF_INET6:
        host = f"[{host}]"
    return f"http://{host}:{port}"


# Seconds an idle client connection is kept open. Longer than what clients keep theirs
# (httpx, so the openai SDK: 5 s) and than a load balancer's idle timeout in front (60 s
# on AWS's): the side that closes an idle connection is then the client, never this server
# in the instant a request is on its way in. uvicorn's own default, 5 s, meets httpx's.
KEEP_ALIVE_S = 75


def _config(app: ASGIApp, *, graceful_timeout: float, log_level: str, **kw: Any) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,  # request lines only, but an operator turns them on deliberately
        timeout_graceful_shutdown=max(1, round(graceful_timeout)),
        timeout_keep_alive=KEEP_ALIVE_S,
        lifespan="auto",
        **kw,
    )


def serve(
    app: ASGIApp,
    *,
    host: str,
    port: int,
    banner: str,
    log_level: str = "warning",
    graceful_timeout: float = 5.0,
) -> int:
    """Serve ``app`` in the foreground until SIGTERM (exit status 0) or SIGINT.

    ``banner`` is printed once the socket listens, with ``{url}`` replaced by its address.
    Raises OSError when the address cannot be bound (nothing is printed then).
    """
    sock = bind_socket(host, port)
    terminated: list[int] = []

    def note_sigterm(signum: int, frame: FrameType | None) -> None:
        terminated.append(signum)

    # uvicorn handles SIGTERM itself while it runs, then restores the previous handler and
    # raises the signal again; this handler makes that second delivery a clean exit.
    previous = signal.signal(signal.SIGTERM, note_sigterm)
    try:
        server = uvicorn.Server(
            _config(app, graceful_timeout=graceful_timeout, log_level=log_level)
        )
        print(banner.replace("{url}", format_url(sock)), flush=True)
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
    sys.stdout.flush()
    return 0


class ServerThread:
    """Serve an ASGI app under uvicorn in a daemon thread, on a free loopback port by default.

    ``start()`` returns once the server accepts connections; ``stop()`` asks it to finish
    (open requests get ``graceful_timeout`` seconds, then are cancelled) and joins the thread.
    Logging is left to the process (uvicorn's loggers propagate to the root logger).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        graceful_timeout: float = 1.0,
        log_level: str = "warning",
    ) -> None:
        self._app = app
        self._host = host
        self._port = port
        self._graceful_timeout = graceful_timeout
        self._log_level = log_level
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.url = ""

    def start(self, timeout: float = 10.0) -> str:
        if self._thread is not None:
            raise RuntimeError("ServerThread already started")
        sock = bind_socket(self._host, self._port)
        self.url = format_url(sock)
        config = _config(
            self._app,
            graceful_timeout=self._graceful_timeout,
            log_level=self._log_level,
            log_config=None,
        )
        server = self._server = uvicorn.Server(config)

        def run() -> None:
            try:
                server.run(sockets=[sock])
            except BaseException as exc:  # reported by start() or stop()
                self._error = exc
            finally:
                sock.close()

        self._thread = threading.Thread(target=run, name=f"uvicorn {self.url}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server at {self.url} did not start") from self._error
            time.sleep(0.005)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        server.should_exit = True
        thread.join(timeout)
        if thread.is_alive():
            server.force_exit = True
            thread.join(timeout)
        self._server = self._thread = None

    def __enter__(self) -> ServerThread:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
