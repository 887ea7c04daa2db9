"""Nodes: each FlightCache's liveness lease, its invalidation listener, and invalidations.

Every FlightCache that talks to a server is a node. It registers its id in a live set with
a TTL and renews it every ``node_ttl / 3`` (heartbeat in, lease out: a node that stops
renewing drops out of the live set when its TTL lapses, by the server's clock). It listens
on the namespace's invalidation channel: on a message it drops its near-cache copy of the
key and acknowledges. An invalidation waits for the acknowledgements of every live node
that keeps a near cache, or until the longest lease any of them could hold has lapsed,
whichever comes first, so its guarantee never depends on a message arriving.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from .._backends.redis import RedisConnection
from .._backends.scripts import scripts
from .._errors import FlightError, LeaseLost
from .._keys import FlightKeys, KeySpace
from .._types import Invalidation
from .._waits import within
from .near import NearCache

LUA = scripts(__package__, "live_nodes", "replace_result", "end_replace")

log = logging.getLogger("flightcache.nodes")

ACK_TTL_MS = 60_000
RELIST_EVERY = 10  # renewals between two SADDs of a node that stays live
INVALIDATE_CONCURRENCY = 8  # invalidations of one invalidate_many() under way at once


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One live node, as ``FlightCache.nodes()`` and ``flightcache status`` show it."""

    node_id: str
    host: str
    pid: int
    age_s: float
    lease_ms: int  # its near-cache lease (0: no near cache)
    owned: int  # flights it owns now
    near_entries: int
    near_hits: int
    near_misses: int
    ttl_left_ms: int  # how long its liveness lease still runs

    @property
    def near_hit_rate(self) -> float | None:
        total = self.near_hits + self.near_misses
        return self.near_hits / total if total else None


async def live_nodes(
    conn: RedisConnection, keyspace: KeySpace, *, leave: str = ""
) -> list[NodeInfo]:
    """The namespace's live nodes, by the server's clock (``leave``: remove that one first)."""
    client = conn.client
    members: Any = await conn.run(lambda: client.smembers(keyspace.nodes))
    ids = sorted({m.decode() for m in members} | ({leave} if leave else set()))
    keys = [keyspace.nodes, *(keyspace.node(i) for i in ids)]
    reply = await conn.script(LUA["live_nodes"], None, keys, (leave, *ids))
    nodes = []
    for i in range(0, len(reply), 3):
        try:
            info = orjson.loads(reply[i + 1])
        except orjson.JSONDecodeError:
            info = {}
        nodes.append(
            NodeInfo(
                node_id=reply[i].decode(),
                host=str(info.get("host", "")),
                pid=int(info.get("pid", 0)),
                age_s=float(info.get("age_s", 0.0)),
                lease_ms=int(info.get("lease_ms", 0)),
                owned=int(info.get("owned", 0)),
                near_entries=int(info.get("near_entries", 0)),
                near_hits=int(info.get("near_hits", 0)),
                near_misses=int(info.get("near_misses", 0)),
                ttl_left_ms=int(reply[i + 2]),
            )
        )
    return nodes


class Replacer(Protocol):
    """What deletes or replaces a stored result so that no node serves the old one:
    ``NodeAgent``, or on ``memory://``, where this process is the only node, the store."""

    async def replace(
        self, fk: FlightKeys, data: bytes | None, ttl_ms: int, if_token: int | None = None
    ) -> Invalidation: ...


async def invalidate_many(
    replace: Callable[[FlightKeys, bytes | None, int], Awaitable[Invalidation]],
    fks: Sequence[FlightKeys],
) -> list[Invalidation]:
    """Delete the stored result of every key with ``replace`` (a ``Replacer``'s, once the
    cache is ready), concurrently, each as ``invalidate`` does."""
    # Each waits on a blocking connection: at most a few at once, so a paused holder
    # cannot take every connection this process's followers need.
    gate = asyncio.Semaphore(INVALIDATE_CONCURRENCY)

    async def one(fk: FlightKeys) -> Invalidation:
        async with gate:
            return await replace(fk, None, 0)

    return list(await asyncio.gather(*(one(fk) for fk in fks)))


