"""``Flights``: what every way of running flights implements, and all the front door uses.

Implemented by ``RedisFlights`` (one server or cluster, ``flight.py``), ``ShardedFlights``
(several servers, ``sharded.py``), ``MemoryFlights`` (this process only, ``memory.py``) and
``FailOpen`` (a server's flights, answered by this process while the server is down).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .._errors import FlightError
from .._keys import FlightKeys
from .._types import CallOptions, FlightInfo
from .jobs import Job


@dataclass(slots=True)
class Opening:
    """A call's first read (``Flights.begin``): a stored result (``data``; its time left
    the server vouches for, whether it may be leased, its cost), or ``data`` None and the
    flight under way, which ``handle`` hands on to ``resolve``."""

    data: bytes | None
    ttl_left_ms: int = 0
    leasable: bool = False
    cost_ms: int = 0
    handle: Any = None


class Flights(Protocol):
    def prepare(self, fk: FlightKeys) -> Any:
        """What a call's first read needs before it is sent (a claim id, a waiter for
        wake-ups): the handle ``begin``, ``resolve`` and ``abandon`` take."""
        ...

    async def begin(self, fk: FlightKeys, opts: CallOptions, handle: Any) -> Opening:
        """A call's first read: the stored result, or where its flight stands (kept in
        ``handle``; on one Redis server that read may already have claimed the flight)."""
        ...

    async def begin_many(
        self, fks: Sequence[FlightKeys], opts: Sequence[CallOptions], handles: Sequence[Any]
    ) -> list[Opening | FlightError]:
        """``begin`` for several keys at once (``do_many``; each key's own options), sent
        together where the backend can; an error the server answered for one key is that
        key's alone."""
        ...

    async def abandon(self, fk: FlightKeys, opts: CallOptions, handle: Any) -> None:
        """The caller left after ``begin`` was sent and nobody else waits: give back a
        claim it may have made, and forget the handle."""
        ...

    def release(self, handle: Any) -> None:
        """Forget a handle that ``resolve`` will not get (its flight ran elsewhere)."""
        ...

    async def lookup(self, fk: FlightKeys) -> bytes | None:
        """The stored result (value, stream or error record), or None."""
        ...

    async def lookup_full(self, fk: FlightKeys) -> tuple[bytes | None, int, bool, int]:
        """The stored result, the time in ms the server vouches it has left (0: nothing to
        lease or track), whether it may be leased, and what it cost to compute, in ms."""
        ...

    async def resolve(
        self, fk: FlightKeys, job: Job, opts: CallOptions, handle: Any = None
    ) -> bytes:
        """The result of the flight: stored, followed, or computed by running ``job``
        (``handle``: from ``prepare``, after a ``begin`` that found no stored result)."""
        ...

    async def inspect(self, fk: FlightKeys) -> FlightInfo: ...
