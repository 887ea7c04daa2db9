"""What a flight computes: a value (``do``) or a stream of chunks (``stream``).

The protocol in ``_flight.py`` runs a job as its owner (``run``) and tells it what a
follower sees on the flight's stream (``on_claimed``, ``on_chunk``). A job's ``run`` returns
the encoded result that is stored and handed to every caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from ._codec import Envelope
from ._errors import ValueTooLarge
from ._streaming import COALESCED, MISS, LocalStream
from ._types import Loader

OWN = b"own"  # the generation of chunks this process produced itself

Producer = Callable[[], AsyncIterator[Any]]
Append = Callable[[int, Sequence[bytes]], Awaitable[None]]
"""Publishes chunks ``first_seq, first_seq+1, ...`` to followers; raises if fenced off."""


class LoaderJob:
    """``do``: one value from ``loader()``."""

    inline_ok = True  # a small value may ride inside the done event

    def __init__(self, loader: Loader, envelope: Envelope, digest: str) -> None:
        self.loader = loader
        self.envelope = envelope
        self.digest = digest

    async def run(self, append: Append | None) -> bytes:
        value = await self.loader()
        return self.envelope.encode(value, key=self.digest)

    def on_follow(self, claim_entry: bytes) -> None:
        """This process follows the flight whose claim is the stream entry ``claim_entry``."""

    def on_claimed(self, claim_entry: bytes) -> None:
        """A new owner claimed the flight (the one this process followed died)."""

    def on_chunk(self, seq: int, data: bytes) -> None:
        """A chunk of a stream flight: a value job has no use for it."""

    def has_all(self, count: int) -> bool:
        return False


class StreamJob:
    """``stream``: chunks from an async generator, live to local and remote followers.

    The owner publishes each chunk to its own process at once and to other processes
    through ``append``, batching whatever the producer made while the previous append was
    on the wire (one fenced script call per batch, in order).
    """

    inline_ok = False  # followers have the chunks already

    def __init__(
        self, producer: Producer, envelope: Envelope, digest: str, local: LocalStream
    ) -> None:
        self.producer = producer
        self.envelope = envelope
        self.digest = digest
        self.local = local
        self.generation: bytes | None = None  # the claim whose chunks `local` holds

    async def run(self, append: Append | None) -> bytes:
        self.local.opened(MISS)
        self.local.restart()  # a takeover: chunks of an earlier owner must not mix with ours
        self.generation = OWN
        chunks: list[Any] = []
        pending: list[bytes] = []
        sent = 0
        total = 0
        limit = self.envelope.max_value_bytes
        inflight: asyncio.Future[None] | None = None

        async def flush() -> None:
            nonlocal sent
            batch = pending[:]
            del pending[:]
            assert append is not None
            await append(sent, batch)
            sent += len(batch)

        try:
            async for chunk in self.producer():
                data = self.envelope.encode_chunk(chunk, key=self.digest)
                total += len(data)
                if total > limit:
                    raise ValueTooLarge(total, limit, key=self.digest)
                value = self.envelope.decode_chunk(data, key=self.digest)
                chunks.append(value)
                self.local.publish(value)
                if append is not None:
                    pending.append(data)
                    if inflight is None or inflight.done():
                        if inflight is not None:
                            inflight.result()  # a fenced append ends the run here
                        inflight = asyncio.ensure_future(flush())
            if inflight is not None:
                await inflight
            if pending:
                await flush()
        finally:
            if inflight is not None and not inflight.done():
                inflight.cancel()
        return self.envelope.encode_stream(chunks, key=self.digest)

    def on_follow(self, claim_entry: bytes) -> None:
        self.local.opened(COALESCED)
        self._generation(claim_entry)

    def on_claimed(self, claim_entry: bytes) -> None:
        self._generation(claim_entry)

    def _generation(self, claim_entry: bytes) -> None:
        """Chunks belong to one claim; a different claim means the chunks start over."""
        if self.generation is not None and claim_entry != self.generation:
            self.local.restart()
        self.generation = claim_entry

    def on_chunk(self, seq: int, data: bytes) -> None:
        if seq == len(self.local.chunks):
            self.local.publish(self.envelope.decode_chunk(data, key=self.digest))
        # A gap (seq ahead) cannot be filled from the stream: the final result fills it.

    def has_all(self, count: int) -> bool:
        return len(self.local.chunks) == count


Job = LoaderJob | StreamJob
