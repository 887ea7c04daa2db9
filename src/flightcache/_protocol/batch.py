"""Batch loading: one loader call for every key of a ``do_many`` whose flight this process owns.

Each key is a flight of its own, claimed, renewed, completed and fenced like any other
(docs/protocol.md, "Batch loading"). What the keys share is the loader: each key's job
(:class:`BatchKeyJob`) hands its run to the call's :class:`BatchLoad`, which waits until
every key whose flight may come to run here has either arrived or gone elsewhere (another
process owns it, or it was already stored), then calls the user's loader once with the keys
that arrived. A key whose flight this process claims later (a takeover while the batch
runs) arrives alone, or with the others of that moment, and goes into a later call.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol

from .._codec import NOT_FOUND_TAG, Envelope
from .._errors import FlightError
from .._keys import FlightKeys, KeySpace, canonical
from .._types import NOT_FOUND, CallOptions, Stats
from .base import Flights
from .context import FlightContext
from .jobs import Append, LoaderJob
from .local import LocalFlights

log = logging.getLogger("flightcache.batch")

GATHER_S = 0.2  # the longest a key that arrived waits for the others of its call
MISSING_MODES = ("not_found", "raise")

BatchLoader = Callable[..., Awaitable[Mapping[Any, Any]]]
"""``loader(keys)`` (or ``loader(keys, contexts)``) returning ``{key: value}``."""


def batch_arity(loader: Callable[..., Any]) -> int:
    """How many required positional parameters a batch loader declares: 1 (the keys) or
    2 (the keys and their ``FlightContext``s, in the same order)."""
    try:
        params = inspect.signature(loader).parameters.values()
    except (TypeError, ValueError):
        return 1
    required = [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    return 2 if len(required) == 2 else 1


class _Arrival:
    """A key whose flight this process owns, waiting for its batch's loader call."""

    __slots__ = ("context", "done", "job")

    def __init__(self, job: BatchKeyJob, context: FlightContext) -> None:
        self.job = job
        self.context = context
        self.done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()


class _Call:
    """One call of the user's loader, and the keys still waiting for it."""

    __slots__ = ("task", "waiting")

    def __init__(self, arrivals: list[_Arrival]) -> None:
        self.waiting = {id(a): a for a in arrivals}
        self.task: asyncio.Task[None] | None = None


