"""Script calls sent together on one connection.

Three users share this: a batch of one script's calls (``do_many``'s joins, an owner's
completions), the owner's lease renewals on the reserved lane, and the :class:`Convoy`,
which gathers the calls made while every pooled connection is busy and sends them together
on the next connection that frees up, instead of each waiting for a connection of its own.
Every script here is safe to send twice (docs/protocol.md), so a batch that met a dead idle
connection goes again, once, on a fresh one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis import exceptions as rexc

from .scripts import Script, pack_command

Load = Callable[[Script], Awaitable[Any]]

STALE_S = 0.5  # a connection that fails this fast was dead before the command was sent


class Bulk:
    """Arguments already in RESP: ``parts``, each the bulk strings of one or more values
    joined (as ``pack_command`` writes each, without the array header), ``count`` values in
    all. What goes out again and again (a lease's keys and arguments, renewed every lease/3
    while its loader runs) is packed once, into bytes: the cyclic GC does not track bytes,
    so ten thousand leases' packings are not ten thousand lists it walks (docs/operations.md,
    "the cyclic GC"). A call's keys and args are both ``Bulk`` or neither."""

    __slots__ = ("count", "parts")

    def __init__(self, parts: list[bytes], count: int) -> None:
        self.parts = parts
        self.count = count


# script, keys, args: keys a sequence of str (args of str, bytes or int), or both a Bulk
Call = tuple[Script, Sequence[Any] | Bulk, Sequence[Any] | Bulk]


def bulk(*values: str | bytes | int) -> bytes:
    """``values`` as RESP bulk strings, joined, for a :class:`Bulk`. Written out here, not
    through ``pack_command``: a renewal tick packs thousands of flights' keys at once (a
    bound flight is renewed once or twice in its life, so its packing is rarely reused)
    while the loop waits for the GIL."""
    out = []
    for value in values:
        if isinstance(value, bytes):
            data = value
        elif isinstance(value, str):
            data = value.encode()
        else:
            data = b"%d" % value
        out.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(out)


def pack_calls(calls: Sequence[Call]) -> bytes:
    """``EVALSHA`` of every call, in RESP, exactly as ``pack_command`` writes each: the calls
    of one batch repeat most of their arguments (node id, TTLs, modes), encoded once here."""
    seen: dict[Any, bytes] = {}
    heads: dict[bytes, bytes] = {}
    out: list[bytes] = []
    for lua, keys, args in calls:
        head = heads.get(lua.sha)
        if head is None:  # the two bulk strings EVALSHA <sha>, without "*2"
            head = heads[lua.sha] = pack_command(b"EVALSHA", lua.sha)[4:]
        nkeys = keys.count if isinstance(keys, Bulk) else len(keys)
        nargs = args.count if isinstance(args, Bulk) else len(args)
        count = b"%d" % nkeys
        out.append(b"*%d\r\n%b$%d\r\n%b\r\n" % (3 + nkeys + nargs, head, len(count), count))
        if isinstance(keys, Bulk):
            assert isinstance(args, Bulk)
            out += keys.parts
            out += args.parts
            continue
        assert not isinstance(args, Bulk)
        for arg in (*keys, *args):
            kind = type(arg)
            if kind is str or kind is bytes or kind is int:  # not bool: True == 1 as a key
                part = seen.get(arg)
                if part is None:
                    data = arg if kind is bytes else arg.encode() if kind is str else b"%d" % arg
                    part = seen[arg] = b"$%d\r\n%b\r\n" % (len(data), data)
                out.append(part)
            else:
                out.append(pack_command(arg)[4:])
    return b"".join(out)


async def send_calls(
    pool: Any,
    calls: Sequence[Call],
    load: Load,
    *,
    lane: bool = False,
    sent: list[float] | None = None,
) -> list[Any]:
    """Each call's reply, in order, from one write on one pooled connection (the reserved
    lane's with ``lane``): an error reply is kept as that call's answer (a ``ResponseError``).
    NOSCRIPT (a restarted server) loads the scripts missing and sends those calls again; a
    connection found dead at once is dropped and the batch sent again on a fresh one;
    a connection interrupted mid-batch is dropped, never reused."""
    replies: list[Any] = [None] * len(calls)
    todo = list(range(len(calls)))
    loaded = resent = False
    while True:
        connection = await (pool.get_connection(lane=True) if lane else pool.get_connection())
        idle = connection.is_connected  # reused: the server may have closed it meanwhile
        written = time.monotonic()
        if sent is not None:
            sent.append(written)  # the first write is the one a lease may count from
        missing: list[int] = []
        try:
            await connection.send_packed_command(
                pack_calls([calls[i] for i in todo]), check_health=False
            )
            for i in todo:
                try:
                    replies[i] = await connection.read_response()
                except rexc.NoScriptError as exc:
                    replies[i] = exc
                    missing.append(i)
                except rexc.ResponseError as exc:  # an answer: the connection is fine
                    replies[i] = exc
        except (rexc.ConnectionError, OSError):
            await connection.disconnect(nowait=True)
            if resent or not idle or time.monotonic() - written > STALE_S:
                raise
            resent = True
            continue
        except BaseException:
            await connection.disconnect(nowait=True)
            raise
        finally:
            await pool.release(connection)
        if not missing or loaded:
            return replies
        loaded = True
        for lua in {calls[i][0].sha: calls[i][0] for i in missing}.values():
            await load(lua)
        todo = missing


