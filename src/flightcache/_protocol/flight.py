"""The distributed flight protocol over one Redis/Valkey server (docs/protocol.md).

One call of :meth:`RedisFlights.resolve` is one process's part in one flight: join (hit,
follow or vacant), claim with a fresh fencing token, own (loader + heartbeat + fenced write),
follow (block on the flight's stream), and take over when an owner's lease lapses.
It returns the stored bytes of the result (a value or an error record).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from redis.crc import key_slot

from .._backends.redis import RedisConnection, scripts
from .._codec import NOT_FOUND_TAG, Envelope
from .._config import Tuning
from .._errors import (
    BackendUnavailable,
    FlightError,
    FlightTimeout,
    PoolExhausted,
    SerializationError,
    ValueTooLarge,
)
from .._keys import FlightKeys, KeySpace
from .._types import CallOptions, FlightInfo, Stats
from .base import Opening
from .heartbeat import Lease, Renewer
from .jobs import Job
from .loader import WorkCancelled, cancelled_loader_error, error_ttl_ms, wait_bounded
from .wakeup import Entry, Waiter, WakeHub, entry_key

LUA = scripts(
    __package__,
    "join_flight",
    "confirm_claim",
    "renew_leases",
    "append_chunks",
    "complete_flight",
    "fail_flight",
    "read_result",
)

log_claim = logging.getLogger("flightcache.claim")
log_follow = logging.getLogger("flightcache.follow")

HIT, FOLLOW, CLAIMED, VACANT, ENDED = 1, 2, 3, 0, 4
TOKEN_RANDOM_BITS = 20


@dataclass(frozen=True, slots=True)
class _State:
    kind: int
    value: bytes | None = None
    token: int = 0
    lease_left_ms: int = 0
    rank: int = -1
    last_id: bytes = b"0-0"
    claim_id: str = ""
    since: bytes = b""  # the stream position of the flight this caller last took part in
    ended: bytes = b""  # ENDED: b"done" or b"error"
    count: int | None = None  # ENDED: a stream's chunk count
    sent: float = 0.0  # when the join that answered this was sent (local monotonic clock)
    ttl_left_ms: int = 0  # HIT: the result's time left
    leasable: bool = False  # HIT: no invalidation marks it (a near cache may lease it)
    cost_ms: int = 0  # HIT: how long the result took to compute (0: unknown)


def _state(reply: list[Any], claim_id: str, sent: float) -> _State:
    kind = int(reply[0])
    if kind == CLAIMED:  # last_id: the claim's own stream entry; token: '' until confirmed
        token = int(reply[3]) if reply[3] else 0
        return _State(
            CLAIMED,
            claim_id=claim_id,
            last_id=reply[2],
            token=token,
            sent=sent,
            lease_left_ms=max(int(reply[4]), 0),
        )
    if kind == HIT:
        return _State(
            HIT,
            value=reply[1],
            ttl_left_ms=int(reply[2]),
            leasable=not int(reply[3]),
            cost_ms=int(reply[4]),
            sent=sent,
        )
    if kind == ENDED:
        ended, value, count, crossed = reply[1], reply[2], reply[3], reply[4]
        return _State(  # last_id: the takeover's claim entry crossed on the way, or b""
            ENDED,
            ended=ended,
            value=value or None,
            count=int(count) if count else None,
            last_id=crossed,
        )
    if kind == FOLLOW:
        return _State(
            FOLLOW,
            token=int(reply[1]),
            lease_left_ms=max(int(reply[2]), 0),
            rank=int(reply[3]),
            last_id=reply[4],
        )
    return _State(VACANT, rank=int(reply[1]))


class _Handle:
    """One call's part in a flight, from its first join on: the claim id that join sends
    (sent again, it answers the same claim), its answer, and the call's waiter."""

    __slots__ = ("claim_id", "digest", "state", "waiter")

    def __init__(self, digest: str, claim_id: str) -> None:
        self.digest = digest
        self.claim_id = claim_id
        self.state: _State | None = None
        self.waiter: Waiter | None = None