class BatchLoad:
    """The loader of one ``do_many`` call, shared by the jobs of its keys."""

    def __init__(
        self, loader: BatchLoader, envelope: Envelope, *, missing: str, with_contexts: bool
    ) -> None:
        self.loader = loader
        self.envelope = envelope
        self.missing = missing
        self.with_contexts = with_contexts
        self.expected: set[str] = set()  # keys whose flight may still come to run here
        self.arrived: list[_Arrival] = []  # keys that came, not yet handed to a call
        self.calls = 0  # loader calls made
        self._running: set[_Call] = set()  # loader calls under way
        self._check: asyncio.Handle | None = None
        self._deadline: asyncio.TimerHandle | None = None

    # -- who to wait for -----------------------------------------------------------------

    def expect(self, digest: str) -> None:
        """A flight task starts for this key: it may come to run here."""
        self.expected.add(digest)

    def withdraw(self, digest: str) -> None:
        """This key's flight goes elsewhere (followed, stored, ended): do not wait for it."""
        if digest in self.expected:
            self.expected.discard(digest)
            self._soon()

    # -- arrivals ------------------------------------------------------------------------

    async def load(self, job: BatchKeyJob, context: FlightContext) -> bytes:
        """The encoded value of ``job``'s key, from the loader call it goes into."""
        arrival = _Arrival(job, context)
        self.arrived.append(arrival)
        self.expected.discard(job.digest)
        if self._deadline is None:  # nobody waits longer than GATHER_S for the others
            self._deadline = asyncio.get_running_loop().call_later(GATHER_S, self._fire)
        self._soon()
        try:
            return await asyncio.shield(arrival.done)
        except asyncio.CancelledError:
            self._leave(arrival)
            raise

    def _soon(self) -> None:
        """Look again once the keys arriving in this turn of the loop have arrived."""
        if self._check is None:
            self._check = asyncio.get_running_loop().call_soon(self._ready)

    def _ready(self) -> None:
        self._check = None
        if self.arrived and not self.expected:
            self._fire()

    def _fire(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        arrivals, self.arrived = self.arrived, []
        if not arrivals:
            return
        call = _Call(arrivals)
        call.task = asyncio.ensure_future(self._call(call, arrivals))
        call.task.add_done_callback(_retrieve)
        self.calls += 1

    def _leave(self, arrival: _Arrival) -> None:
        """A key's run was called off (its lease lost, its timeout, a close): a call that no
        key waits for any more is cancelled too."""
        if arrival in self.arrived:
            self.arrived.remove(arrival)
            return
        for call in list(self._running):
            if call.waiting.pop(id(arrival), None) is not None and not call.waiting:
                if call.task is not None:
                    call.task.cancel()

    async def _call(self, call: _Call, arrivals: list[_Arrival]) -> None:
        self._running.add(call)
        try:
            await self._load(arrivals)
        finally:
            self._running.discard(call)

    async def _load(self, arrivals: list[_Arrival]) -> None:
        keys = [a.job.key for a in arrivals]
        try:
            if self.with_contexts:
                result = await self.loader(keys, [a.context for a in arrivals])
            else:
                result = await self.loader(keys)
            if not isinstance(result, Mapping):
                raise FlightError(
                    f"a do_many loader returns a mapping of keys to values, not "
                    f"{type(result).__name__}"
                )
            found = {canonical(k): v for k, v in result.items()}
        except BaseException as exc:
            for a in arrivals:
                if not a.done.done():
                    if isinstance(exc, asyncio.CancelledError):
                        a.done.cancel()
                    else:
                        a.done.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for a in arrivals:
            if a.done.done():
                continue
            try:
                a.done.set_result(self._encode(a.job, found))
            except Exception as exc:  # this key's value alone: too large, not encodable
                a.done.set_exception(exc)

    def _encode(self, job: BatchKeyJob, found: dict[bytes, Any]) -> bytes:
        canon = canonical(job.key)
        if canon not in found:
            if self.missing == "raise":
                error = KeyError(job.key)
                error.flightcache_error_ttl = 0  # type: ignore[attr-defined]  # not cached
                raise error
            return NOT_FOUND_TAG
        value = found[canon]
        if value is NOT_FOUND:
            return NOT_FOUND_TAG
        return self.envelope.encode(value, key=job.digest)


class BatchKeyJob(LoaderJob):
    """One key of a ``do_many``: its flight is its own, its loader call the batch's."""

    batched = True

    def __init__(self, batch: BatchLoad, key: Any, digest: str) -> None:
        super().__init__(_unused_loader, batch.envelope, digest, key=key)
        self.batch = batch

    async def run(self, append: Append | None, context: FlightContext) -> bytes:
        return await self.batch.load(self, context)

    def on_follow(self, claim_entry: bytes) -> None:
        self.batch.withdraw(self.digest)


async def _unused_loader() -> None:
    raise AssertionError("a batch key's value comes from its batch")


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


class Near(Protocol):
    def get(self, digest: str) -> bytes | None: ...


async def load_many(
    keys: Sequence[Any],
    digests: Sequence[str],
    batch: BatchLoad,
    *,
    flights: Flights,
    local: LocalFlights,
    near: Near | None,
    keyspace: KeySpace,
    options: Callable[[Any], CallOptions],
    stats: Stats,
) -> list[Any]:
    """The decoded value of every key of a ``do_many``, in the order of ``keys``.

    Near-cache copies answer first; the other distinct keys go through local single-flight
    (``LocalFlights.call_many``: their first reads sent together), and each key whose read
    found nothing stored flies on its own with a :class:`BatchKeyJob` of ``batch``. The
    first error in the order of ``keys`` is raised once every key has settled (the flights
    of the others are stored all the same).
    """
    envelope = batch.envelope
    found: dict[str, Any] = {}  # digest -> bytes, or the exception that ended its key
    asked: list[int] = []  # indexes of the distinct keys that need the server
    for i, digest in enumerate(digests):
        if digest in found:  # the same key twice: asked once
            continue
        stats.calls += 1
        data = near.get(digest) if near is not None else None
        if data is not None:
            found[digest] = data
            stats.hits += 1
        else:
            found[digest] = None
            asked.append(i)
    if asked:
        fks = [keyspace.for_digest(digests[i]) for i in asked]
        opts = [options(keys[i]) for i in asked]

        def start(at: int, handle: Any) -> Coroutine[Any, Any, bytes]:
            i = asked[at]
            batch.expect(digests[i])
            job = BatchKeyJob(batch, keys[i], digests[i])
            return _fly(local, flights, fks[at], job, opts[at], handle, batch)

        outcomes, hits = await local.call_many(flights, fks, opts, start)
        stats.hits += hits
        for i, outcome in zip(asked, outcomes, strict=True):
            found[digests[i]] = outcome
    values: list[Any] = []
    failed: BaseException | None = None
    for digest in digests:
        outcome = found[digest]
        if isinstance(outcome, BaseException):
            failed = failed or outcome
            values.append(None)
            continue
        try:
            values.append(envelope.decode(outcome, key=digest))
        except Exception as exc:  # a stored error record: this key's error
            failed = failed or exc
            values.append(None)
    if failed is not None:
        raise failed
    return values


async def _fly(
    local: LocalFlights,
    flights: Flights,
    fk: FlightKeys,
    job: BatchKeyJob,
    opts: CallOptions,
    handle: Any,
    batch: BatchLoad,
) -> bytes:
    try:
        return await local.fly(flights, fk, job, opts, handle)
    finally:  # it ran here, or it never will: the batch need not wait for it
        batch.withdraw(fk.digest)


async def uncached_many(batch: BatchLoad, keys: Sequence[Any]) -> list[Any]:
    """``do_many`` with caching off (``disabled()``): one loader call for the distinct keys,
    each value through the codec as a flight's callers get it; nothing read or stored."""
    distinct: dict[bytes, Any] = {}
    for key in keys:
        distinct.setdefault(canonical(key), key)
    asked = list(distinct.values())
    if batch.with_contexts:
        contexts = [FlightContext(key, "", 0, 1) for key in asked]
        result = await batch.loader(asked, contexts)
    else:
        result = await batch.loader(asked)
    if not isinstance(result, Mapping):
        raise FlightError(
            f"a do_many loader returns a mapping of keys to values, not {type(result).__name__}"
        )
    found = {canonical(k): v for k, v in result.items()}
    values = []
    for key in keys:
        job = BatchKeyJob(batch, key, "")
        values.append(batch.envelope.decode(batch._encode(job, found)))
    return values
