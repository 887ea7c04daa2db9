"""What one call learned about its flight, for its span and the follower-wait histogram.

A ``CallRecord`` is filled in as the call goes: its role (``hit``, ``owner``, ``takeover``,
``follower``, ``coalesced``), the fencing token of a run it owned, how long it waited for
a result someone else made. The protocol tells a job when this process runs it
(``run``: the owner, with the run's ``FlightContext``) and when it follows another
process's run (``on_follow``); the observed jobs here note both in the call's record and
otherwise are the jobs they extend. ``ObservedStream`` is a ``FlightStream`` that tells
its call's span where the stream stands (``_telemetry.py`` makes the spans; this room
imports no OpenTelemetry).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, Protocol

from .context import FlightContext
from .jobs import Append, LoaderJob, StreamJob
from .streaming import FlightStream, LocalStream

HIT, OWNER, TAKEOVER, FOLLOWER, COALESCED = "hit", "owner", "takeover", "follower", "coalesced"


class CallRecord:
    """One ``do`` or ``stream`` call's part in its flight, as far as this process saw it."""

    __slots__ = ("attempt", "fail_open", "first_at", "followed_at", "role", "token", "waited_s")

    def __init__(self) -> None:
        self.role: str | None = None  # None until known
        self.token = 0  # the fencing token of the run this process owned (0: none)
        self.attempt = 0  # that run's attempt: 1, or one more per takeover
        self.followed_at: float | None = None  # when this process began to follow (monotonic)
        self.waited_s: float | None = None  # how long it waited for someone else's result
        self.first_at: float | None = None  # a stream: when its first chunk arrived
        self.fail_open = False  # the flight was answered by this process alone

    def owned(self, context: FlightContext) -> None:
        """This process runs the flight's loader (again, if it followed before)."""
        self.role = TAKEOVER if context.attempt > 1 else OWNER
        self.token, self.attempt = context.token, context.attempt
        if self.followed_at is not None:
            self.waited_s = time.monotonic() - self.followed_at  # followed, then took over

    def followed(self) -> None:
        """This process follows another process's run of the flight."""
        if self.followed_at is None:
            self.followed_at = time.monotonic()
        self.role = FOLLOWER

    def answered(self) -> float | None:
        """The flight ended: a follower's wait (seconds), which it returns, is noted."""
        if self.role == FOLLOWER and self.followed_at is not None:
            self.waited_s = time.monotonic() - self.followed_at
            return self.waited_s
        return None


class _Observed:
    """Notes in ``record`` whether this process ran or followed the job: a mixin placed
    before the job class, whose ``run`` and ``on_follow`` it wraps."""

    record: CallRecord

    async def run(self, append: Append | None, context: FlightContext) -> bytes:
        self.record.owned(context)
        ran: bytes = await super().run(append, context)  # type: ignore[misc]
        return ran

    def on_follow(self, claim_entry: bytes) -> None:
        self.record.followed()
        super().on_follow(claim_entry)  # type: ignore[misc]


class ObservedLoaderJob(_Observed, LoaderJob):
    """A ``LoaderJob`` that notes in ``record`` whether this process ran or followed it."""


class ObservedStreamJob(_Observed, StreamJob):
    """A ``StreamJob`` that notes in ``record`` whether this process ran or followed it."""


class Observer(Protocol):
    """A call's span, as a stream sees it (``_telemetry.Call``)."""

    record: CallRecord

    def current(self) -> contextlib.AbstractContextManager[Any]:
        """The span is the current one while the block runs."""
        ...

    def end(self, error: BaseException | None = None, abandoned: bool = False) -> None: ...


class ObservedStream(FlightStream):
    """A ``FlightStream`` whose call has a span: current while the stream is attached (so
    the producer's task, started then, runs under it), ended with the stream."""

    def __init__(self, attach: Callable[[], tuple[LocalStream, bool]], call: Observer) -> None:
        super().__init__(attach)
        self._call = call

    def _ensure(self) -> LocalStream:
        if self._local is not None:
            return self._local
        with self._call.current():
            local = super()._ensure()
        if self._joined:  # another caller of this process started it
            self._call.record.role = COALESCED
        return local

    async def __anext__(self) -> Any:
        try:
            chunk = await super().__anext__()
        except StopAsyncIteration:
            self._call.end()
            raise
        except BaseException as exc:
            self._call.end(exc)
            raise
        record = self._call.record
        if record.first_at is None:
            record.first_at = time.monotonic()
        return chunk

    def ready(self) -> list[Any]:
        chunks = super().ready()
        if chunks and self._call.record.first_at is None:
            self._call.record.first_at = time.monotonic()
        return chunks

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            self._call.end(abandoned=True)  # unless it ended already
