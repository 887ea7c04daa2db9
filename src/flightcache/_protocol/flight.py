"""The distributed flight protocol over one Redis/Valkey server (docs/protocol.md).

One call of :meth:`RedisFlights.resolve` is one process's part in one flight: join (hit,
follow or vacant), claim with a fresh fencing token, own (loader + heartbeat + fenced write),
follow (wait for the flight's events on the wake channel, no connection held), and take
over when an owner's lease lapses.
It returns the stored bytes of the result (a value or an error record).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from .._backends.redis import RedisConnection
from .._codec import Envelope
from .._config import Tuning
from .._errors import BackendUnavailable, FlightError, FlightTimeout, PoolExhausted
from .._keys import FlightKeys, KeySpace
from .._types import CallOptions, FlightInfo, Stats
from .base import Opening
from .follower import Follower
from .heartbeat import Renewer
from .jobs import Job
from .owner import Owner, Undelivered
from .pipelined import script_calls
from .renewer_thread import ThreadRenewer
from .session import Sessions
from .state import (
    CLAIMED,
    ENDED,
    FOLLOW,
    HIT,
    LUA,
    TOKEN_RANDOM_BITS,
    VACANT,
    Handle,
    Lost,
    State,
    state_of,
)
from .tokens import Tokens
from .wakeup import WakeHub

__all__ = ["LUA", "RedisFlights", "Undelivered"]

log_claim = logging.getLogger("flightcache.claim")


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
        session_lease_s: float | None = None,
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
        self.owner = Owner(conn, envelope, stats, self.tuning, keyspace.wake_prefix, clock)
        self.follower = Follower(self)
        # A session where claims take their token in the join and renewals run on their
        # thread: one server, Sentinel's master, the first of a list (docs/protocol.md, "Sessions").
        backstop_s = self.tuning.session_backstop_ms / 1000
        if (
            self.token_in_join
            and session_lease_s is not None
            and backstop_s > session_lease_s
            and isinstance(self.owner.renewer, ThreadRenewer)
        ):
            self.owner.sessions = Sessions(
                keyspace.session(node_id), session_lease_s, backstop_s, self.owner.renewer, clock
            )
        conn.preload(LUA.values())
        self._wake = (keyspace.wake_prefix, self.tuning.inline_max_bytes)
        self.tokens = Tokens(conn, self.seq_conn, keyspace)  # where the join takes none
        self._claim_prefix = secrets.token_hex(8) + "-"  # 64 random bits a cache, then a counter
        self._claims = 0
        self._static: dict[tuple[int, float], tuple[bytes, ...]] = {}  # join args by opts

    @property
    def renewer(self) -> Renewer | ThreadRenewer:
        return self.owner.renewer

    async def aclose(self) -> None:
        await self.follower.rechecks.aclose()
        await self.owner.aclose()

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
        if "se" in m:  # bound: live while its owner's session holds its epoch
            key = self.keyspace.session(m.get("ownerNode", ""))

            async def session() -> list[Any]:
                pipe: Any = self.conn.client.pipeline(transaction=False)
                return list(await pipe.get(key).pttl(key).execute())

            epoch, lease_left = await self.conn.run(session, fk)
            if epoch is None or epoch.decode() != m["se"]:
                m = {}  # its session lapsed: the flight is vacant, whatever meta still says
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

    def prepare(self, fk: FlightKeys) -> Handle:
        return Handle(fk.digest, self._claim_id())

    def _claim_id(self) -> str:
        """Unique per call: this node's random prefix and a counter (no entropy per call)."""
        self._claims += 1
        return f"{self._claim_prefix}{self._claims:x}"

    async def begin(self, fk: FlightKeys, opts: CallOptions, handle: Handle) -> Opening:
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

    async def begin_many(
        self, fks: Sequence[FlightKeys], opts: Sequence[CallOptions], handles: Sequence[Handle]
    ) -> list[Opening | FlightError]:
        """``begin`` for each key, the joins sent together: one round trip on a server
        (one per node of a Cluster). A join the server refused fails only its own key."""
        for fk, handle in zip(fks, handles, strict=True):
            handle.waiter = self.hub.watch(fk.digest)
        calls = [
            self._join_call(fk, o, "always", o.refresh, b"", handle.claim_id)
            for fk, o, handle in zip(fks, opts, handles, strict=True)
        ]
        sent = self.clock()
        try:
            replies = await script_calls(self.conn, LUA["join_flight"], calls)
        except BaseException:
            for handle in handles:
                self.release(handle)
            raise
        openings: list[Opening | FlightError] = []
        for handle, reply in zip(handles, replies, strict=True):
            if isinstance(reply, FlightError):
                self.release(handle)
                openings.append(reply)
                continue
            state = state_of(reply, handle.claim_id, sent)
            if state.kind == HIT:
                self.release(handle)
                assert state.value is not None
                leasable = state.leasable and state.ttl_left_ms > 0
                openings.append(
                    Opening(state.value, state.ttl_left_ms, leasable, state.cost_ms, handle)
                )
            else:
                handle.state = state
                openings.append(Opening(None, handle=handle))
        return openings

    async def abandon(self, fk: FlightKeys, opts: CallOptions, handle: Handle) -> None:
        """Nobody waits for this call any more: if its join claimed the flight, give it
        back at once (followers claim without waiting out the lease)."""
        RedisFlights.release(handle)
        try:
            state = handle.state or await self._join(
                fk, opts, "mine", refresh=opts.refresh, claim_id=handle.claim_id
            )
            if state.kind == CLAIMED and state.token:
                await self.owner.give_back(fk, state.token)
        except FlightError as exc:  # the claim lapses with its lease
            log_claim.info("flight %s: could not give back an abandoned claim: %s", fk.digest, exc)

    @staticmethod
    def release(handle: Handle | None) -> None:
        if handle is not None and handle.waiter is not None:
            handle.waiter.hub.unwatch(handle.waiter)
            handle.waiter = None

    async def resolve(
        self, fk: FlightKeys, job: Job, opts: CallOptions, handle: Handle | None = None
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

    async def _resolve(self, fk: FlightKeys, job: Job, opts: CallOptions, handle: Handle) -> bytes:
        deadline = self.clock() + opts.wait_bound_s
        waiter = handle.waiter
        assert waiter is not None
        state: State | None = handle.state
        if state is None:  # the first join is still to be answered: through a failover too
            state = await self._first_join(fk, opts, handle.claim_id)
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
                if state is not None and state.kind == CLAIMED and state.token:
                    # The join that found the bound passed claimed the flight: give it back,
                    # so the key's other callers claim now, not after its lease.
                    with contextlib.suppress(FlightError):
                        await self.owner.give_back(fk, state.token)
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
                    outcome = await self.follower.follow(fk, job, state, opts, deadline, waiter)
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
                    # (a fresh claim: a whole lease; a claim found again: what it has left;
                    # bound to a session, the backstop is its own keys' lease).
                    span = self.tuning.session_backstop_ms if state.bound else opts.lease_ms
                    granted = state.sent + (state.lease_left_ms - span) / 1000
                    confirmed: tuple[int, float] = (state.token, granted)
                    claim = ""
                else:  # owner-seq is in another slot: the token, then the loader at once
                    confirmed, claim = await self.tokens.take(fk, opts, state), state.claim_id
                if takeover:
                    self.stats.takeovers += 1
                try:
                    return await self.owner.run(
                        fk, job, opts, *confirmed, state.attempts or 1, claim, state.bound
                    )
                except Lost:
                    state = None
                    takeover = False
            except (PoolExhausted, Undelivered):
                raise  # overloaded, or a value in hand the server would not take: not a retry
            except BackendUnavailable as exc:
                # A failover (a cluster master replaced by its replica) or a blip: the flight
                # may still be fine. Retry from a fresh join for a while, then give up.
                now = self.clock()
                outage = now if outage is None else outage
                if now - outage >= self.tuning.failover_s:
                    raise
                log_claim.info("flight %s: server unreachable, retrying: %s", fk.digest, exc)
                await asyncio.sleep(backoff)  # outage backoff
                backoff = min(backoff * 2, 1.0)
                state = None
                continue
            outage, backoff = None, 0.05

    async def _first_join(self, fk: FlightKeys, opts: CallOptions, claim_id: str) -> State:
        """A call's first join, sent again (the same claim id: it answers the claim it may
        have made) while the server is unreachable, for up to ``failover_s``: a failover is
        not yet an outage, and fail-open starts only after it."""
        started = self.clock()
        backoff = 0.05
        while True:
            try:
                return await self._join(fk, opts, "always", refresh=opts.refresh, claim_id=claim_id)
            except PoolExhausted:
                raise
            except BackendUnavailable as exc:
                if self.clock() - started >= self.tuning.failover_s:
                    raise
                log_claim.info("flight %s: server unreachable, retrying: %s", fk.digest, exc)
                await asyncio.sleep(backoff)  # outage backoff
                backoff = min(backoff * 2, 1.0)

    @staticmethod
    def _lease_hit(job: Job, state: State) -> None:
        """A hit answered by a join: a near cache may lease it (no invalidation marks it)."""
        if state.leasable:
            job.lease = (state.sent, state.ttl_left_ms)
            job.cost_ms = state.cost_ms or None

    def _ended(self, state: State, job: Job) -> bytes | None:
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
    ) -> State:
        """Hit, follow, or claim (mode 'always', or 'first' in the waiters queue).

        ``refresh`` ignores a stored result (only a refresh call's first join: later, a
        result is the one its own flight stored). ``since`` is a follower's stream position:
        an end of its flight after it is reported (ENDED) rather than claimed over.
        """
        claim_id = claim_id or self._claim_id()
        keys, args = self._join_call(fk, opts, claim, refresh, since, claim_id)
        sent = self.clock()
        reply, waited = await self.conn.script_timed(LUA["join_flight"], fk, keys, args)
        return state_of(reply, claim_id, sent + waited)  # a lease granted runs from the write

    def _join_call(
        self,
        fk: FlightKeys,
        opts: CallOptions,
        claim: str,
        refresh: bool,
        since: bytes,
        claim_id: str,
    ) -> tuple[list[str], tuple[Any, ...]]:
        """The keys and arguments of one ``join_flight``."""
        keys = [fk.result, fk.meta, fk.waiters, fk.stream, fk.marker, fk.cost]
        bits: int | str = ""
        if self.token_in_join:
            keys.append(self.keyspace.owner_seq)
            bits = random.getrandbits(TOKEN_RANDOM_BITS)  # uniqueness, not secrecy
        node, waiters_ttl, lease, timeout, stream_ttl, prefix, limit = self._join_args(opts)
        sessions = self.owner.sessions
        session = sessions.binding(opts.lease_ms) if sessions is not None and bits != "" else None
        args: tuple[Any, ...] = (
            node,
            waiters_ttl,
            claim,
            claim_id,
            lease,
            timeout,
            opts.key_text,
            stream_ttl,
            "1" if refresh else "0",
            since,
            opts.refresh_below_ms,
            bits,
            prefix,
            fk.digest,
            limit,
        )
        if session is not None:  # a claim binds to it if it still holds when the join runs
            keys.append(session.key)
            args += (session.epoch, self.tuning.session_backstop_ms)
        return keys, args

    def _join_args(self, opts: CallOptions) -> tuple[bytes, ...]:
        """The join's arguments that depend only on the cache and the call's lease and
        timeout, encoded once (the hot path packs them as they are)."""
        static = self._static.get((opts.lease_ms, opts.timeout_s))
        if static is None:
            if len(self._static) > 64:
                self._static.clear()
            linger = opts.lease_ms + self.tuning.stream_linger_ms
            prefix, limit = self._wake
            static = self._static[(opts.lease_ms, opts.timeout_s)] = tuple(
                str(v).encode()
                for v in (
                    self.node_id,
                    linger,
                    opts.lease_ms,
                    int(opts.timeout_s * 1000),
                    linger,
                    prefix,
                    limit,
                )
            )
        return static

    async def confirmed(self, token: int) -> None:
        """Once the ``confirm_claim`` of ``token``'s claim, if one is on its way, is answered
        (``Tokens.confirmed``)."""
        await self.tokens.confirmed(token)
