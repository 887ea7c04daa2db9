"""The owner's side of a flight: run the loader under its lease, write what it made, fenced.

Every write carries the owner's token and is refused (``Lost``) when the token is no longer
current. A write the *server* fails (unreachable, or refusing commands) is never the
loader's failure: it is retried through ``Tuning.failover_s``; a value in hand that still
cannot be written is handed to this process's callers (``Undelivered``, which fail-open
turns into an answer); its flight's lease lapses and a follower takes it over. Nothing
about it reaches followers as a ``RemoteError`` or is negative-cached.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from .._backends.redis import RedisConnection
from .._codec import NOT_FOUND_TAG, Envelope
from .._config import Tuning
from .._errors import (
    BackendUnavailable,
    FlightError,
    FlightTimeout,
    SerializationError,
    ValueTooLarge,
)
from .._keys import FlightKeys
from .._types import CallOptions, Stats
from .._waits import within
from .context import FlightContext
from .heartbeat import Lease, Renewer
from .jobs import Job
from .loader import (
    WorkCancelled,
    cancelled_loader_error,
    error_ttl_ms,
    start_work,
    wait_bounded,
)
from .pipelined import Together
from .renewals import Owned, Renewals, shape_bound
from .renewer_thread import ThreadRenewer
from .session import BoundProof, Session, Sessions
from .state import LUA, Lost

T = TypeVar("T")

log = logging.getLogger("flightcache.claim")


def short_renewals(lease_ms: int, stream_ttl_ms: int) -> int:
    """How many short renewals (the lease only) may follow a full one (the lease, and the
    stream and waiters to ``stream_ttl_ms``): each renewal that finds the lease held runs
    within one lease of the last, so after a full one at ``t`` the lease ends before
    ``t + (n + 1) * lease``, and the stream and waiters outlive it while that is at most
    their ``t + stream_ttl``; one lease is kept as a margin (docs/protocol.md, "Batched
    renewals"). The defaults (3 s, 13 s): 2, so two renewals in three are short."""
    return max(stream_ttl_ms // lease_ms - 2, 0)


class Undelivered(BackendUnavailable):
    """The loader's value is in hand but the server would not take it for a whole failover
    window: this process's callers may still have it (fail-open); nobody else will."""

    def __init__(self, message: str, result: bytes, *, key: str | None = None) -> None:
        super().__init__(message, key=key)
        self.result = result


class _Appender:
    """A stream loader's ``append``: its chunks written after the ones before, fenced by the
    token, retried through a failover. One object a flight, where a closure over the
    flight's names was nine (its cells and their tuple), made for every flight, streamed or
    not, and walked by every full collection while the flight runs."""

    __slots__ = ("claim", "ended", "fk", "owner", "token")

    def __init__(self, owner: Owner, fk: FlightKeys, token: int, claim: str) -> None:
        self.owner = owner
        self.fk = fk
        self.token = token
        self.claim = claim
        self.ended = False  # the run ended: the completion decides, an append's answer not

    async def __call__(self, first_seq: int, batch: Sequence[bytes]) -> None:
        owner, fk = self.owner, self.fk
        prefix, limit = owner._wake

        def send() -> Awaitable[Any]:
            return owner.conn.script(
                LUA["append_chunks"],
                fk,
                (fk.meta, fk.stream, fk.waiters),
                (self.token, first_seq, prefix, fk.digest, limit, self.claim, *batch),
            )

        try:
            written = await owner._write(fk, "appending chunks", send)
        except FlightError as exc:
            raise _ServerFailed(exc) from exc
        if int(written) != 1 and not self.ended:
            owner._fenced(fk, self.token)


class _ServerFailed(Exception):
    """Internal: an owner's write failed because of the server (raised through the
    producer, so it is not taken for the producer's own failure)."""

    def __init__(self, cause: FlightError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Owner:
    """Runs owned flights on one server: loader, batched lease renewals, fenced writes."""

    def __init__(
        self,
        conn: RedisConnection,
        envelope: Envelope,
        stats: Stats,
        tuning: Tuning,
        wake_prefix: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.conn = conn
        self.envelope = envelope
        self.stats = stats
        self.tuning = tuning
        self.clock = clock
        self._wake = (wake_prefix, tuning.inline_max_bytes)
        # The renewals run on a thread of their own with a connection of their own, so a
        # busy loop cannot starve them; a clock given by a test drives them on this loop,
        # and so does a Cluster (redis-py's blocking cluster client did not find the new
        # master after a failover: docs/protocol.md, "Batched renewals").
        self.renewals = Renewals(conn, tuning)
        self.renewer: Renewer | ThreadRenewer
        if clock is time.monotonic and conn.cluster is None:
            self.renewer = ThreadRenewer(self.renewals.on_thread)
        else:
            self.renewer = Renewer(self.renewals.on_loop, clock)
        self._completes = Together(conn, LUA["complete_flight"])
        self._claims: dict[int, str] = {}  # token -> its claim id, while it is owned here

    @property
    def sessions(self) -> Sessions | None:
        """This node's session on the server, where flights bind to one (one server, the
        renewals on their thread: docs/protocol.md, "Sessions"); None: every lease its own."""
        return self.renewals.sessions

    @sessions.setter
    def sessions(self, sessions: Sessions | None) -> None:
        self.renewals.sessions = sessions

    async def aclose(self) -> None:
        await self.renewer.aclose()
        self.renewals.close()

    async def run(
        self,
        fk: FlightKeys,
        job: Job,
        opts: CallOptions,
        token: int,
        granted_at: float,
        attempt: int = 1,
        claim: str = "",
        bound: bytes = b"",
    ) -> bytes:
        """Own the flight under ``token``; ``claim``: the claim id when the token was taken
        after the join (a Cluster): the first fenced write confirms the claim with it.
        ``bound``: the epoch of this node's session the claim bound the flight to."""
        session = None
        sessions = self.sessions
        if bound:
            session = sessions.current if sessions is not None else None
            if session is None or session.ended or session.epoch.encode() != bound:
                # Bound to an epoch that ended here meanwhile: its liveness is not ours to
                # keep. Give it back (a follower claims at once) and join again.
                await self.give_back(fk, token)
                raise Lost()
        self.stats.owning += 1
        self._claims[token] = claim
        if sessions is not None:
            sessions.owning()
        try:
            return await self._run(fk, job, opts, token, granted_at, attempt, session)
        finally:
            self._claims.pop(token, None)
            self.stats.owning -= 1
            if sessions is not None:
                sessions.released()

    # -- writes through a failover --------------------------------------------------------

    async def _write(self, fk: FlightKeys, what: str, send: Callable[[], Awaitable[T]]) -> T:
        """One owner write, retried while the server is unreachable, for up to
        ``failover_s``. A write that reached the server before its reply was lost is fenced
        when sent again (its effects are there: the flight moved on), never applied twice."""
        started = self.clock()
        backoff = 0.05
        while True:
            try:
                return await send()
            except BackendUnavailable as exc:
                if self.clock() - started >= self.tuning.failover_s:
                    raise
                log.info("flight %s: %s failed, retrying: %s", fk.digest, what, exc)
                await asyncio.sleep(backoff)  # outage backoff
                backoff = min(backoff * 2, 1.0)

    # -- the loader ----------------------------------------------------------------------

    async def _run(
        self,
        fk: FlightKeys,
        job: Job,
        opts: CallOptions,
        token: int,
        granted_at: float,
        attempt: int,
        session: Session | None = None,
    ) -> bytes:
        self.stats.loader_runs += 1
        ran_from = self.clock()
        stream_ttl = opts.lease_ms + self.tuning.stream_linger_ms
        claim = self._claims.get(token, "")
        append = _Appender(self, fk, token, claim)

        # The loader's view of its run: the token, and the lease the renewer last proved
        # (it starts running only after the lease is tracked: the next turn of the loop).
        context = FlightContext(job.key, fk.digest, token, attempt, clock=self.clock)
        started = start_work(job.run(append, context))
        work = started[0]
        if session is None:
            owned = Owned(fk, token, opts.lease_ms, stream_ttl, claim)
            heartbeat = self.renewer.add(
                work,
                lease_s=opts.lease_ms / 1000,
                digest=fk.digest,
                granted_at=granted_at,
                args=owned,
                tied=False,  # every way out of the wait below removes it
                full_every=short_renewals(opts.lease_ms, stream_ttl),
            )
            # (bound to this node's session by a renewal once it is up: renewals.py)
            context.track(heartbeat if self.sessions is None else BoundProof(heartbeat, owned))
        else:  # its liveness is the session's; its own keys live for the backstop
            assert self.sessions is not None
            backstop_s = self.sessions.backstop_s
            backstop_ms = int(backstop_s * 1000)
            owned = Owned(fk, token, backstop_ms, backstop_ms, claim, session, bound=True)
            heartbeat = self.renewer.add(
                work,
                lease_s=backstop_s,
                digest=fk.digest,
                granted_at=granted_at,
                args=owned,
                tied=False,
                interval_s=backstop_s / 2,  # (first due then: shape_bound says why)
            )
            shape_bound(heartbeat, session, backstop_s)
            session.flights.add(heartbeat)  # (given up with it: Sessions.end)
            context.track(BoundProof(heartbeat, owned))

        try:
            encoded = await wait_bounded(started, opts.timeout_s, fk.digest, context.cancel)
        except WorkCancelled:
            self._drop(heartbeat, owned)
            if heartbeat.lost:
                await self._lost(fk, token, heartbeat.refused)
                raise Lost() from None
            error = cancelled_loader_error(fk.digest)
            await self._publish_error(fk, token, error, ttl_ms=0)
            raise error from None
        except asyncio.CancelledError:
            self._drop(heartbeat, owned)
            await self.give_back(fk, token)  # we are being closed: let a follower claim now
            raise
        except Lost:
            self._drop(heartbeat, owned)  # a fenced append: another owner holds the flight
            raise
        except _ServerFailed as failed:
            # The server, not the producer, failed: nothing is published as an error, and
            # the flight is given back (if the server takes even that) for another try.
            self._drop(heartbeat, owned)
            await self.give_back(fk, token)
            raise failed.cause from None
        except FlightTimeout as exc:
            self._drop(heartbeat, owned)
            self.stats.timeouts += 1
            await self._publish_error(fk, token, exc, ttl_ms=0)
            raise
        except (ValueTooLarge, SerializationError) as exc:
            self._drop(heartbeat, owned)
            await self._publish_error(fk, token, exc, ttl_ms=0)
            raise
        except Exception as exc:
            self._drop(heartbeat, owned)
            self.stats.loader_errors += 1
            ttl_ms = error_ttl_ms(exc, opts) if opts.store else 0  # store=False keeps nothing
            await self._publish_error(fk, token, exc, ttl_ms=ttl_ms)
            raise
        except BaseException:
            self._drop(heartbeat, owned)
            raise
        self._drop(heartbeat, owned)
        if heartbeat.lost:  # the loader finished as the lease was found lost
            await self._lost(fk, token, heartbeat.refused)
            raise Lost()
        return await self._complete(fk, job, opts, token, encoded, ran_from)

    async def _lost(self, fk: FlightKeys, token: int, refused: bool) -> None:
        """The lease was given up here (its loader called off): the flight is given back,
        fenced by its token. A renewal whose answer came too late may have run, binding the
        flight to this node's session, which other flights keep alive: a join would then
        follow it until the backstop, not one lease (docs/protocol.md, "A lease given up is
        given back"). Not when the server ``refused`` the renewal (its own or its
        session's): the token holds nothing there, and the give-back would be refused too."""
        self.stats.lease_lost += 1
        if not refused:
            await self.give_back(fk, token)

    def _drop(self, heartbeat: Lease, owned: Owned) -> None:
        """The loader ended, one way or another: its lease needs no more renewals."""
        self.renewer.remove(heartbeat)
        if owned.session is not None:  # (bound at its claim, or since)
            owned.session.flights.discard(heartbeat)

    async def _complete(
        self,
        fk: FlightKeys,
        job: Job,
        opts: CallOptions,
        token: int,
        encoded: bytes,
        ran_from: float,
    ) -> bytes:
        prefix, limit = self._wake
        small = job.inline_ok and len(encoded) <= self.tuning.inline_max_bytes
        tail = job.tail  # a stream's last chunks, appended by the completion itself
        chunks = job.tail_from  # the chunks before them, appended (and answered)
        count = "" if job.inline_ok else str(chunks + len(tail))
        ttl = opts.not_found_ttl_ms if encoded == NOT_FOUND_TAG else opts.ttl_ms
        ttl_ms = self._jittered(ttl) if opts.store and ttl > 0 else 0
        sent = self.clock()
        cost_ms = int((sent - ran_from) * 1000)  # the loader's cost, for refresh-ahead

        keys = (fk.result, fk.meta, fk.stream, fk.waiters, fk.cost)
        args = (
            token,
            encoded,
            ttl_ms,
            "1" if small else "0",
            self.tuning.stream_linger_ms,
            count,
            cost_ms,
            prefix,
            fk.digest,
            limit,
            self._claims.get(token, ""),
            *((chunks, *tail) if tail else ()),  # numbered on from those appended
        )

        def send() -> Awaitable[Any]:
            if job.batched:  # a batch's keys finish together: one round trip for them all
                return self._completes.call(keys, args)
            return self.conn.script(LUA["complete_flight"], fk, keys, args)

        try:
            written = int(await self._write(fk, "storing the result", send))
        except BackendUnavailable as exc:
            raise Undelivered(
                f"the result could not be written: {exc}", encoded, key=fk.digest
            ) from exc
        except FlightError as exc:
            # The server refused the write (out of memory, say): the value is right, so this
            # process's callers get it; the flight is given back for the others.
            log.warning("flight %s: the server refused the result (%s)", fk.digest, exc)
            await self.give_back(fk, token)
            return encoded
        if written == 0:
            self._fenced(fk, token)
        job.cost_ms = cost_ms
        if written == 1:  # stored (2: delivered only, an invalidation is under way)
            job.lease = (sent, ttl_ms)
        return encoded

    def _jittered(self, ttl_ms: int) -> int:
        jitter = self.tuning.ttl_jitter
        return max(1, int(ttl_ms * (1 + random.uniform(-jitter, jitter))))

    def _fenced(self, fk: FlightKeys, token: int) -> None:
        self.stats.fenced_writes += 1
        log.warning(
            "flight %s: write with token %d fenced off; following the new owner", fk.digest, token
        )
        raise Lost()

    def _fail_args(
        self, fk: FlightKeys, token: int, kind: str, record: bytes | str, ttl_ms: int
    ) -> tuple[Any, ...]:
        prefix, limit = self._wake
        claim = self._claims.get(token, "")
        return (
            token,
            kind,
            record,
            ttl_ms,
            self.tuning.stream_linger_ms,
            prefix,
            fk.digest,
            limit,
            claim,
        )

    async def _publish_error(
        self, fk: FlightKeys, token: int, exc: BaseException, ttl_ms: int
    ) -> None:
        """Tell every follower the loader's error (fenced). If the server fails it, the
        loader's error still reaches this process's callers (the caller raises it); the
        followers find the flight vacant at their lease re-check."""
        record = self.envelope.encode_error(exc)

        def send() -> Awaitable[Any]:
            return self.conn.script(
                LUA["fail_flight"],
                fk,
                (fk.result, fk.meta, fk.stream, fk.waiters),
                self._fail_args(fk, token, "error", record, ttl_ms),
            )

        try:
            written = await self._write(fk, "publishing the error", send)
        except FlightError as failed:
            log.warning(
                "flight %s: the loader's error could not be published: %s", fk.digest, failed
            )
            await self.give_back(fk, token)
            return
        if int(written) != 1:
            self._fenced(fk, token)

    async def give_back(self, fk: FlightKeys, token: int) -> None:
        """Best effort: release the flight so followers claim without waiting out the lease."""
        try:
            await within(
                self.conn.script(
                    LUA["fail_flight"],
                    fk,
                    (fk.result, fk.meta, fk.stream, fk.waiters),
                    self._fail_args(fk, token, "reset", "", 0),
                ),
                self.tuning.reset_timeout_s,
            )
        except (FlightError, asyncio.TimeoutError) as exc:
            log.info(
                "flight %s: could not give the flight back (%s); its lease will lapse",
                fk.digest,
                exc,
            )
