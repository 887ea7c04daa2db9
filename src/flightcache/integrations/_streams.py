"""The coalesced streams an SDK wrapper hands its stream callers: ``AsyncCoalescedStream``
(used like the SDK's ``AsyncStream``) and ``CoalescedStream`` (like its ``Stream``). Each
turns the flight's stored events into the SDK's own types as they come, and tells the
``Coalescer`` (``_core``) of the outcome once the stream ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .._protocol.streaming import FlightStream
from .._sync import FlightStreamSync

if TYPE_CHECKING:
    from ._core import Coalescer, Endpoint, _Call

F = TypeVar("F")  # the flight: FlightStream (async door) or FlightStreamSync


class _StreamBase(Generic[F]):
    """What both stream doors share: the flight, the events seen, conversion, the outcome
    at the end."""

    def __init__(
        self,
        coalescer: Coalescer,
        endpoint: Endpoint,
        call: _Call,
        flight: F,
        source: str,
        age: float | None,
        first: list[Any],
    ) -> None:
        self._flight = flight
        self._coalescer = coalescer
        self._endpoint = endpoint
        self._call = call
        self._convert = coalescer.convert(endpoint, call, source == "HIT")
        self._pending = list(first)
        self._seen = list(first)
        self._reported = False
        self.source = source  # HIT, MISS or COALESCED (the gateway's X-Cache)
        self.age = age  # seconds since a stored answer began (HIT)

    def _finished(self) -> None:
        if not self._reported:
            self._reported = True
            self._coalescer.finish(self._endpoint, self._call, self.source, self.age, self._seen)


class AsyncCoalescedStream(_StreamBase[FlightStream]):
    """A coalesced stream, used like the SDK's ``AsyncStream``: ``async for event in it``,
    ``async with``, ``await close()``; the events are the SDK's own types. ``source`` is
    ``HIT``, ``MISS`` or ``COALESCED``. Leaving early stops this caller only."""

    def __aiter__(self) -> AsyncCoalescedStream:
        return self

    async def __anext__(self) -> Any:
        while True:
            if self._pending:
                chunk = self._pending.pop(0)
            else:
                try:
                    chunk = await self._flight.__anext__()
                except StopAsyncIteration:
                    self._finished()
                    raise
                except Exception as exc:
                    raise self._coalescer.error(exc) from None
                self._seen.append(chunk)
            out = self._convert(chunk)
            if out is not None:
                return out

    async def close(self) -> None:
        await self._flight.aclose()

    async def __aenter__(self) -> AsyncCoalescedStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class CoalescedStream(_StreamBase[FlightStreamSync]):
    """A coalesced stream, used like the SDK's ``Stream``: ``for event in it``, ``with``,
    ``close()``; the events are the SDK's own types. ``source`` is ``HIT``, ``MISS`` or
    ``COALESCED``. Leaving early stops this caller only."""

    def __iter__(self) -> CoalescedStream:
        return self

    def __next__(self) -> Any:
        while True:
            if self._pending:
                chunk = self._pending.pop(0)
            else:
                try:
                    chunk = next(self._flight)
                except StopIteration:
                    self._finished()
                    raise
                except Exception as exc:
                    raise self._coalescer.error(exc) from None
                self._seen.append(chunk)
            out = self._convert(chunk)
            if out is not None:
                return out

    def close(self) -> None:
        self._flight.close()

    def __enter__(self) -> CoalescedStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
