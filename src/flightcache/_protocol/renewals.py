"""What an owner's renewals put on the wire, and what their answers change: the fenced
``renew_leases`` of its flights, its session's ``renew_session``, and the ``bind_leases``
that binds a flight claimed before the session was up to it (docs/protocol.md, "Batched
renewals", "Sessions", "Binding a flight after its claim").

The renewer (``heartbeat.py``) decides when; this decides what. One server's renewals run
on the renewer's thread, on a blocking connection of their own (``on_thread``); a Cluster's,
or a test clock's, on the caller's loop (``on_loop``), where no session is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

from .._backends.convoy import Bulk, bulk
from .._backends.lane import SyncLane
from .._backends.redis import RedisConnection
from .._config import Tuning
from .._errors import FlightError
from .._keys import FlightKeys
from .heartbeat import Lease
from .pipelined import script_batches
from .session import Session, Sessions
from .state import LUA

_ZERO = bulk(0)
BOUND, RENEWED = 2, 1  # bind_leases' answers (0: the token no longer holds)
# Bound flights' own keys are renewed in scripts of at most this many: their renewals keep
# keys, not liveness, and come in waves (the flights claimed together fall due together);
# a script of 200 held the server ~4 ms, and every wake-up due then waited behind it.
KEEP_BATCH = 50


@dataclass(slots=True, eq=False)
class Owned:
    """An owned flight as its renewals see it (its lease's ``args``)."""

    fk: FlightKeys
    token: int
    lease_ms: int  # meta's TTL a renewal sets (a bound flight's: the backstop)
    stream_ttl: int  # the stream's and waiters' (a bound flight's: the backstop)
    claim: str  # the claim id where the token was taken after the join, else ''
    # The session its liveness hangs on: set when a claim bound it, or from the moment a
    # bind is sent (its proof is then capped by the session's: ``session.BoundProof``).
    session: Session | None = None
    bound: bool = False  # the server bound it: its renewals keep its keys, not its liveness


def shape_bound(lease: Lease, session: Session, backstop_s: float) -> None:
    """Make ``lease`` a flight's bound to ``session``, at its claim or by a later bind: its
    liveness is the session's, so its own renewals only keep its keys (meta, stream and
    waiters) for the backstop, every half of it (a flight shorter than that needs none),
    each one full; due give or take half a session tick, not brought forward by half of its
    own long interval to go with the session's ticks."""
    o: Owned = lease.args
    o.bound = True
    o.session = session
    o.lease_ms = o.stream_ttl = int(backstop_s * 1000)
    lease.packed = None
    lease.full_every = lease.since_full = 0
    lease.lease_s = backstop_s
    lease.interval_s = backstop_s / 2
    lease.window_s = min(backstop_s / 4, session.lease_s / 6)


class Renewals:
    """The renewal batches of one owner on one server (or Cluster)."""

    def __init__(self, conn: RedisConnection, tuning: Tuning) -> None:
        self.conn = conn
        self.tuning = tuning
        self.sessions: Sessions | None = None  # this node's session there, if it keeps one
        self._lane: SyncLane | None = None
        self.bound_late = 0  # flights bound to a session after their claim (tests, bench)

    def close(self) -> None:
        lane, self._lane = self._lane, None
        if lane is not None:
            lane.close()

    def _calls(
        self, leases: Sequence[Lease], cluster: bool, size: int | None = None
    ) -> Iterator[tuple[list[Lease], tuple[Any, Any]]]:
        """The ``renew_leases`` calls for ``leases``, each with its leases, made as they are
        taken: on one server, scripts of up to ``size`` flights (``renew_batch``); on a
        Cluster, one script per slot (a script cannot span slots), which a cluster pipeline
        sends one round trip per node."""
        size = self.tuning.renew_batch if size is None else size
        for batch in script_batches(leases, lambda lease: lease.args.fk.meta, cluster, size):
            if cluster:  # (redis-py's cluster pipeline packs them)
                keys: list[Any] = []
                args: list[Any] = []
                for lease in batch:
                    o: Owned = lease.args
                    keys += (o.fk.meta, o.fk.stream, o.fk.waiters)
                    args += (o.token, o.lease_ms, o.stream_ttl if lease.take_full() else 0, o.claim)
                yield batch, (keys, args)
                continue
            # Packed once per lease, not once per renewal: ten thousand leases are ten
            # thousand renewals a lease/3, and the thread building them holds the GIL. Kept
            # as bytes, which the cyclic GC does not track (Bulk).
            parts_keys: list[bytes] = []
            parts_args: list[bytes] = []
            for lease in batch:
                packed = lease.packed
                if packed is None:
                    o = lease.args
                    head, tail = bulk(o.token, o.lease_ms), bulk(o.claim)
                    packed = lease.packed = (
                        bulk(o.fk.meta, o.fk.stream, o.fk.waiters),
                        head + bulk(o.stream_ttl) + tail,
                        head + _ZERO + tail,  # a short renewal: the lease only
                    )
                parts_keys.append(packed[0])
                parts_args.append(packed[1] if lease.take_full() else packed[2])
            yield batch, (Bulk(parts_keys, 3 * len(batch)), Bulk(parts_args, 4 * len(batch)))

    def on_thread(
        self, leases: Sequence[Lease], patience: Callable[[], float | None]
    ) -> list[bool]:
        """One batch of renewals from the renewer's thread, on its blocking connection (made
        on first use), waiting only as long as ``patience`` says: a session first (its
        flights' renewals are fenced by it), then the flights' leases, then the bound
        flights' own keys (in scripts of ``KEEP_BATCH``), and those claimed before the
        session was up bound to it as they are renewed.

        One script a write, each made just before it is sent: a server reads all of a
        pipeline that has arrived and runs it before it serves anyone else, so ten thousand
        renewals written at once kept every other command to that server (the completes of
        this process and of others) waiting for their ~100 ms; one at a time, a renewal
        delays another client's command by one script at most. And the thread holds the
        GIL for one script's packing at a time, not for ten thousand leases'."""
        lane = self._lane
        if lane is None:
            lane = self._lane = self.conn.sync_lane("renew")
        answers: dict[int, bool] = {}
        flights: list[Lease] = []
        for lease in leases:
            if isinstance(lease.args, Session):
                answers[id(lease)] = self._session(lane, lease.args, patience)
            else:
                flights.append(lease)
        binds, session = self._to_bind(flights)
        if binds:
            binding = {id(lease) for lease in binds}
            flights = [lease for lease in flights if id(lease) not in binding]
        leased = [lease for lease in flights if not lease.args.bound]
        kept = [lease for lease in flights if lease.args.bound]
        for batch, call in chain(self._calls(leased, False), self._calls(kept, False, KEEP_BATCH)):
            (reply,) = lane.calls(LUA["renew_leases"], (call,), patience)
            if isinstance(reply, Exception):
                raise FlightError(f"Redis at {lane.safe_url} refused a renewal: {reply}")
            for lease, ok in zip(batch, reply, strict=True):
                answers[id(lease)] = bool(ok)
        if binds:
            assert session is not None
            self._bind(lane, binds, session, patience, answers)
        return [answers[id(lease)] for lease in leases]

    def _session(
        self, lane: SyncLane, session: Session, patience: Callable[[], float | None]
    ) -> bool:
        """Start ``session`` (until its start was answered) or renew it: one command."""
        start = "0" if session.ready else "1"
        call = ((session.key,), (session.epoch, int(session.lease_s * 1000), start))
        (reply,) = lane.calls(LUA["renew_session"], (call,), patience)
        if isinstance(reply, Exception):
            raise FlightError(f"Redis at {lane.safe_url} refused a session renewal: {reply}")
        if int(reply) == 1:
            session.ready = True
            return True
        return False

    # -- binding a flight after its claim ------------------------------------------------

    def _to_bind(self, flights: Sequence[Lease]) -> tuple[list[Lease], Session | None]:
        """The flights of a batch to bind to this node's session as they are renewed (those
        claimed unbound, with the session's lease), and the session; none unless it is
        usable (started, and proven for a while yet). Each one's proof is capped by the
        session's from now on: the bind may run even if its answer is lost."""
        sessions = self.sessions
        session = sessions.current if sessions is not None else None
        if session is None or not session.usable():
            return [], None
        lease_ms = int(session.lease_s * 1000)
        binds = [
            lease for lease in flights if not lease.args.bound and lease.args.lease_ms == lease_ms
        ]
        for lease in binds:
            lease.args.session = session
        return binds, session

    def _bind(
        self,
        lane: SyncLane,
        binds: Sequence[Lease],
        session: Session,
        patience: Callable[[], float | None],
        answers: dict[int, bool],
    ) -> None:
        """``bind_leases`` for ``binds``: each flight whose token holds is renewed, and bound
        to ``session`` while the server's session key holds its epoch (else renewed as it
        was, unbound). A bound one's lease turns into a bound flight's (its own keys renewed
        every half of the backstop) before its answer is settled, and it joins the session's
        flights on its loop (``Sessions.adopt``: given up at once if the session ended)."""
        assert self.sessions is not None
        backstop_s = self.sessions.backstop_s
        backstop_ms = int(backstop_s * 1000)
        size = self.tuning.renew_batch
        for batch in script_batches(binds, lambda lease: lease.args.fk.meta, False, size):
            keys: list[Any] = []
            args: list[Any] = [session.epoch, backstop_ms]
            for lease in batch:
                o: Owned = lease.args
                keys += (o.fk.meta, o.fk.stream, o.fk.waiters)
                args += (o.token, o.lease_ms, o.stream_ttl, o.claim)
                lease.full = True  # (a full renewal: the stream and waiters too)
            (reply,) = lane.calls(LUA["bind_leases"], ((keys, args),), patience)
            if isinstance(reply, Exception):
                raise FlightError(f"Redis at {lane.safe_url} refused a renewal: {reply}")
            for lease, answer in zip(batch, reply, strict=True):
                o = lease.args
                if answer == BOUND:
                    shape_bound(lease, session, backstop_s)
                    self.bound_late += 1
                    loop = lease._work.get_loop()
                    loop.call_soon_threadsafe(self.sessions.adopt, session, lease)
                elif answer == RENEWED:
                    o.session = None  # the session was not there: still its own lease
                answers[id(lease)] = answer in (BOUND, RENEWED)

    # -- on the loop: a Cluster, or a test clock ------------------------------------------

    async def on_loop(self, leases: Sequence[Lease]) -> list[bool]:
        """Pipelines renewing every lease given, on the reserved lane, one after another,
        each of up to ``renew_batch`` flights: on one server one script, on a Cluster one
        script a slot, sent to their nodes at once. A node runs a pipeline that has arrived
        whole before it serves anyone else (docs/protocol.md, "One script a write")."""
        chunks: list[list[tuple[list[Lease], Any]]] = [[]]
        flights = 0
        for made in self._calls(leases, self.conn.cluster is not None):
            if flights and flights + len(made[0]) > self.tuning.renew_batch:
                chunks.append([])
                flights = 0
            chunks[-1].append(made)
            flights += len(made[0])
        answers: dict[int, bool] = {}
        for chunk in chunks:
            replies = await self.conn.pipeline_script(
                LUA["renew_leases"], [call for _, call in chunk], lane=True
            )
            for (batch, _), reply in zip(chunk, replies, strict=True):
                for lease, ok in zip(batch, reply, strict=True):
                    answers[id(lease)] = bool(int(ok))
        return [answers[id(lease)] for lease in leases]
