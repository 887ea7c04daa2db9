"""``Flights``: what every way of running flights implements, and all the front door uses.

Implemented by ``RedisFlights`` (one server or cluster, ``flight.py``), ``ShardedFlights``
(several servers, ``sharded.py``), ``MemoryFlights`` (this process only, ``memory.py``) and
``FailOpen`` (a server's flights, answered by this process while the server is down).
"""

from __future__ import annotations

from typing import Protocol

from .._keys import FlightKeys
from .._types import CallOptions, FlightInfo
from .jobs import Job


class Flights(Protocol):
    async def lookup(self, fk: FlightKeys) -> bytes | None:
        """The stored result (value, stream or error record), or None."""
        ...

    async def lookup_full(self, fk: FlightKeys) -> tuple[bytes | None, int, bool, int]:
        """The stored result, the time in ms the server vouches it has left (0: nothing to
        lease or track), whether it may be leased, and what it cost to compute, in ms."""
        ...

    async def resolve(self, fk: FlightKeys, job: Job, opts: CallOptions) -> bytes:
        """The result of the flight: stored, followed, or computed by running ``job``."""
        ...

    async def inspect(self, fk: FlightKeys) -> FlightInfo: ...
