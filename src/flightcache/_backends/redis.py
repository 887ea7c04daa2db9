"""The Redis/Valkey connection of one FlightCache: client, Lua scripts, and error mapping."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis import exceptions as rexc
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from .._config import safe_url
from .._errors import BackendUnavailable, ConfigError, FlightError, PoolExhausted
from .._keys import FlightKeys
from .._types import Stats
from .._waits import cancels_pending, within
from .convoy import STALE_S, Convoy, send_calls
from .lane import SyncLane
from .listener import Listener, keepalive
from .pools import BoundedPool
from .scripts import Script, pack_command
from .sentinel import SENTINEL_SCHEMES, SentinelMaster, SentinelURL, parse_sentinel_url

T = TypeVar("T")

log = logging.getLogger("flightcache.redis")

CLUSTER_SCHEME = "redis+cluster://"
# Connections of the pool (of each node's, on a Cluster) kept for the calls that must never
# queue behind the others: an owner's lease renewals and the node's liveness.
LANE = 2


class RedisConnection:
    """One redis-py asyncio client plus the registered scripts, with errors mapped.

    Every call goes through :meth:`run`, which counts commands and turns driver errors into
    :class:`BackendUnavailable` (connection trouble, URL without password, no master named
    by the sentinels) or :class:`ConfigError` (a foreign value of the wrong type at one of
    our keys). The URL picks the client: one server (``redis://``, ``rediss://``,
    ``unix://``), a Cluster (``redis+cluster://``), or the master that Redis Sentinel names
    (``redis+sentinel://``, ``rediss+sentinel://``: :class:`SentinelPool`; the listener is
    pointed at the master the sentinels named last, and asks them again on each reconnect).
    """

    def __init__(
        self,
        url: str,
        *,
        stats: Stats,
        socket_timeout: float = 10.0,
        connect_timeout: float = 3.0,
        max_connections: int = 64,
        client_name: str | None = None,
        listener_ping_s: float | None = None,
    ) -> None:
        self.url = url
        self.safe_url = safe_url(url)
        self.stats = stats
        self.socket_timeout = socket_timeout
        self._made = (connect_timeout, client_name)
        self.cluster: Any = None
        self._master: SentinelMaster | None = None  # under Sentinel
        self._gate: asyncio.Semaphore | None = None  # a Cluster's bounded wait for a turn
        self._lane_gate: asyncio.Semaphore | None = None  # and its reserved lane's
        self._convoy: Convoy | None = None
        self._preload: list[Script] = []
        self._wait_timeout = connect_timeout + socket_timeout
        self._max_connections = max_connections
        # One pub/sub connection for everything this process waits to hear from the server.
        self.listener = Listener(
            self.listen_urls,
            client_name=f"{client_name or 'flightcache'}:listen",
            # Quiet for this long, it pings: a frozen server is noticed within about two
            # socket timeouts even by followers, who send nothing while they wait.
            ping_s=listener_ping_s or socket_timeout,
        )
        if url.startswith(CLUSTER_SCHEME):
            self._init_cluster(url, socket_timeout, connect_timeout, max_connections, client_name)
            return
        common = dict(
            max_connections=max_connections,
            wait_timeout=connect_timeout + socket_timeout,
            socket_connect_timeout=connect_timeout,
            client_name=client_name,
            decode_responses=False,
            # A connection the server closed while it sat idle (a restart, a cut) fails its
            # next command at once: that command goes again, once, on a fresh connection.
            # Every command and script here is safe to send twice (docs/protocol.md).
            retry=Retry(NoBackoff(), 1, supported_errors=(rexc.ConnectionError,)),
            **keepalive(url),
        )
        pool: BoundedPool
        blocking_pool: BoundedPool
        if url.startswith(SENTINEL_SCHEMES):
            parsed = parse_sentinel_url(url)
            self._master = SentinelMaster(parsed, self.safe_url, connect_timeout)
            pool, blocking_pool = self._master.pools(common, socket_timeout, LANE)
        else:
            try:
                # Short commands: bounded by the pool's sweeper, not a timer per command.
                pool = BoundedPool.from_url(
                    url, op_timeout=socket_timeout, socket_timeout=None, lane=LANE, **common
                )
                # XREAD BLOCK: one connection per followed flight, bounded by redis-py's timeout.
                blocking_pool = BoundedPool.from_url(url, socket_timeout=socket_timeout, **common)
            except ValueError as exc:
                raise ConfigError(f"bad Redis URL {self.safe_url}: {exc}") from exc
        self.client: aioredis.Redis = aioredis.Redis(connection_pool=pool)
        # The same pool's reserved lane: renewals and liveness never wait behind a burst.
        self.lane: aioredis.Redis = aioredis.Redis(connection_pool=pool.lane_view())  # type: ignore[arg-type]
        self.blocking: aioredis.Redis = aioredis.Redis(connection_pool=blocking_pool)
        self.scripts: dict[str, Any] = {}
        self._convoy = Convoy(pool, self._load, self._evalsha)

    def _init_cluster(
        self,
        url: str,
        socket_timeout: float,
        connect_timeout: float,
        max_connections: int,
        client_name: str | None,
    ) -> None:
        """Redis/Valkey Cluster: redis-py's cluster client routes each command by its keys'
        slot (every script's keys share one hash tag), per node pools, and follows MOVED and
        failovers. Blocking reads share it: the socket timeout bounds every command."""
        try:
            self.cluster = RedisCluster.from_url(
                "redis://" + url[len(CLUSTER_SCHEME) :],
                max_connections=max_connections,
                socket_timeout=socket_timeout,
                socket_connect_timeout=connect_timeout,
                socket_keepalive=True,
                client_name=client_name,
                decode_responses=False,
            )
        except (ValueError, rexc.RedisClusterException) as exc:
            raise ConfigError(f"bad Redis Cluster URL {self.safe_url}: {exc}") from exc
        self.client = self.blocking = self.lane = self.cluster
        # At most one connection per node per turn (a pipeline takes one on each node), so
        # no node's pool (max_connections) can overflow; LANE of the turns are kept for the
        # calls sent with lane=True.
        ordinary = max(max_connections - LANE, 1)
        self._gate = asyncio.Semaphore(ordinary)
        if max_connections > ordinary:
            self._lane_gate = asyncio.Semaphore(max_connections - ordinary)
        self.scripts = {}

    @property
    def sentinel(self) -> SentinelURL | None:
        """What the ``redis+sentinel://`` URL says (None for any other URL)."""
        return self._master.url if self._master is not None else None

    def sync_lane(self, role: str) -> SyncLane:
        """Blocking connections to the same server(s), for a thread of its own (the lease
        renewals'): its commands are not counted here."""
        connect_timeout, client_name = self._made
        return SyncLane(
            self.url,
            socket_timeout=self.socket_timeout,
            connect_timeout=connect_timeout,
            client_name=f"{client_name or 'flightcache'}:{role}",
        )

    async def open(self) -> None:
        """Connect before the first command (a cluster client must learn its slots first:
        concurrent first commands on a fresh cluster client race in redis-py)."""
        if self._master is None:
            self.listener.start()
        else:  # the listener starts once the sentinels named a master
            self._master.track(self.listener)
        if self.cluster is not None:
            await self.run(self.cluster.initialize)
        if self._preload:
            # Every script the server will run, loaded in one round trip (on a Cluster, on
            # every master), so no first call pays a NOSCRIPT and a reload.
            texts = [lua.text for lua in self._preload]
            self._preload = []
            if self.cluster is not None:
                for text in texts:
                    await self.run(functools.partial(self.client.script_load, text))
            else:

                async def load() -> None:
                    pipe: Any = self.client.pipeline(transaction=False)
                    for text in texts:
                        pipe.script_load(text)
                    await pipe.execute()

                await self.run(load)
        # Followers are told of new events on the listener: be subscribed before the first
        # call (bounded; until then a follower re-reads its stream instead).
        await self.listener.wait_subscribed(3.0)

    def preload(self, luas: Iterable[Script]) -> None:
        """Scripts to load when the connection opens."""
        self._preload.extend(luas)

    def listen_urls(self) -> list[str]:
        """Plain URLs of the servers a pub/sub listener may use (any node of a cluster
        hears every PUBLISH; under Sentinel, the master)."""
        if self._master is not None:
            return [self._master.listen_url()]  # asked on every reconnect
        if self.cluster is None:
            return [self.url]
        parts = urlsplit("redis://" + self.url[len(CLUSTER_SCHEME) :])
        auth = parts.netloc.rpartition("@")[0]
        urls = []
        for node in self.cluster.get_nodes():
            netloc = f"{auth}@{node.host}:{node.port}" if auth else f"{node.host}:{node.port}"
            urls.append(urlunsplit(("redis", netloc, "/0", parts.query, "")))
        # Before the cluster client knew its nodes: the node the URL names.
        return urls or [urlunsplit(("redis", parts.netloc, "/0", parts.query, ""))]

    async def run(
        self, op: Callable[[], Awaitable[T]], fk: FlightKeys | None = None, *, lane: bool = False
    ) -> T:
        """``op()``, counted, its driver errors mapped. With ``lane``, a Cluster command
        takes one of the reserved turns (on one server, the caller uses :attr:`lane`)."""
        self.stats.commands += 1
        gate = self._lane_gate if lane and self._lane_gate is not None else self._gate
        pending = cancels_pending()
        try:
            if gate is None:
                reply = await op()
            else:
                await self._enter(gate)
                try:
                    reply = await op()
                finally:
                    gate.release()
        except rexc.MaxConnectionsError as exc:
            # This process is busy, the server is not down: no fail-open for this.
            raise PoolExhausted(f"connection pool exhausted for {self.safe_url}: {exc}") from exc
        except (
            rexc.ConnectionError,
            rexc.TimeoutError,
            rexc.ClusterDownError,
            rexc.SlotNotCoveredError,
            rexc.RedisClusterException,
            OSError,
        ) as exc:
            detail = str(exc)[:200] if isinstance(exc, rexc.RedisError) else ""
            raise BackendUnavailable(
                f"cannot reach Redis at {self.safe_url}: {type(exc).__name__}"
                + (f" ({detail})" if detail else "")
            ) from exc
        except AttributeError as exc:
            if self.cluster is None or "NoneType" not in str(exc):
                raise
            # redis-py's cluster client, on a connection torn down under it (a failover, a
            # reconnect racing a command), fails inside itself like this (NOTES: its lazy
            # set-up race): the server is out of reach, not the caller's bug.
            raise BackendUnavailable(
                f"cannot reach Redis at {self.safe_url}: a connection closed mid-command"
            ) from exc
        except rexc.ResponseError as exc:
            if "WRONGTYPE" in str(exc) and fk is not None:
                raise await self._wrong_type(fk) from exc
            raise FlightError(f"Redis at {self.safe_url} refused a command: {exc}") from exc
        if cancels_pending() > pending:
            # The caller was cancelled and redis-py lost it (its asyncio.wait_for around a
            # socket write, when socket_timeout is set, before Python 3.12): deliver it, as if
            # it had come while the reply was on its way (callers handle exactly that).
            raise asyncio.CancelledError
        return reply

    async def _enter(self, gate: asyncio.Semaphore) -> None:
        """A cluster command's turn: redis-py's cluster client fails at once when a node's
        pool is full, so commands wait here (bounded) for one of ``max_connections`` turns."""
        if not gate.locked():
            await gate.acquire()
            return
        try:
            await within(gate.acquire(), self._wait_timeout)
        except asyncio.TimeoutError as exc:
            raise rexc.MaxConnectionsError(
                f"all {self._max_connections} connections stayed busy for "
                f"{self._wait_timeout:g} s (raise max_connections?)"
            ) from exc

    async def _load(self, lua: Script) -> None:
        await self.client.script_load(lua.text)

    async def script(
        self, lua: Script, fk: FlightKeys | None, keys: Sequence[str], args: Sequence[Any]
    ) -> Any:
        return (await self.script_timed(lua, fk, keys, args))[0]

    async def script_timed(
        self, lua: Script, fk: FlightKeys | None, keys: Sequence[str], args: Sequence[Any]
    ) -> tuple[Any, float]:
        """The script's reply, and how long the call waited in this process (for a
        connection, or in the convoy) before it was written: a lease the script grants runs
        from the write, not from the call (0 on a Cluster: counted from the call)."""
        if self.cluster is None:
            convoy = self._convoy
            assert convoy is not None
            # Alone, at once; with others on the wire, together with them (one write).
            return await self.run(lambda: convoy.call(lua, keys, args), fk)
        script = self.scripts.get(lua.name)
        if script is None:
            script = self.scripts[lua.name] = self.client.register_script(lua.text)
        return await self.run(lambda: script(keys=list(keys), args=list(args)), fk), 0.0

    async def _evalsha(
        self, lua: Script, keys: Sequence[str], args: Sequence[Any]
    ) -> tuple[Any, float]:
        """EVALSHA, packed here and sent on a pooled connection. A script call carries some
        twenty arguments, and redis-py's generic command path (an encoder call and type
        checks per argument, retry wrappers) costs more than the round trip itself; this
        is the hot path of every call. NOSCRIPT (a restarted server) loads it and sends it
        again; a connection interrupted mid-command is dropped, never reused."""
        packed = pack_command(b"EVALSHA", lua.sha, len(keys), *keys, *args)
        pool: Any = self.client.connection_pool
        loaded = resent = False
        called = time.monotonic()
        while True:
            conn = await pool.get_connection()
            idle = conn.is_connected  # reused: the server may have closed it meanwhile
            sent = time.monotonic()
            try:
                await conn.send_packed_command(packed, check_health=False)
                return await conn.read_response(), sent - called
            except rexc.NoScriptError:
                if loaded:
                    raise
                loaded = True
            except rexc.ResponseError:
                raise  # an answer: the connection is fine
            except (rexc.ConnectionError, OSError):
                await conn.disconnect(nowait=True)
                # A connection found dead at once (closed while idle) is not an outage:
                # once, on a fresh one (scripts are safe to send twice).
                if resent or not idle or time.monotonic() - sent > STALE_S:
                    raise
                resent = True
                continue
            except BaseException:
                await conn.disconnect(nowait=True)
                raise
            finally:
                await pool.release(conn)
            await self.client.script_load(lua.text)

    async def _wrong_type(self, fk: FlightKeys) -> ConfigError:
        expected = {
            fk.result: b"string",
            fk.meta: b"hash",
            fk.stream: b"stream",
            fk.waiters: b"list",
        }
        for name, want in expected.items():
            try:
                got: Any = await self.client.type(name)
            except rexc.RedisError:
                continue
            if got not in (want, b"none"):
                return ConfigError(
                    f"key {name!r} holds a {got.decode()}, not what flightcache writes there "
                    "(another application may share this namespace)",
                    key=fk.digest,
                )
        return ConfigError(
            f"a key of flight {fk.digest} holds a value of the wrong type", key=fk.digest
        )

    async def calls(
        self,
        lua: Script,
        calls: Sequence[tuple[Sequence[str], Sequence[Any]]],
        *,
        lane: bool = False,
    ) -> list[Any]:
        """One script, several calls (keys, args), in one round trip to one server (on the
        reserved lane with ``lane``): each call's reply, or the ``ResponseError`` the server
        answered for it (kept apart: one refused call fails only itself)."""
        assert self.cluster is None, "a Cluster sends these with pipeline_script"
        pool = self.client.connection_pool
        return await self.run(
            lambda: send_calls(
                pool, [(lua, keys, args) for keys, args in calls], self._load, lane=lane
            )
        )

    async def pipeline_script(
        self,
        lua: Script,
        calls: Sequence[tuple[Sequence[str], Sequence[Any]]],
        *,
        lane: bool = False,
    ) -> list[Any]:
        """One script, several calls (keys, args), in one pipeline: one round trip per
        server (per node of a Cluster: redis-py's cluster pipeline groups by node); an error
        reply raises. With ``lane``, on the reserved lane."""
        if self.cluster is None:
            replies = await self.calls(lua, calls, lane=lane)
            for reply in replies:
                if isinstance(reply, rexc.ResponseError):
                    raise FlightError(f"Redis at {self.safe_url} refused a command: {reply}")
            return replies
        script = self.scripts.get(lua.name)
        if script is None:
            script = self.scripts[lua.name] = self.client.register_script(lua.text)

        async def send() -> list[Any]:
            for attempt in range(2):
                pipe: Any = self.client.pipeline(transaction=False)
                for keys, args in calls:
                    # (execute_command: redis-py refuses pipe.evalsha on a cluster, but routes
                    # the command by its keys like any other)
                    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
                try:
                    return list(await pipe.execute())
                except rexc.NoScriptError:
                    if attempt:
                        raise
                    await self.client.script_load(lua.text)  # a cluster loads it on every node
            raise AssertionError("unreachable")

        return await self.run(send, lane=lane)

    async def aclose(self) -> None:
        if self._convoy is not None:
            await self._convoy.aclose()
        master = self._master
        if master is not None:
            await master.stop_tracking()
        await self.listener.aclose()
        if self.cluster is not None:
            await self.cluster.aclose()
            return
        for client in (self.client, self.blocking):
            await client.aclose()
            await client.connection_pool.disconnect()  # a pool we made is ours to close
        if master is not None:
            await master.aclose()