class NodeAgent:
    """This process's node in the namespace (one per FlightCache on a Redis backend)."""

    def __init__(
        self,
        conn: RedisConnection,
        keyspace: KeySpace,
        node_id: str,
        near: NearCache | None,
        *,
        near_lease_s: float,
        skew_margin_s: float,
        node_ttl_s: float,
        owned: Callable[[], int],
        conn_for: Callable[[FlightKeys], RedisConnection] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.conn = conn  # liveness, the invalidation channel: the designated server
        # A key's own server (client-side sharding puts each flight on one of several).
        self.conn_for = conn_for or (lambda _fk: conn)
        self.keyspace = keyspace
        self.node_id = node_id
        self.near = near
        self.near_lease_s = near_lease_s if near is not None else 0.0
        self.skew_margin_s = skew_margin_s
        self.node_ttl_s = node_ttl_s
        self.owned = owned
        self.clock = clock
        self.started = clock()
        self.seq = 0  # invalidations heard (and reconnects): a read that saw it move is not leased
        self._tasks: list[asyncio.Task[None]] = []
        self._acks: set[asyncio.Task[Any]] = set()  # acknowledgements, invalidations under way
        if near is not None:  # invalidations arrive on the connection's one listener
            conn.listener.add(keyspace.invalidations, self._heard, self._forget_all)
        # Until when the live set surely lists this node: a near-cache copy must not be
        # trusted past it, or an invalidation could stop waiting for a node still serving.
        self.live_until = clock()
        self._longest_s = self.near_lease_s  # the longest near-cache lease heard of
        self._listed = False  # the last renewal made sure the id is in the node set
        self._renewals = 0

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        registered = True
        try:
            await self._renew()  # live before the first call returns
        except FlightError as exc:  # the heartbeat keeps trying; calls decide for themselves
            registered = False
            log.info("node %s: could not register as live yet: %s", self.node_id, exc)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._heartbeat()))
        if self.near is not None and registered:
            # A server that answered: hear invalidations before serving (the connection
            # started its listener when it opened).
            await self.conn.listener.wait_subscribed(3.0)

    async def aclose(self) -> None:
        tasks = [*self._tasks, *self._acks]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        with contextlib.suppress(FlightError, asyncio.TimeoutError):
            await within(self._live(leave=True), 1.0)  # leave the live set now

    # -- liveness ------------------------------------------------------------------------

    def _info(self) -> bytes:
        near = self.near
        return orjson.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "age_s": round(self.clock() - self.started, 3),
                "lease_ms": int(self.near_lease_s * 1000),
                "owned": self.owned(),
                "near_entries": len(near) if near is not None else 0,
                "near_hits": near.hits if near is not None else 0,
                "near_misses": near.misses if near is not None else 0,
            }
        )

    async def _renew(self) -> None:
        """One command a renewal: the node's lease key, set with the TTL (the server's
        clock decides when it lapses). The id is added to the set when that key was gone
        (the first renewal, or after a lapse, when ``live_nodes`` may have pruned it), when
        the last renewal was not answered (its SET may have found the key, its SADD never
        sent), and every ``RELIST_EVERY`` renewals (a set lost to a failover comes back)."""
        sent = self.clock()
        # On the reserved lane: a burst of calls never delays the node's liveness.
        client, key = self.conn.lane, self.keyspace.node(self.node_id)
        ttl_ms = int(self.node_ttl_s * 1000)
        info = self._info()
        listed, self._listed = self._listed, False  # unknown until this one is answered
        before = await self.conn.run(lambda: client.set(key, info, px=ttl_ms, get=True), lane=True)
        self._renewals += 1
        if before is None or not listed or self._renewals % RELIST_EVERY == 0:
            await self.conn.run(lambda: client.sadd(self.keyspace.nodes, self.node_id), lane=True)
        self._listed = True
        # The server keeps this node live until at least one TTL after the renewal was sent.
        self.live_until = sent + self.node_ttl_s

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.node_ttl_s / 3)  # heartbeat interval
            try:
                await self._renew()
            except FlightError as exc:
                log.info("node %s: liveness renewal failed, retrying: %s", self.node_id, exc)

    async def _live(self, *, leave: bool = False) -> list[NodeInfo]:
        return await live_nodes(self.conn, self.keyspace, leave=self.node_id if leave else "")

    async def live(self) -> list[NodeInfo]:
        return await self._live()

    # -- hearing invalidations -----------------------------------------------------------

    def _forget_all(self) -> None:
        if self.near is not None:
            self.near.clear()
        self.seq += 1

    def _heard(self, data: bytes) -> None:
        """An invalidation: of one key (``d``) or of tags (``t``), by node ``f``."""
        try:
            message = orjson.loads(data)
            invalidation, sender = message["i"], message["f"]
            tags = message.get("t")
            if tags is None:
                digest = message["d"]
                key = self.keyspace.ack(digest, invalidation)
                conn = self.conn_for(self.keyspace.for_digest(digest))
            else:
                tags = [str(tag) for tag in tags]
                key, conn = self.keyspace.tag_acks(invalidation), self.conn
        except (orjson.JSONDecodeError, KeyError, TypeError):
            log.warning("node %s: malformed invalidation message ignored", self.node_id)
            return
        self.seq += 1
        if self.near is not None:
            if tags is None:
                self.near.drop(digest)
            else:
                self.near.drop_tags(tags)
        if sender != self.node_id:
            task = asyncio.get_running_loop().create_task(self._ack(key, conn))
            self._acks.add(task)
            task.add_done_callback(self._acks.discard)

    async def _ack(self, key: str, conn: RedisConnection) -> None:
        client = conn.client

        async def push() -> None:
            pipe: Any = client.pipeline(transaction=False)
            pipe.rpush(key, self.node_id).pexpire(key, ACK_TTL_MS)
            await pipe.execute()

        try:
            await conn.run(push)
        except FlightError as exc:  # the invalidator will wait out the lease instead
            log.info("node %s: could not acknowledge an invalidation: %s", self.node_id, exc)

    # -- invalidating --------------------------------------------------------------------

    async def replace(
        self, fk: FlightKeys, data: bytes | None, ttl_ms: int, if_token: int | None = None
    ) -> Invalidation:
        """Delete (``data`` None) or replace the stored result, then make sure no node
        keeps serving the old one: acknowledgements, or the longest lease lapsing. With
        ``if_token``, only while that token is the key's flight owner's (else
        ``LeaseLost``, and nothing is written).

        Once the delete is done, the rest runs to its end even if the caller is cancelled
        (other nodes must still hear of it, and the marker end when they have)."""
        started = self.clock()
        if self.near is not None:
            self.near.drop(fk.digest)
        self.seq += 1
        # The longest lease any node could hold, as far as this node has heard (its own, and
        # every live node's it has read): the marker lasts that long, from before the delete.
        wait_s = self._longest_s + self.skew_margin_s
        invalidation = os.urandom(8).hex()
        conn = self.conn_for(fk)
        existed = await conn.script(
            LUA["replace_result"],
            fk,
            (fk.result, fk.marker, fk.meta, fk.cost),
            (
                invalidation,
                max(1, int(wait_s * 1000)),
                data or b"",
                ttl_ms,
                "" if if_token is None else if_token,
            ),
        )
        if int(existed) < 0:
            raise LeaseLost(
                f"token {if_token} is not the owner's of this key: nothing was written",
                key=fk.digest,
                token=if_token,
            )
        # The leases to outwait started no later than now: the delete has happened.
        deadline = self.clock() + wait_s
        if data is None and not int(existed):
            return Invalidation("absent", 0, 0, self.clock() - started)
        work = asyncio.ensure_future(
            self._outwait(fk, conn, invalidation, started, deadline, wait_s)
        )
        self._acks.add(work)
        work.add_done_callback(self._acks.discard)
        return await asyncio.shield(work)

    async def invalidate_tags(
        self, tags: tuple[str, ...], bump: Callable[[], Awaitable[None]]
    ) -> Invalidation:
        """Make every result stored with one of ``tags`` unreadable (``bump``: increment
        their versions, one counter a tag), then make sure no node serves a copy of one:
        every holder drops the copies carrying those tags and acknowledges, or the longest
        lease lapses. As ``replace``, the rest runs to its end once the bump is done."""
        started = self.clock()
        if self.near is not None:
            self.near.drop_tags(tags)
        self.seq += 1
        wait_s = self._longest_s + self.skew_margin_s
        invalidation = os.urandom(8).hex()
        await bump()
        # Every copy to outwait was leased from a read sent before the bump's reply.
        deadline = self.clock() + wait_s
        message = orjson.dumps({"t": list(tags), "i": invalidation, "f": self.node_id})

        async def outwait() -> Invalidation:
            ack_key = self.keyspace.tag_acks(invalidation)
            how, holders, acked = await self._broadcast(
                message, ack_key, self.conn, deadline, wait_s
            )
            return Invalidation(how, len(holders), len(acked & holders), self.clock() - started)

        work = asyncio.ensure_future(outwait())
        self._acks.add(work)
        work.add_done_callback(self._acks.discard)
        return await asyncio.shield(work)

    async def _outwait(
        self,
        fk: FlightKeys,
        conn: RedisConnection,
        invalidation: str,
        started: float,
        deadline: float,
        wait_s: float,
    ) -> Invalidation:
        async def lengthen(ms: int) -> None:  # the marker lasts as long as the wait
            await conn.run(lambda: conn.client.pexpire(fk.marker, ms), fk)

        message = orjson.dumps({"d": fk.digest, "i": invalidation, "f": self.node_id})
        ack_key = self.keyspace.ack(fk.digest, invalidation)
        how, holders, acked = await self._broadcast(
            message, ack_key, self.conn_for(fk), deadline, wait_s, lengthen
        )
        if how == "acked":  # nobody can hold the old value: reads may lease again now
            await conn.script(LUA["end_replace"], fk, (fk.marker,), (invalidation,))
        return Invalidation(how, len(holders), len(acked & holders), self.clock() - started)

    async def _broadcast(
        self,
        message: bytes,
        ack_key: str,
        ack_conn: RedisConnection,
        deadline: float,
        wait_s: float,
        lengthen: Callable[[int], Awaitable[None]] | None = None,
    ) -> tuple[str, set[str], set[str]]:
        """Tell every node, then wait for the holders' acknowledgements on ``ack_key`` or
        the longest lease (from ``deadline``, which ``wait_s`` was counted for): ``how``
        (``acked`` or ``lease``), the holders waited for, those that acknowledged."""
        # Who may hold the old value is read after the change: a node that leased it was
        # live then (it leases only while its own liveness lease holds, which the server's
        # outlasts), so it is listed; a node that joins later reads after the marker (or
        # the new tag versions), and a marked (or stale) read is not leased.
        live = await self._live()
        longest_s = max([self._longest_s, *(n.lease_ms / 1000 for n in live)])
        self._longest_s = longest_s
        if longest_s + self.skew_margin_s > wait_s:  # a longer lease than the wait assumed
            deadline += longest_s + self.skew_margin_s - wait_s
            if lengthen is not None:
                await lengthen(max(int((deadline - self.clock()) * 1000), 1))
        holders = {n.node_id for n in live if n.lease_ms > 0 and n.node_id != self.node_id}
        # This node renews its liveness: if the server does not list it although its own
        # lease says it must, the server's live set cannot be trusted (its clock stepped
        # forward, or a failover lost the set): wait for the longest lease instead.
        trusted = self.clock() >= self.live_until or any(n.node_id == self.node_id for n in live)
        client = self.conn.client
        await self.conn.run(lambda: client.publish(self.keyspace.invalidations, message))
        acked = await self._await_acks(ack_key, ack_conn, holders, deadline)
        if not trusted:
            log.warning(
                "node %s: the server's live set does not list this node; waiting out the "
                "longest lease (%.2f s) instead of trusting acknowledgements",
                self.node_id,
                longest_s,
            )
            left = deadline - self.clock()
            if left > 0:
                await asyncio.sleep(left)  # the longest lease interval: then no copy is left
        return ("acked" if trusted and holders <= acked else "lease"), holders, acked

    async def _await_acks(
        self, key: str, conn: RedisConnection, holders: set[str], deadline: float
    ) -> set[str]:
        client = conn.blocking
        cap = max(conn.socket_timeout - 0.5, 0.1)
        acked: set[str] = set()
        while not holders <= acked:
            left = deadline - self.clock()
            if left <= 0:
                break  # the longest lease has lapsed: acknowledgements no longer matter
            block = min(left, cap)
            reply: Any = await conn.run(functools.partial(client.blpop, [key], block))
            if reply:
                acked.add(reply[1].decode())
        return acked
