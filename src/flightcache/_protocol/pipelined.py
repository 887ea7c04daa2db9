"""Many calls of one script in one round trip, each answered on its own.

``do_many`` sends the joins of all its keys together, and its owner sends the completions
of a batch together. One refused call (a key holding another application's value, say)
must fail only its own key, so each reply is kept apart: a reply, or the ``FlightError``
the server answered for that call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from redis import exceptions as rexc
from redis.crc import key_slot

from .._backends.redis import RedisConnection
from .._backends.scripts import Script
from .._errors import BackendUnavailable, FlightError

Call = tuple[Sequence[str], Sequence[Any]]  # keys, args
T = TypeVar("T")


def script_batches(
    items: Sequence[T], key: Callable[[T], str], cluster: bool, size: int
) -> list[list[T]]:
    """``items`` cut into the batches of one many-key script call each: on a Cluster, one
    per slot of ``key(item)`` (a script cannot span slots); on one server, slices of up to
    ``size``, in order."""
    if cluster:
        slots: dict[int, list[T]] = {}
        for item in items:
            slots.setdefault(key_slot(key(item).encode()), []).append(item)
        return list(slots.values())
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


async def script_calls(conn: RedisConnection, lua: Script, calls: Sequence[Call]) -> list[Any]:
    """Each call's reply, in order, or a ``FlightError`` for a call the server refused.
    One round trip on a server; on a Cluster, one per node (redis-py's cluster pipeline).
    An unreachable server raises ``BackendUnavailable`` for all."""
    if not calls:
        return []
    if conn.cluster is not None:
        try:
            return await conn.pipeline_script(lua, calls)
        except BackendUnavailable:
            raise
        except FlightError:  # one call refused the whole pipeline: ask each on its own
            answers = await asyncio.gather(
                *(conn.script(lua, None, keys, args) for keys, args in calls),
                return_exceptions=True,
            )
            for answer in answers:
                if isinstance(answer, BaseException) and not isinstance(answer, FlightError):
                    raise answer from None
            return list(answers)
    replies = await conn.calls(lua, calls)
    return [
        FlightError(f"Redis at {conn.safe_url} refused a command: {r}")
        if isinstance(r, rexc.ResponseError)
        else r
        for r in replies
    ]


class Together:
    """Calls of one script made at about the same time, sent in one round trip: a call
    waits until no other call has joined it for one turn of the event loop (at most
    ``MAX_TURNS`` turns and ``MAX_WAIT_S``), then all of them go out together
    (``script_calls``). The owner sends the completions of a batch this way: its keys
    finish in the same few turns; followers send their lease re-checks (peeks) so."""

    MAX_TURNS = 16
    # ...and at most this long: on a busy loop a turn takes milliseconds, and calls that keep
    # coming (ten thousand flights ending within seconds) must not hold each batch for 16.
    MAX_WAIT_S = 0.002

    def __init__(self, conn: RedisConnection, lua: Script) -> None:
        self.conn = conn
        self.lua = lua
        self._queue: list[tuple[Call, asyncio.Future[Any]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def call(self, keys: Sequence[str], args: Sequence[Any]) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append(((keys, args), future))
        if self._flusher is None:
            self._flusher = asyncio.ensure_future(self._flush())
        return await future

    async def _flush(self) -> None:
        try:
            seen = -1
            loop = asyncio.get_running_loop()
            until = loop.time() + self.MAX_WAIT_S
            for _ in range(self.MAX_TURNS):  # let the others made in these turns join
                if len(self._queue) == seen or loop.time() >= until:
                    break
                seen = len(self._queue)
                await asyncio.sleep(0)
        finally:
            batch, self._queue, self._flusher = self._queue, [], None
        try:
            replies = await script_calls(self.conn, self.lua, [call for call, _ in batch])
        except BaseException as exc:
            for _, future in batch:
                if not future.done():
                    if isinstance(exc, Exception):
                        future.set_exception(exc)
                    else:
                        future.cancel()
            if not isinstance(exc, Exception):
                raise
            return
        for (_, future), reply in zip(batch, replies, strict=True):
            if future.done():
                continue
            if isinstance(reply, FlightError):
                future.set_exception(reply)
            else:
                future.set_result(reply)
