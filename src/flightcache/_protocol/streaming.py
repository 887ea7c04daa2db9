"""Streams in one process: the chunks of a stream flight, fanned out to local callers.

One ``LocalStream`` per key and process holds the chunks seen so far (produced here, or
read from the flight's Redis stream) and wakes its subscribers as chunks arrive. A
``FlightStream`` is what ``FlightCache.stream`` returns: an async iterator over one
subscription, with ``source`` telling where its chunks come from.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .._errors import StreamRestarted

HIT, MISS, COALESCED = "HIT", "MISS", "COALESCED"
PRUNE_AT = 64  # waiters kept before the ones whose subscriber left are dropped


class LocalStream:
    """Chunks of one stream flight in this process, and who waits for more.

    Each subscriber that waits for news gets a future of its own (the ``_Slot`` way of
    ``local.py``): a subscriber cancelled cancels only its own, and news reaches each of
    the others with one wake-up. A shared future would need a shield around it, and the
    shield costs each subscriber one more callback and one more turn of the loop for every
    chunk, the first and the end included.
    """

    def __init__(self, digest: str, table_key: str | None = None) -> None:
        self.digest = digest
        self.table_key = table_key or digest
        self.chunks: list[Any] = []
        self.generation = 0
        self.done = False
        self.error: BaseException | None = None
        self.source: str | None = None  # HIT, MISS (this process owns), COALESCED
        self._waiters: list[asyncio.Future[None]] = []

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():  # (done: its subscriber left, cancelled)
                fut.set_result(None)

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

    def _changed(self) -> asyncio.Future[None]:
        """A future of the caller's own, done at the next news (a chunk, the end, an
        error, a restart, the source known)."""
        if len(self._waiters) >= PRUNE_AT:  # waits given up (timed out) since the last news
            self._waiters = [fut for fut in self._waiters if not fut.done()]
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        return fut

    async def wait_opened(self) -> str:
        while self.source is None and self.error is None:
            await self._changed()
        if self.source is None:
            assert self.error is not None
            raise self.error
        return self.source

    def subscribe(self) -> Cursor:
        return Cursor(self)


class Cursor:
    """One subscriber's place in a :class:`LocalStream`: the chunks it has had, of which
    generation (a restart after chunks were delivered is ``StreamRestarted``)."""

    __slots__ = ("generation", "index", "local")

    def __init__(self, local: LocalStream) -> None:
        self.local = local
        self.generation, self.index = local.generation, 0

    def ready(self) -> list[Any]:
        """The chunks that are here now and not had yet, without waiting (none when the
        stream restarted: ``next`` says so)."""
        local = self.local
        if self.generation != local.generation or self.index >= len(local.chunks):
            return []
        chunks = local.chunks[self.index :]
        self.index = len(local.chunks)
        return chunks

    async def next(self) -> Any:
        """The next chunk, waiting for it; StopAsyncIteration at the stream's end."""
        local = self.local
        while True:
            if self.generation != local.generation:
                if self.index:
                    raise StreamRestarted(
                        "the stream's owner died after chunks were delivered; a new owner "
                        "started it again (retry the request)",
                        key=local.digest,
                    )
                self.generation = local.generation
            if self.index < len(local.chunks):
                self.index += 1
                return local.chunks[self.index - 1]
            if local.error is not None:
                raise local.error
            if local.done:
                raise StopAsyncIteration
            await local._changed()


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
        self._cursor: Cursor | None = None
        self._closed = False

    def _ensure(self) -> LocalStream:
        if self._local is None:
            self._local, self._joined = self._attach()
            self._cursor = self._local.subscribe()
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
        if self._closed:
            raise StopAsyncIteration
        self._ensure()
        assert self._cursor is not None
        return await self._cursor.next()

    def ready(self) -> list[Any]:
        """The chunks that have arrived and were not iterated yet, at once and without
        waiting (``[]`` when there are none, or when the next ``__anext__`` has news: the
        end, an error, a restart). For callers that forward chunks and would rather write
        the ones that came together in one go."""
        return [] if self._cursor is None or self._closed else self._cursor.ready()

    async def aclose(self) -> None:
        self._closed = True
