"""The sync door's own connections: a thread-safe pool of synchronous redis-py connections
to one server, the packing of its commands, and what the caller threads count
(``_syncread.py`` uses them; docs/sync.md)."""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis
from redis import exceptions as rexc

from ._backends.scripts import pack_command

STALE_S = 0.5  # a reused connection failing this fast was closed while idle: once more
CONNECT_S = 3.0


class Busy(Exception):
    """Every connection of the pool stayed in use for the whole wait."""


class SyncLink:
    """Synchronous redis-py connections to one server, shared by threads: a LIFO of idle
    connections under a lock, at most ``max_connections`` in use. A pool belongs to the
    process that made it: a forked child makes its own (``FastPath`` is per engine)."""

    def __init__(self, url: str, *, socket_timeout: float, max_connections: int, name: str):
        template = redis.ConnectionPool.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=CONNECT_S,
            client_name=name,
            decode_responses=False,
        )
        self._class: Any = template.connection_class
        self._kwargs = template.connection_kwargs
        self._timeout = socket_timeout
        # The kernel's timeouts instead of Python's on plain TCP and unix sockets (below).
        self._kernel_timeouts = sys.platform.startswith(("linux", "darwin")) and (
            self._class in (redis.Connection, redis.UnixDomainSocketConnection)
        )
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._open = 0  # connections made and not dropped: idle or in use
        self._waiting = 0  # threads waiting for one
        self._max = max_connections
        self._wait_s = CONNECT_S + socket_timeout
        self.pid = os.getpid()

    def call(self, packed: bytes) -> Any:
        """One command's reply (``timed``)."""
        return self.timed(packed)[0]

    def timed(self, packed: bytes) -> tuple[Any, float]:
        """One command's reply, and when it was written (``time.monotonic``: after any wait
        for a connection, so a lease the reply grants is counted from no earlier than the
        server could have started it, and no later). A reused connection that fails at once
        (closed while it sat idle) is dropped and the command sent once more on a fresh one
        (every script is safe to send twice, docs/protocol.md); other failures are raised."""
        conn = self._take()
        reused = conn is not None
        for attempt in (0, 1):
            if conn is None:
                try:
                    conn = self._connect()
                except BaseException:
                    self._drop()
                    raise
            sent = time.monotonic()
            try:
                conn.send_packed_command([packed], check_health=False)
                reply = conn.read_response()
            except rexc.ResponseError:
                self._keep(conn)  # an answer: the connection is fine
                raise
            except (rexc.ConnectionError, OSError):
                conn.disconnect()
                if attempt or not reused or time.monotonic() - sent > STALE_S:
                    self._drop()
                    raise
                conn = None  # its place goes to a fresh one
                continue
            except BaseException:
                conn.disconnect()  # interrupted mid-command: never reused
                self._drop()
                raise
            self._keep(conn)
            return reply, sent
        raise AssertionError("unreachable")

    def _connect(self) -> Any:
        """A new connection, connected (the handshake under Python's socket timeout).

        A socket with a Python timeout polls before every send and every receive: two
        system calls more per round trip than a blocking socket, about a quarter of a hit's
        client-side cost on loopback. So a plain TCP or unix connection is then made
        blocking, bounded by the kernel's ``SO_RCVTIMEO``/``SO_SNDTIMEO`` instead: a read
        that outlasts ``socket_timeout`` fails with ``EAGAIN``, which redis-py raises as a
        ``ConnectionError``, and the connection is dropped as after any failure."""
        conn = self._class(**self._kwargs)
        conn.connect()
        if self._kernel_timeouts:
            seconds = int(self._timeout)
            limit = struct.pack("ll", seconds, int((self._timeout - seconds) * 1e6))
            sock = conn._sock
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
            sock.settimeout(None)
        return conn

    def _take(self) -> Any:
        """An idle connection, or None: make one (its place is counted already). Waits
        while ``max_connections`` are in use, up to a connect and a socket timeout."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
            if self._open < self._max:
                self._open += 1
                return None
            deadline = time.monotonic() + self._wait_s
            self._waiting += 1
            try:
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise Busy
                    self._freed.wait(left)
                    if self._idle:
                        return self._idle.pop()
                    if self._open < self._max:
                        self._open += 1
                        return None
            finally:
                self._waiting -= 1

    def _keep(self, conn: Any) -> None:
        with self._lock:
            self._idle.append(conn)
            if self._waiting:
                self._freed.notify()

    def _drop(self) -> None:
        with self._lock:
            self._open -= 1
            if self._waiting:
                self._freed.notify()

    def close(self) -> None:
        if os.getpid() != self.pid:
            return  # the parent's sockets: never touched by a child
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.disconnect()


class Packer:
    """``EVALSHA`` in RESP, as ``pack_command`` writes it, for calls that repeat most of
    their arguments: a call's keys, node id, TTLs and modes are the same objects from call
    to call of one key (the memo of ``FastPath``), and encoding twenty of them again costs
    more than the round trip's own Python work. ``last`` holds each position's argument
    and encoding from the call before; an argument that is not the very same object (the
    claim id, the token's random bits) is encoded afresh."""

    def __init__(self, sha: bytes) -> None:
        self.sha = sha
        self._heads: dict[tuple[int, int], bytes] = {}

    def evalsha(
        self, keys: Sequence[str], args: Sequence[Any], last: list[tuple[Any, bytes]]
    ) -> bytes:
        head = self._heads.get((len(keys), len(args)))
        if head is None:
            head = self._heads[(len(keys), len(args))] = (
                b"*%d\r\n" % (3 + len(keys) + len(args))
                + self.part(b"EVALSHA")
                + self.part(self.sha)
                + self.part(b"%d" % len(keys))
            )
        every = (*keys, *args)
        if len(last) != len(every):  # the first call (or a thread is filling it now)
            fresh = [(arg, self.part(arg)) for arg in every]
            last[:] = fresh  # one step under the GIL: others see it empty or whole
            return head + b"".join([part for _, part in fresh])
        part = self.part
        # (the same length: a concurrent refill replaces it whole)
        return head + b"".join(
            [known if seen is arg else part(arg) for (seen, known), arg in zip(last, every)]  # noqa: B905
        )

    @staticmethod
    def part(arg: Any) -> bytes:
        kind = type(arg)
        if kind is str:
            arg = arg.encode()
        elif kind is int:
            arg = b"%d" % arg
        elif kind is not bytes:
            return pack_command(arg)[4:]  # as pack_command writes it, without "*1\r\n"
        return b"$%d\r\n%b\r\n" % (len(arg), arg)


class Counts:
    """What the caller threads served, added to the engine's ``stats`` (whose counters
    belong to the loop thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls = self.hits = self.coalesced = self.gets = self.get_hits = 0
        self.commands = 0

    def hit(self) -> None:
        with self._lock:
            self.calls += 1
            self.hits += 1

    def coalesce(self) -> None:
        with self._lock:
            self.calls += 1
            self.coalesced += 1

    def command(self) -> None:
        with self._lock:
            self.commands += 1

    def get(self, hit: bool, command: bool) -> None:
        with self._lock:
            self.gets += 1
            self.get_hits += hit
            self.commands += command

    def into(self, stats: dict[str, int]) -> dict[str, int]:
        with self._lock:
            for name in ("calls", "hits", "coalesced", "gets", "get_hits", "commands"):
                stats[name] = stats.get(name, 0) + getattr(self, name)
        return stats
