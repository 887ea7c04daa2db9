"""Streams in one process: the chunks of a stream flight, fanned out to local callers.

One ``LocalStream`` per key and process holds the chunks seen so far (produced here, or
read from the flight's Redis stream) and wakes its subscribers as chunks arrive. A
``FlightStream`` is what ``FlightCache.stream`` returns: an async iterator over one
subscription, with ``source`` telling where its chunks come from.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from .._errors import StreamRestarted

HIT, MISS, COALESCED = "HIT", "MISS", "COALESCED"


class LocalStream:
    """Chunks of one stream flight in this process, and who waits for more."""

    def __init__(self, digest: str, table_key: str | None = None) -> None:
        self.digest = digest
        self.table_key = table_key or digest
        self.chunks: list[Any] = []
        self.generation = 0
        self.done = False
        self.error: BaseException | None = None
        self.source: str | None = None  # HIT, MISS (this process owns), COALESCED
        self._changed: asyncio.Future[None] | None = None

    def _wake(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None

    def opened(self, source: str) -> None:
        if self.source is None:
            self.source = source
            self._wake()

    def publish(self, chunk: Any) -> None:
        self.chunks.append(chunk)
        self._wake()

    def restart(self) -> None:
        """A new owner starts over: callers that had chunks get StreamRestarted."""
        if self.chunks:
            self.generation += 1
            self.chunks = []
            self._wake()

    def complete(self, chunks: list[Any] | None) -> None:
        """The flight ended with ``chunks`` (None: the ones published here are all)."""
        if chunks is not None and chunks[: len(self.chunks)] != self.chunks:
            self.restart()  # what we showed is not a prefix of the result: never mix
        if chunks is not None:
            self.chunks.extend(chunks[len(self.chunks) :])
        self.done = True
        self._wake()

    def fail(self, error: BaseException) -> None:
        if not self.done and self.error is None:
            self.error = error
            self._wake()

    async def _changed_or_now(self) -> None:
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._changed)

    async def wait_opened(self) -> str:
        while self.source is None and self.error is None:
            await self._changed_or_now()
        if self.source is None:
            assert self.error is not None
            raise self.error
        return self.source

    async def subscribe(self) -> AsyncIterator[Any]:
        generation, index = self.generation, 0
        while True:
            if generation != self.generation:
                if index:
                    raise StreamRestarted(
                        "the stream's owner died after chunks were delivered; a new owner "
                        "started it again (retry the request)",
                        key=self.digest,
                    )
                generation = self.generation
            if index < len(self.chunks):
                index += 1
                yield self.chunks[index - 1]
            elif self.error is not None:
                raise self.error
            elif self.done:
                return
            else:
                await self._changed_or_now()


class FlightStream:
    """``async for chunk in fc.stream(key, producer)``; ``source`` is HIT, MISS or COALESCED.

    ``await stream.opened()`` waits until the source is known (before the first chunk), for
    callers that must say it before they send anything, like an HTTP gateway's headers.
    Leaving the loop early stops this caller only; the flight goes on for the others.
    """

    def __init__(self, attach: Callable[[], tuple[LocalStream, bool]]) -> None:
        self._attach = attach
        self._local: LocalStream | None = None
        self._joined = False
        self._iter: AsyncIterator[Any] | None = None

    def _ensure(self) -> LocalStream:
        if self._local is None:
            self._local, self._joined = self._attach()
            self._iter = self._local.subscribe()
        return self._local

    @property
    def source(self) -> str | None:
        local = self._local
        if local is None or local.source is None:
            return None
        if self._joined and local.source == MISS:
            return COALESCED  # this process runs it, but another caller started it
        return local.source

    async def opened(self) -> str:
        await self._ensure().wait_opened()
        source = self.source
        assert source is not None
        return source

    def __aiter__(self) -> FlightStream:
        return self

    async def __anext__(self) -> Any:
        self._ensure()
        assert self._iter is not None
        return await self._iter.__anext__()

    async def aclose(self) -> None:
        if self._iter is not None:
            await self._iter.aclose()  # type: ignore[attr-defined]
