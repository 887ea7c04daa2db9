"""This process's side of every stream flight (``fc.stream``): one ``LocalStream`` per key,
shared by the process's callers of that key, fed by one task that joins or runs the flight.

A part of ``LocalFlights`` (``local.py``), which owns the tables, the tasks and the
connection to the server that the methods here use.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from .._codec import Envelope
from .._errors import ConfigError, FlightError, SerializationError
from .._keys import FlightKeys
from .._types import CallOptions, Stats
from .base import Flights
from .jobs import Producer, StreamJob
from .observed import CallRecord, ObservedStream, ObservedStreamJob, Observer
from .streaming import HIT, FlightStream, LocalStream


class LocalStreams:
    """The stream half of ``LocalFlights``: ``stream`` and the task behind each key."""

    stats: Stats
    envelope: Envelope
    ready: Callable[[], Awaitable[Flights]]
    streams: dict[str, LocalStream]
    closed: bool
    spawn: Callable[[Coroutine[Any, Any, Any]], None]  # runs work in a task it owns

    def stream(
        self, fk: FlightKeys, producer: Producer, opts: CallOptions, call: Observer | None = None
    ) -> FlightStream:
        """A subscription to the stream flight of ``fk``, shared by this process's callers;
        ``call``: a traced call's span, told where the stream stands."""
        record = call.record if call is not None else None
        table_key = fk.digest + "!" if opts.refresh else fk.digest

        def attach() -> tuple[LocalStream, bool]:
            local = self.streams.get(table_key)
            if local is not None:  # local single-flight for streams
                self.stats.coalesced += 1
                return local, True
            local = LocalStream(fk.digest, table_key)
            if self.closed:
                local.fail(FlightError("this FlightCache is closed", key=fk.digest))
                return local, False
            self.streams[table_key] = local
            self.spawn(self._run_stream(fk, producer, opts, local, record))
            return local, False

        return FlightStream(attach) if call is None else ObservedStream(attach, call)

    async def _run_stream(
        self,
        fk: FlightKeys,
        producer: Producer,
        opts: CallOptions,
        local: LocalStream,
        record: CallRecord | None = None,
    ) -> None:
        try:
            flights = await self.ready()
            handle = flights.prepare(fk)
            try:
                opening = await flights.begin(fk, opts, handle)
            except asyncio.CancelledError:
                self.spawn(flights.abandon(fk, opts, handle))
                raise
            if opening.data is not None:
                self.stats.hits += 1
                if record is not None:
                    record.role = "hit"
                local.opened(HIT)
                local.complete(self._stream_chunks(opening.data, fk))
                return
            if record is None:
                job = StreamJob(producer, self.envelope, fk.digest, local)
            else:
                job = ObservedStreamJob(producer, self.envelope, fk.digest, local)
                job.record = record
            data = await flights.resolve(fk, job, opts, opening.handle)
            local.opened(HIT)  # no-op unless the join itself found the result
            # b"": every chunk was read here; this process's own run: every chunk was made
            # here (the very object its run encoded, so no later run's or owner's result)
            mine = data == b"" or data is job.made
            local.complete(None if mine else self._stream_chunks(data, fk))
        except asyncio.CancelledError:
            local.fail(FlightError("the FlightCache was closed", key=fk.digest))
            raise
        except BaseException as exc:
            local.fail(exc)
        finally:
            if self.streams.get(local.table_key) is local:
                del self.streams[local.table_key]

    def _stream_chunks(self, data: bytes, fk: FlightKeys) -> list[Any]:
        if not self.envelope.is_stream(data) and not self.envelope.is_error(data):
            raise ConfigError("this key holds a value stored by do(), not a stream", key=fk.digest)
        chunks = self.envelope.decode(data, key=fk.digest)  # an error record raises here
        if not isinstance(chunks, list):
            raise SerializationError("a stored stream is not a list of chunks", key=fk.digest)
        return chunks