class _Lost(Exception):
    """Internal: this process's ownership ended without a result; go back to join."""


class RedisFlights:
    """The flight protocol of one FlightCache against one Redis connection."""

    def __init__(
        self,
        conn: RedisConnection,
        keyspace: KeySpace,
        envelope: Envelope,
        stats: Stats,
        node_id: str,
        tuning: Tuning | None = None,
        clock: Callable[[], float] = time.monotonic,
        seq_conn: RedisConnection | None = None,
    ) -> None:
        self.conn = conn
        self.seq_conn = seq_conn or conn  # where owner-seq lives (the designated server)
        self.keyspace = keyspace
        self.envelope = envelope
        self.stats = stats
        self.node_id = node_id
        self.tuning = tuning or Tuning()
        self.clock = clock
        # Where owner-seq lives on this very server, the join takes the token itself.
        self.token_in_join = self.seq_conn is conn and conn.cluster is None
        self.hub = WakeHub(conn.listener, keyspace.wake_prefix + node_id)
        self.renewer = Renewer(self._renew_batch, clock)
        conn.preload(LUA.values())
        self._wake = (keyspace.wake_prefix, self.tuning.inline_max_bytes)

    async def aclose(self) -> None:
        await self.renewer.aclose()

    # -- reads ---------------------------------------------------------------------------

    async def lookup(self, fk: FlightKeys) -> bytes | None:
        client = self.conn.client
        data: Any = await self.conn.run(lambda: client.get(fk.result), fk)
        return cast("bytes | None", data)

    async def lookup_full(self, fk: FlightKeys) -> tuple[bytes | None, int, bool, int]:
        """The stored result, its time left in ms, whether it may be leased (no invalidation
        or replacement of it is under way), and how long it took to compute, in ms."""
        value, ttl_left, marked, cost = await self.conn.script(
            LUA["read_result"], fk, (fk.result, fk.marker, fk.cost), ()
        )
        return value, int(ttl_left), not int(marked), int(cost)

    async def inspect(self, fk: FlightKeys) -> FlightInfo:
        async def pipeline() -> list[Any]:
            pipe: Any = self.conn.client.pipeline(transaction=False)
            pipe.hgetall(fk.meta).pttl(fk.meta).llen(fk.waiters).pttl(fk.result).get(fk.result)
            return list(await pipe.execute())

        meta, lease_left, followers, result_ttl, result = await self.conn.run(pipeline, fk)
        m = {k.decode(): v.decode() for k, v in meta.items()}
        if result is not None:
            state = "error-cached" if self.envelope.is_error(result) else "cached"
        else:
            state = "running" if m else "vacant"
        return FlightInfo(
            key=m.get("key"),
            digest=fk.digest,
            state=state,
            owner_node=m.get("ownerNode"),
            token=int(m["ownerToken"]) if "ownerToken" in m else None,
            lease_left_ms=lease_left if m else None,
            attempts=int(m["attempts"]) if "attempts" in m else None,
            followers=int(followers),
            result_ttl_ms=result_ttl if result is not None else None,
        )

    # -- the flight ----------------------------------------------------------------------

    def prepare(self, fk: FlightKeys) -> _Handle:
        return _Handle(fk.digest, secrets.token_hex(8))

    async def begin(self, fk: FlightKeys, opts: CallOptions, handle: _Handle) -> Opening:
        """A call's first read: the join itself (hit, follow, or claimed, with the token
        where owner-seq is on this server). The waiter for the flight's wake-ups is made
        before the join is sent, so no event after the position it returns passes unheard."""
        handle.waiter = self.hub.watch(fk.digest)
        try:
            state = await self._join(
                fk, opts, "always", refresh=opts.refresh, claim_id=handle.claim_id
            )
        except BaseException:
            self.release(handle)
            raise
        if state.kind == HIT:
            self.release(handle)
            assert state.value is not None
            leasable = state.leasable and state.ttl_left_ms > 0
            return Opening(state.value, state.ttl_left_ms, leasable, state.cost_ms, handle)
        handle.state = state
        return Opening(None, handle=handle)

    async def abandon(self, fk: FlightKeys, opts: CallOptions, handle: _Handle) -> None:
        """Nobody waits for this call any more: if its join claimed the flight, give it
        back at once (followers claim without waiting out the lease)."""
        RedisFlights.release(handle)
        try:
            state = handle.state or await self._join(
                fk, opts, "mine", refresh=opts.refresh, claim_id=handle.claim_id
            )
            if state.kind == CLAIMED and state.token:
                await self._give_back(fk, state.token)
        except FlightError as exc:  # the claim lapses with its lease
            log_claim.info("flight %s: could not give back an abandoned claim: %s", fk.digest, exc)

    @staticmethod
    def release(handle: _Handle | None) -> None:
        if handle is not None and handle.waiter is not None:
            handle.waiter.hub.unwatch(handle.waiter)
            handle.waiter = None

    async def resolve(
        self, fk: FlightKeys, job: Job, opts: CallOptions, handle: _Handle | None = None
    ) -> bytes:
        """The stored result of the flight (value, stream or error record), or ``b""`` for a
        stream whose every chunk this process already has. ``handle``: from a ``begin``
        that found no stored result (its join's answer and waiter), or one whose ``begin``
        was interrupted (the join is sent again with the same claim id: it answers the
        claim it may have made)."""
        if handle is None:
            handle = self.prepare(fk)
        if handle.waiter is None:
            handle.waiter = self.hub.watch(fk.digest)
        try:
            return await self._resolve(fk, job, opts, handle)
        finally:
            self.release(handle)

    async def _resolve(self, fk: FlightKeys, job: Job, opts: CallOptions, handle: _Handle) -> bytes:
        deadline = self.clock() + opts.wait_bound_s
        waiter = handle.waiter
        assert waiter is not None
        state: _State | None = handle.state
        if state is None:
            state = await self._join(
                fk, opts, "always", refresh=opts.refresh, claim_id=handle.claim_id
            )
        if state.kind == HIT:
            self.stats.hits += 1
            assert state.value is not None
            self._lease_hit(job, state)
            return state.value
        self.stats.misses += 1
        takeover = False
        # Where on the flight's stream this caller was last: a later join reports an end
        # of that flight written since (ENDED) instead of starting another flight. With
        # refresh, every join ignores the stored result (it is the one being replaced) and
        # this position is how the flight's own new result is still found.
        since = b""
        outage: float | None = None  # when the server stopped answering, mid-flight
        backoff = 0.05
        while True:
            if self.clock() >= deadline:
                raise FlightTimeout(
                    f"no result within the wait bound of {opts.wait_bound_s:g} s", key=fk.digest
                )
            try:
                if state is None:  # after an outage: where does the flight stand now?
                    state = await self._join(fk, opts, "always", refresh=opts.refresh, since=since)
                if state.kind == HIT:
                    assert state.value is not None
                    self._lease_hit(job, state)
                    return state.value
                if state.kind == FOLLOW:
                    self.stats.follows += 1
                    job.on_follow(state.last_id)
                    outcome = await self._follow(fk, job, state, opts, deadline, waiter)
                    if isinstance(outcome, bytes):
                        return outcome
                    state, takeover, since = outcome, True, outcome.since or since
                    continue
                if state.kind == VACANT:
                    # The owner died and this caller is not first in the queue: give the
                    # ones ahead of it their turn, then join again (and claim if vacant).
                    rank = state.rank if state.rank >= 0 else self.tuning.takeover_max_rank
                    step = self.tuning.takeover_step_s
                    delay = min(rank, self.tuning.takeover_max_rank) * step
                    await asyncio.sleep(delay + random.uniform(0, step / 2))  # takeover jitter
                    state = await self._join(fk, opts, "always", refresh=opts.refresh, since=since)
                    continue
                if state.kind == ENDED:
                    if state.last_id:  # it ended after a takeover: chunks started over
                        job.on_claimed(state.last_id)
                    ended = self._ended(state, job)
                    if ended is None and state.ended == b"done":
                        ended = await self.lookup(fk)  # a value too large to ride the event
                    if ended is not None:
                        return ended
                    state = await self._join(fk, opts, "always", refresh=opts.refresh)
                    continue
                since = state.last_id  # our own claim's entry
                if state.token:  # the join took the token itself
                    # The lease runs out no later than its time left after the join was sent
                    # (a fresh claim: a whole lease; a claim found again: what it has left).
                    granted = state.sent + state.lease_left_ms / 1000 - opts.lease_ms / 1000
                    confirmed: tuple[int, float] | None = (state.token, granted)
                else:
                    confirmed = await self._confirm(fk, opts, state.claim_id)
                if confirmed is None:  # the claim lapsed before its token arrived
                    state = await self._join(fk, opts, "always", refresh=opts.refresh, since=since)
                    continue
                if takeover:
                    self.stats.takeovers += 1
                try:
                    return await self._own(fk, job, opts, *confirmed)
                except _Lost:
                    state = None
                    takeover = False
            except PoolExhausted:
                raise  # this process is overloaded: waiting longer would not help
            except BackendUnavailable as exc:
                # A failover (a cluster master replaced by its replica) or a blip: the flight
                # may still be fine. Retry from a fresh join for a while, then give up.
                now = self.clock()
                outage = now if outage is None else outage
                if now - outage >= self.tuning.failover_s:
                    raise
                log_follow.info("flight %s: server unreachable, retrying: %s", fk.digest, exc)
                await asyncio.sleep(backoff)  # outage backoff
                backoff = min(backoff * 2, 1.0)
                state = None
                continue
            outage, backoff = None, 0.05

    @staticmethod
    def _lease_hit(job: Job, state: _State) -> None:
        """A hit answered by a join: a near cache may lease it (no invalidation marks it)."""
        if state.leasable:
            job.lease = (state.sent, state.ttl_left_ms)
            job.cost_ms = state.cost_ms or None

    def _ended(self, state: _State, job: Job) -> bytes | None:
        """What a caller gets from a flight that ended after its position, if usable."""
        if state.value is not None:  # the error record, or the value inline in `done`
            return state.value
        if state.count is not None and job.has_all(state.count):
            return b""  # a stream whose chunks this process has
        return None  # a done whose value is gone: start over

    async def _join(
        self,
        fk: FlightKeys,
        opts: CallOptions,
        claim: str,
        *,
        refresh: bool = False,
        since: bytes = b"",
        claim_id: str = "",
    ) -> _State:
        """Hit, follow, or claim (mode 'always', or 'first' in the waiters queue).

        ``refresh`` ignores a stored result (only a refresh call's first join: later, a
        result is the one its own flight stored). ``since`` is a follower's stream position:
        an end of its flight after it is reported (ENDED) rather than claimed over.
        """
        claim_id = claim_id or secrets.token_hex(8)
        keys = [fk.result, fk.meta, fk.waiters, fk.stream, fk.marker, fk.cost]
        bits: int | str = ""
        if self.token_in_join:
            keys.append(self.keyspace.owner_seq)
            bits = secrets.randbits(TOKEN_RANDOM_BITS)
        prefix, limit = self._wake
        sent = self.clock()
        reply = await self.conn.script(
            LUA["join_flight"],
            fk,
            keys,
            (
                self.node_id,
                opts.lease_ms + self.tuning.stream_linger_ms,
                claim,
                claim_id,
                opts.lease_ms,
                int(opts.timeout_s * 1000),
                opts.key_text,
                opts.lease_ms + self.tuning.stream_linger_ms,
                "1" if refresh else "0",
                since,
                opts.refresh_below_ms,
                bits,
                prefix,
                fk.digest,
                limit,
            ),
        )
        return _state(reply, claim_id, sent)

    async def _confirm(
        self, fk: FlightKeys, opts: CallOptions, claim_id: str
    ) -> tuple[int, float] | None:
        """Take a fencing token (INCR owner-seq) and confirm the claim with it: the token and
        the local time the confirmation was sent (the lease started later than that)."""
        seq = self.seq_conn
        counter = int(await seq.run(lambda: seq.client.incr(self.keyspace.owner_seq)))
        # The counter orders tokens; 20 random low bits keep them unique even if the counter
        # went backwards (a failover can lose recent INCRs: Redis replicates asynchronously).
        token = (counter << TOKEN_RANDOM_BITS) | secrets.randbits(TOKEN_RANDOM_BITS)
        sent = self.clock()
        confirmed = await self.conn.script(
            LUA["confirm_claim"], fk, (fk.meta,), (claim_id, token, opts.lease_ms)
        )
        if int(confirmed) != 1:
            return None
        log_claim.debug("flight %s: owner with token %d", fk.digest, token)
        return token, sent

    # -- owner ---------------------------------------------------------------------------

    async def _own(
        self, fk: FlightKeys, job: Job, opts: CallOptions, token: int, granted_at: float
    ) -> bytes:
        self.stats.owning += 1
        try:
            return await self._run_owned(fk, job, opts, token, granted_at)
        finally:
            self.stats.owning -= 1

    async def _renew_batch(self, leases: Sequence[Lease]) -> list[bool]:
        """One pipeline renewing every lease given: on one server, scripts of up to
        ``renew_batch`` flights; on a Cluster, one script per slot (a script cannot span
        slots), which redis-py's cluster pipeline sends one round trip per node."""
        groups: dict[int, list[Lease]] = {}
        if self.conn.cluster is not None:
            for lease in leases:
                groups.setdefault(key_slot(lease.args[0].meta.encode()), []).append(lease)
            batches = list(groups.values())
        else:
            size = self.tuning.renew_batch
            batches = [list(leases[i : i + size]) for i in range(0, len(leases), size)]
        script = LUA["renew_leases"]
        calls = []
        for batch in batches:
            keys: list[str] = []
            args: list[Any] = []
            for lease in batch:
                fk, token, lease_ms, stream_ttl = lease.args
                keys += (fk.meta, fk.stream, fk.waiters)
                args += (token, lease_ms, stream_ttl)
            calls.append((keys, args))
        replies = await self.conn.pipeline_script(script, calls)
        answers = {
            id(lease): bool(int(ok))
            for batch, reply in zip(batches, replies, strict=True)
            for lease, ok in zip(batch, reply, strict=True)
        }
        return [answers[id(lease)] for lease in leases]

    async def _run_owned(
        self, fk: FlightKeys, job: Job, opts: CallOptions, token: int, granted_at: float
    ) -> bytes:
        self.stats.loader_runs += 1
        ran_from = self.clock()
        stream_ttl = opts.lease_ms + self.tuning.stream_linger_ms
        chunks = [0]
        prefix, limit = self._wake

        async def append(first_seq: int, batch: Sequence[bytes]) -> None:
            written = await self.conn.script(
                LUA["append_chunks"],
                fk,
                (fk.meta, fk.stream, fk.waiters),
                (token, first_seq, prefix, fk.digest, limit, *batch),
            )
            if int(written) != 1:
                self._fenced(fk, token)
            chunks[0] = first_seq + len(batch)

        work = asyncio.ensure_future(job.run(append))
        heartbeat = self.renewer.add(
            work,
            lease_s=opts.lease_ms / 1000,
            digest=fk.digest,
            granted_at=granted_at,
            args=(fk, token, opts.lease_ms, stream_ttl),
        )
        try:
            encoded = await wait_bounded(work, opts.timeout_s, fk.digest)
        except WorkCancelled:
            self.renewer.remove(heartbeat)
            if heartbeat.lost:
                self.stats.lease_lost += 1
                raise _Lost() from None
            error = cancelled_loader_error(fk.digest)
            await self._publish_error(fk, token, error, ttl_ms=0)
            raise error from None
        except asyncio.CancelledError:
            self.renewer.remove(heartbeat)
            await self._give_back(fk, token)  # we are being closed: let a follower claim now
            raise
        except _Lost:
            self.renewer.remove(heartbeat)  # a fenced append: another owner holds the flight
            raise
        except FlightTimeout as exc:
            self.renewer.remove(heartbeat)
            self.stats.timeouts += 1
            await self._publish_error(fk, token, exc, ttl_ms=0)
            raise
        except (ValueTooLarge, SerializationError) as exc:
            self.renewer.remove(heartbeat)
            await self._publish_error(fk, token, exc, ttl_ms=0)
            raise
        except Exception as exc:
            self.renewer.remove(heartbeat)
            self.stats.loader_errors += 1
            ttl_ms = error_ttl_ms(exc, opts) if opts.store else 0  # store=False keeps nothing
            await self._publish_error(fk, token, exc, ttl_ms=ttl_ms)
            raise
        self.renewer.remove(heartbeat)
        if heartbeat.lost:  # the loader finished as the lease was found lost
            self.stats.lease_lost += 1
            raise _Lost()
        small = job.inline_ok and len(encoded) <= self.tuning.inline_max_bytes
        count = "" if job.inline_ok else str(chunks[0])
        ttl = opts.not_found_ttl_ms if encoded == NOT_FOUND_TAG else opts.ttl_ms
        ttl_ms = self._jittered(ttl) if opts.store and ttl > 0 else 0
        sent = self.clock()
        written = int(
            await self.conn.script(
                LUA["complete_flight"],
                fk,
                (fk.result, fk.meta, fk.stream, fk.waiters, fk.cost),
                (
                    token,
                    encoded,
                    ttl_ms,
                    "1" if small else "0",
                    self.tuning.stream_linger_ms,
                    count,
                    int((sent - ran_from) * 1000),  # the loader's cost, for refresh-ahead
                    prefix,
                    fk.digest,
                    limit,
                ),
            )
        )
        if written == 0:
            self._fenced(fk, token)
        job.cost_ms = int((sent - ran_from) * 1000)
        if written == 1:  # stored (2: delivered only, an invalidation is under way)
            job.lease = (sent, ttl_ms)
        return encoded

    def _jittered(self, ttl_ms: int) -> int:
        jitter = self.tuning.ttl_jitter
        return max(1, int(ttl_ms * (1 + random.uniform(-jitter, jitter))))

    def _fenced(self, fk: FlightKeys, token: int) -> None:
        self.stats.fenced_writes += 1
        log_claim.warning(
            "flight %s: write with token %d fenced off; following the new owner", fk.digest, token
        )
        raise _Lost()

    def _fail_args(
        self, fk: FlightKeys, token: int, kind: str, record: bytes | str, ttl_ms: int
    ) -> tuple[Any, ...]:
        prefix, limit = self._wake
        return (token, kind, record, ttl_ms, self.tuning.stream_linger_ms, prefix, fk.digest, limit)

    async def _publish_error(
        self, fk: FlightKeys, token: int, exc: BaseException, ttl_ms: int
    ) -> None:
        record = self.envelope.encode_error(exc)
        written = await self.conn.script(
            LUA["fail_flight"],
            fk,
            (fk.result, fk.meta, fk.stream, fk.waiters),
            self._fail_args(fk, token, "error", record, ttl_ms),
        )
        if int(written) != 1:
            self._fenced(fk, token)

    async def _give_back(self, fk: FlightKeys, token: int) -> None:
        """Best effort on close: release the flight so followers claim without waiting."""
        try:
            await asyncio.wait_for(
                self.conn.script(
                    LUA["fail_flight"],
                    fk,
                    (fk.result, fk.meta, fk.stream, fk.waiters),
                    self._fail_args(fk, token, "reset", "", 0),
                ),
                self.tuning.reset_timeout_s,
            )
        except (FlightError, asyncio.TimeoutError) as exc:
            log_claim.info(
                "flight %s: could not release on close (%s); lease will lapse", fk.digest, exc
            )

    # -- follower ------------------------------------------------------------------------

    async def _read_after(self, fk: FlightKeys, cursor: bytes) -> list[Entry]:
        """The flight's stream after ``cursor``: what a follower missed (one short command
        per ``fetch_count`` entries)."""
        client = self.conn.client
        entries: list[Entry] = []
        while True:
            batch: Any = await self.conn.run(
                functools.partial(
                    client.xrange, fk.stream, b"(" + cursor, b"+", count=self.tuning.fetch_count
                ),
                fk,
            )
            entries += batch
            if len(batch) < self.tuning.fetch_count:
                return entries
            cursor = batch[-1][0]

    async def _news(self, fk: FlightKeys, waiter: Waiter, cursor: bytes) -> list[Entry]:
        """The entries after ``cursor`` that the waiter's messages tell of, in order; the
        stream itself is read when a message is out of step or one may have been lost."""
        gap, messages = waiter.take()
        if gap:
            return await self._read_after(fk, cursor)
        at = entry_key(cursor)
        news: list[Entry] = []
        for prev, entries in messages:
            if entries and entry_key(entries[-1][0]) <= at:
                continue  # nothing after the cursor
            if not entries or entry_key(prev) > at:
                # A bare hint, or an entry between the cursor and `prev` never arrived.
                return await self._read_after(fk, cursor)
            for entry in entries:
                if entry_key(entry[0]) > at:
                    news.append(entry)
            at = entry_key(entries[-1][0])
            cursor = entries[-1][0]
        return news

    async def _follow(
        self,
        fk: FlightKeys,
        job: Job,
        state: _State,
        opts: CallOptions,
        deadline: float,
        waiter: Waiter,
    ) -> bytes | _State:
        """Wait for the flight's events until it ends; a _State when the flight fell vacant.

        Events arrive on the wake channel (or, after a gap, from a read of the stream), and
        only those after the position the join saw are applied, so every event is about
        this flight: only writes under the then-current token reach the stream (the scripts
        are fenced), so no token needs checking here. No connection is held while waiting.
        """
        margin_s = self.tuning.block_margin_ms / 1000
        recheck_at = self.clock() + state.lease_left_ms / 1000 + margin_s
        last_id = state.last_id  # every event that can end this flight comes after it
        while True:
            sent = self.clock()
            if sent >= deadline:
                raise FlightTimeout(
                    f"no result within the wait bound of {opts.wait_bound_s:g} s", key=fk.digest
                )
            if await waiter.wait(max(min(recheck_at, deadline) - sent, 0.001)):
                news = await self._news(fk, waiter, last_id)
                for entry_id, fields in news:
                    last_id = entry_id
                    kind = fields.get(b"t")
                    if kind == b"claimed":  # past our position: the owner we followed died
                        log_follow.info("flight %s: claimed by %s", fk.digest, fields.get(b"n"))
                        job.on_claimed(entry_id)
                        continue
                    if kind == b"chunk":
                        job.on_chunk(int(fields[b"s"]), fields[b"v"])
                        continue
                    if kind == b"done":
                        count = fields.get(b"n")
                        if count is not None and job.has_all(int(count)):
                            return b""  # a stream: every chunk is here already
                        value = fields.get(b"v")
                        if value is None:
                            value = await self.lookup(fk)
                        elif b"x" in fields:  # stored: a near cache may lease it
                            job.lease = (sent, int(fields[b"x"]))
                            job.cost_ms = int(fields.get(b"c", 0)) or None
                        if value is not None:
                            return bytes(value)
                        # the result is gone already (evicted, or a tiny TTL): start over
                        return await self._join(fk, opts, "always", refresh=opts.refresh)
                    if kind == b"error":
                        return bytes(fields.get(b"v", b""))
                    if kind == b"reset":
                        now = await self._join(
                            fk, opts, "first", refresh=opts.refresh, since=entry_id
                        )
                        return replace(now, since=entry_id)
                if news:  # the owner is alive: a whole lease before the next re-check
                    recheck_at = self.clock() + opts.lease_ms / 1000 + margin_s
                continue
            if self.clock() >= deadline:
                continue  # the wait bound, not the lease, ran out
            # The wait ran out with no event: is the owner still alive?
            now = await self._join(fk, opts, "first", refresh=opts.refresh, since=last_id)
            if now.kind != FOLLOW:
                return replace(now, since=last_id)
            job.on_follow(now.last_id)
            last_id = now.last_id
            recheck_at = self.clock() + now.lease_left_ms / 1000 + margin_s