class Convoy:
    """Every script call to one server, sent together with the others made meanwhile.

    A call made while none of this process's calls is on the wire goes at once, on a
    connection of its own (a lone call waits for nothing). A call made while others are out
    waits here instead: in the loop's next turn, the calls waiting then go out in writes of
    up to ``MAX_CALLS`` calls, each by a task on a connection of its own, all at once while
    at most ``MAX_WRITES`` are out; each task goes on while calls keep coming.
    The cap keeps callers from moving in lockstep: with one write for all, a hundred
    callers were answered together, took their next step together and waited together
    while the server ran their next calls, and the process sat idle for a quarter of the
    time; in small writes the server runs the first while the process answers the last.
    Concurrent callers cost one write and one read for many calls instead of a connection
    checkout, a write and a read each (the packing is what redis-py spends most of a call
    on), and a burst of ten thousand joins becomes about three hundred round trips, so a
    renewal never queues behind ten thousand waiters for a connection. A caller cancelled
    before its call went out is dropped from the batch; one cancelled after has its reply
    ignored (the scripts are safe either way).
    """

    MAX_CALLS = 32
    MAX_WRITES = 4

    def __init__(
        self,
        pool: Any,
        load: Load,
        direct: Callable[[Script, Sequence[str], Sequence[Any]], Awaitable[tuple[Any, float]]],
    ) -> None:
        self._pool = pool
        self._load = load
        self._direct = direct
        self._queue: list[tuple[Call, asyncio.Future[Any], float]] = []  # (.., queued at)
        self._out = 0  # calls sent alone and batches, on the wire now
        self._drains: set[asyncio.Task[None]] = set()
        self._fresh = 0  # drains started that have not taken their first batch yet
        self.batches = 0  # writes that carried waiting calls
        self.carried = 0  # the calls they carried

    async def call(
        self, lua: Script, keys: Sequence[str], args: Sequence[Any]
    ) -> tuple[Any, float]:
        """The call's reply, and how long it waited in this process before it was written;
        its error reply (a ``ResponseError``) or the pool's failure raised."""
        if self._out == 0 and not self._queue and not self._pool.saturated:
            self._out += 1
            try:
                return await self._direct(lua, keys, args)
            finally:
                self._out -= 1
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[Any, float]] = loop.create_future()
        self._queue.append(((lua, keys, args), future, time.monotonic()))
        # A drain started now takes its first batch in the loop's next turn, after the calls
        # made in this one: one more for each MAX_CALLS waiting that no drain about to
        # start will take, while fewer than MAX_WRITES are out. (Started here, not by a
        # callback at the end of the turn, which cost every queued call one turn more.)
        if len(self._queue) > self._fresh * self.MAX_CALLS and len(self._drains) < self.MAX_WRITES:
            self._fresh += 1
            self._drains.add(loop.create_task(self._drain()))  # (it leaves when it ends)
        return await future

    async def _drain(self) -> None:
        self._fresh -= 1
        batch: list[tuple[Call, asyncio.Future[Any], float]] = []
        try:
            while self._queue:
                batch = [item for item in self._queue[: self.MAX_CALLS] if not item[1].done()]
                del self._queue[: self.MAX_CALLS]
                if not batch:
                    continue
                self.batches += 1
                self.carried += len(batch)
                sent: list[float] = []
                self._out += 1
                try:
                    calls = [call for call, _, _ in batch]
                    replies = await send_calls(self._pool, calls, self._load, sent=sent)
                except Exception as exc:
                    for _, future, _ in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                finally:
                    self._out -= 1
                for (_, future, queued), reply in zip(batch, replies, strict=True):
                    if future.done():
                        continue
                    if isinstance(reply, rexc.ResponseError):
                        future.set_exception(reply)
                    else:
                        future.set_result((reply, sent[0] - queued))
                batch = []
                # Let the callers answered take their next step before more calls go out: a
                # claim's lease runs from when its join is sent, so its owner should start
                # (and register the lease for renewal) soon after, not behind later batches.
                await asyncio.sleep(0)
        except BaseException:
            for _, future, _ in (*batch, *self._queue):
                future.cancel()
            self._queue = []
            raise
        finally:
            # Out of the count in the step it ends, not by a done callback a turn later: a
            # call queued meanwhile would find the drains full, start none, and wait for
            # the next call to start one (for ever if none came).
            self._drains.discard(asyncio.current_task())

    async def aclose(self) -> None:
        drains, self._drains = list(self._drains), set()
        for task in drains:
            task.cancel()
        await asyncio.gather(*drains, return_exceptions=True)
