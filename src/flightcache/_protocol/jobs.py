"""What a flight computes: a value (``do``) or a stream of chunks (``stream``).

The protocol in ``_flight.py`` runs a job as its owner (``run``) and tells it what a
follower sees on the flight's stream (``on_claimed``, ``on_chunk``). A job's ``run`` returns
the encoded result that is stored and handed to every caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

from .._codec import NOT_FOUND_TAG, Envelope
from .._errors import BackendUnavailable, ValueTooLarge
from .._types import NOT_FOUND, Loader
from .context import FlightContext, invoke
from .streaming import COALESCED, MISS, LocalStream
from .tags import UNKNOWN, TagGate, Versions, tagged

STREAM_OVERHEAD = 8  # tag bytes plus a list header (JSON brackets, msgpack array prefix)
OWN = b"own"  # the generation of chunks this process produced itself

Producer = Callable[[], AsyncIterator[Any]]


class Append(Protocol):
    """Publishes chunks ``first_seq, first_seq+1, ...`` to followers; raises if fenced off."""

    # Set when the run has ended: an append still on the wire may then be overtaken by the
    # completion, and its refusal is no news (the completion's answer is).
    ended: bool

    def __call__(self, first_seq: int, batch: Sequence[bytes]) -> Awaitable[None]: ...


class LoaderJob:
    """``do``: one value from ``loader()``, or ``loader(context)`` for a loader that
    declares a parameter (``with_context``: it gets the run's ``FlightContext``)."""

    inline_ok = True  # a small value may ride inside the done event
    batched = False  # a do_many key: its completion goes out with its batch's
    tail: Sequence[bytes] = ()  # no chunks ride the completion
    tail_from = 0

    def __init__(
        self,
        loader: Loader,
        envelope: Envelope,
        digest: str,
        not_found: tuple[type[BaseException], ...] = (),
        *,
        key: Any = None,
        with_context: bool = False,
    ) -> None:
        self.loader = loader
        self.envelope = envelope
        self.digest = digest
        self.not_found = not_found  # exceptions that mean "does not exist"
        self.key = key  # the caller's key, for the loader's context
        self.with_context = with_context
        # Tags: the value is stored with their versions, read before the loader starts.
        self.tags: tuple[str, ...] = ()
        self.gate: TagGate | None = None
        self.versions_read: float | None = None  # when they were read (None: unknown)
        self.made: bytes | None = None  # the result this process's loader made, if it ran
        # (when the request that delivered the stored value was sent, its TTL in ms): set
        # when the result may be leased by a near cache
        self.lease: tuple[float, int] | None = None
        self.cost_ms: int | None = None  # how long the loader ran, when known

    def tag(self, tags: tuple[str, ...], gate: TagGate) -> None:
        """Store the result with ``tags`` (their versions read by ``gate``)."""
        self.tags, self.gate = tags, gate

    async def run(self, append: Append | None, context: FlightContext) -> bytes:
        versions = await self._versions() if self.tags else None
        encoded = await self._value(context)
        self.made = encoded if versions is None else tagged(versions, encoded)
        return self.made

    async def _value(self, context: FlightContext) -> bytes:
        try:
            value = await invoke(self.loader, context if self.with_context else None)
        except self.not_found:
            return NOT_FOUND_TAG
        if value is NOT_FOUND:
            return NOT_FOUND_TAG
        return self.envelope.encode(value, key=self.digest)

    async def _versions(self) -> Versions:
        """The tags' versions now, before the loader reads anything: an invalidation after
        this makes the result stale. Unknown when the server cannot say (fail-open)."""
        assert self.gate is not None
        sent = time.monotonic()
        try:
            versions = await self.gate.read(self.tags)
        except BackendUnavailable:
            self.versions_read = None
            return dict.fromkeys(self.tags, UNKNOWN)
        self.versions_read = sent
        return versions

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
    on the wire (one fenced script call per batch, in order). The chunks still unsent when
    the producer ends are left in ``tail`` for the completion to carry, with those of the
    append still on the wire, if any, which is not waited for: the stream's end costs one
    round trip, not the rest of an append and then the completion (docs/protocol.md, "Why
    the completion may overtake the append on the wire").
    """

    inline_ok = False  # followers have the chunks already
    batched = False

    def __init__(
        self, producer: Producer, envelope: Envelope, digest: str, local: LocalStream
    ) -> None:
        self.producer = producer
        self.envelope = envelope
        self.digest = digest
        self.local = local
        self.generation: bytes | None = None  # the claim whose chunks `local` holds
        self.lease: tuple[float, int] | None = None  # streams are not near-cached
        self.cost_ms: int | None = None
        self.key: Any = None
        self.tail: Sequence[bytes] = ()  # encoded, numbered from ``tail_from``
        self.tail_from = 0  # the chunks appended before the tail (their answer read)
        self.made: bytes | None = None  # the stored stream of this process's last run

    async def run(self, append: Append | None, context: FlightContext) -> bytes:
        self.local.opened(MISS)
        self.local.restart()  # a takeover: chunks of an earlier owner must not mix with ours
        self.generation = OWN
        chunks: list[Any] = []
        pending: list[bytes] = []
        on_wire: list[bytes] = []  # the batch of the append on the wire
        sent = 0
        size = STREAM_OVERHEAD  # the stored list: tags, brackets and one separator a chunk
        limit = self.envelope.max_value_bytes
        flusher: asyncio.Future[None] | None = None
        ending = False  # the producer has ended: what is pending rides the completion

        async def drain() -> None:
            """Send everything pending, batch after batch, until nothing is left (or, once
            the producer has ended, until the append on the wire is back)."""
            nonlocal sent
            assert append is not None
            while pending and not ending:
                on_wire[:] = pending
                del pending[:]
                await append(sent, on_wire)
                sent += len(on_wire)
                on_wire.clear()

        try:
            async for chunk in self.producer():
                data = self.envelope.encode_chunk(chunk, key=self.digest)
                size += len(data) + 1
                if size > limit:
                    raise ValueTooLarge(size, limit, key=self.digest)
                value = self.envelope.decode_chunk(data, key=self.digest)
                chunks.append(value)
                self.local.publish(value)
                if append is not None:
                    pending.append(data)
                    if flusher is None or flusher.done():
                        if flusher is not None:
                            flusher.result()  # a fenced append ends the run here
                        flusher = asyncio.ensure_future(drain())
        except Exception:
            # The producer failed: followers still get every chunk it made before, so all
            # callers see the same prefix before the error (best effort: fenced is fenced).
            if append is not None:
                with contextlib.suppress(Exception):
                    if flusher is not None:
                        await flusher
                    await drain()
            raise
        except BaseException:
            if flusher is not None:
                flusher.cancel()
            raise
        ending = True
        if flusher is not None and flusher.done():
            flusher.result()  # a fenced append ends the run here
        elif flusher is not None:  # not waited for: the completion carries its chunks too
            assert append is not None
            append.ended = True
            _leftovers.add(flusher)
            flusher.add_done_callback(_dropped)
        self.tail, self.tail_from = (*on_wire, *pending), sent
        self.made = self.envelope.encode_stream(chunks, key=self.digest)
        return self.made

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

_leftovers: set[asyncio.Future[None]] = set()  # appends still on the wire at their run's end


def _dropped(flusher: asyncio.Future[None]) -> None:
    """An append left on the wire by a run that ended came back: its answer is no news."""
    _leftovers.discard(flusher)
    if not flusher.cancelled():
        flusher.exception()
