"""Connection pools with the bounds flightcache needs: a bounded wait for a connection, one
deadline sweeper for the whole pool, and the same for a Sentinel-managed master."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as rexc
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

from .._waits import within

log = logging.getLogger("flightcache.redis")


class BoundedPool(aioredis.ConnectionPool):
    """redis-py's plain pool with two bounds of its own.

    At most ``max_connections`` are handed out at once; a caller past that waits for one (up
    to ``wait_timeout``) instead of failing. With ``op_timeout`` set, a sweeper task
    disconnects any connection held longer than that, which fails the command on it with a
    ConnectionError: one timer for the whole pool, where redis-py's ``socket_timeout`` arms
    a timer for every read and a Task for every write (about 10 us of CPU per command on
    Python 3.11, as much as the rest of a cache hit). Blocking commands (XREAD BLOCK) use a
    pool without the sweeper and redis-py's socket timeout instead.

    ``lane`` of the ``max_connections`` are kept for the calls that must never queue behind
    the others (an owner's lease renewals, the node's liveness): ``get_connection(lane=True)``
    takes one of those, and :meth:`lane_view` is a pool for a client that uses only them.
    """

    def __init__(
        self,
        *,
        wait_timeout: float,
        op_timeout: float | None = None,
        lane: int = 0,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        lane = min(lane, self.max_connections - 1)  # at least one for everything else
        self._slots = asyncio.Semaphore(self.max_connections - lane)
        self._lane = asyncio.Semaphore(lane) if lane > 0 else None
        self._wait_timeout = wait_timeout
        self._op_timeout = op_timeout
        # id -> (connection, checked out at, the semaphore it was taken from)
        self._out: dict[int, tuple[Any, float, asyncio.Semaphore]] = {}
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def saturated(self) -> bool:
        """Whether every connection for ordinary calls is in use (a call would wait)."""
        return self._slots.locked()

    def lane_view(self) -> LaneView:
        """This pool as seen by a client that must use only the reserved lane."""
        return LaneView(self)

    async def get_connection(self, *args: Any, lane: bool = False, **kwargs: Any) -> Any:
        slots = self._lane if lane and self._lane is not None else self._slots
        if slots.locked():
            try:
                await within(slots.acquire(), self._wait_timeout)
            except asyncio.TimeoutError as exc:
                raise rexc.MaxConnectionsError(
                    f"all {self.max_connections} connections stayed busy for "
                    f"{self._wait_timeout:g} s (raise max_connections?)"
                ) from exc
        else:
            await slots.acquire()
        try:
            if self._op_timeout is not None and not self._idle_connected():
                # A new connection's handshake (HELLO, CLIENT SETNAME) reads with no socket
                # timeout in this pool, and the sweeper only sees checked-out connections:
                # bound the connect here, so a frozen server cannot hang it.
                connection = await within(
                    super().get_connection(),  # type: ignore[no-untyped-call]
                    self._op_timeout,
                )
            else:
                connection = await super().get_connection()  # type: ignore[no-untyped-call]
        except asyncio.TimeoutError as exc:
            slots.release()
            raise rexc.ConnectionError(
                f"connecting took longer than {self._op_timeout:g} s"
            ) from exc
        except BaseException:
            slots.release()
            raise
        self._out[id(connection)] = (connection, time.monotonic(), slots)
        if self._op_timeout is not None and self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(self._op_timeout))
        return connection

    def _idle_connected(self) -> bool:
        """Whether the next checkout reuses a live connection (no handshake to bound)."""
        idle: Any = getattr(self, "_available_connections", None)
        return bool(idle) and bool(getattr(idle[-1], "is_connected", False))

    async def release(self, connection: Any) -> None:
        try:
            await super().release(connection)
        finally:
            out = self._out.pop(id(connection), None)
            if out is not None:
                out[2].release()

    async def _sweep(self, limit: float) -> None:
        while True:
            await asyncio.sleep(limit / 4)  # sweep interval: one timer for the pool
            now = time.monotonic()
            for connection, since, _slots in list(self._out.values()):
                if now - since > limit:
                    log.warning("a Redis command ran past %g s; disconnecting it", limit)
                    await connection.disconnect(nowait=True)

    async def disconnect(self, inuse_connections: bool = True) -> None:
        # Only closing the pool stops the sweeper: dropping the idle connections (a sentinel
        # pool's, when the master moved) leaves the ones in use to watch.
        if inuse_connections and self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        await super().disconnect(inuse_connections)


class LaneView:
    """A :class:`BoundedPool` seen through its reserved lane: what a redis-py client made on
    it checks out comes from the lane's connections; everything else is the pool's own."""

    def __init__(self, pool: BoundedPool) -> None:
        self._pool = pool

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        return await self._pool.get_connection(lane=True)

    async def disconnect(self, inuse_connections: bool = True) -> None:
        return None  # the pool is closed by its owner, not by a view of it

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


class SentinelPool(BoundedPool, SentinelConnectionPool):
    """A :class:`BoundedPool` of connections to the master Redis Sentinel names.

    redis-py's ``SentinelConnectionPool`` does the following: each new connection asks the
    sentinels for the master's address first; a changed address drops the idle connections
    to the old one; a ``READONLY`` reply (the old master came back as a replica) drops the
    connection it came on and fails as a ConnectionError. So after a failover every command
    fails at most once per pooled connection (BackendUnavailable, which flights retry) and
    the next connection reaches the new master. ``heard`` is told every address named.
    """

    def __init__(
        self,
        service: str,
        manager: Sentinel,
        *,
        heard: Callable[[tuple[str, int]], None],
        **kwargs: Any,
    ) -> None:
        self._heard = heard
        super().__init__(service_name=service, sentinel_manager=manager, **kwargs)

    async def get_master_address(self) -> Any:
        address = await super().get_master_address()  # type: ignore[no-untyped-call]
        self._heard(address)
        return address
