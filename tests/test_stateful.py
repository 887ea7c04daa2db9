"""The model's invariants against a real server: hypothesis chooses the interleavings.

Three simulated processes drive the real Lua scripts (``join_flight``, ``peek_flight``,
``renew_leases``, ``complete_flight``, ``fail_flight``, ``replace_result``, ``end_replace``,
``read_result``) on the session's private server, each with its own node id and wake channel
(a real pub/sub subscription), and use the real client pieces that do not need an event
loop: the join's reply parser (``state_of``), the wake message parser (``parse_message``)
and the follower's rule for a message out of step (``entry_key``), and each node's real
``NearCache`` and ``Leaser`` on an injectable clock. A pause is a process hypothesis does
not schedule; a lease lapses by ``PEXPIRE`` on meta; time for read leases is the injected
clock, advanced by a rule. After every step the checks of docs/protocol.md "The model check"
run: one stored result per flight, written by the current token's holder; no store after a
takeover; every returned value was produced by an owner (or given to ``set``); a follower
applies only its own flight's events; and no near cache serves a value that an invalidation
which has returned replaced.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from flightcache import EmbeddedServer
from flightcache._codec import Envelope, make_codec
from flightcache._keys import KeySpace
from flightcache._leases.near import Leaser, NearCache
from flightcache._leases.nodes import LUA as LEASE_LUA
from flightcache._protocol.state import CLAIMED, ENDED, FOLLOW, HIT, LUA, VACANT, state_of
from flightcache._protocol.wakeup import entry_key, parse_message

LEASE_MS = 3000
NEAR_LEASE_S = 5.0
SKEW_S = 0.25
LINGER_MS = LEASE_MS + 10_000
PROCS = 3
ENVELOPE = Envelope(make_codec("json"), 1 << 20)


class Clock:
    """The monotonic clock the near caches read, advanced by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Proc:
    def __init__(self, pid: int, client: redis.Redis, ks: KeySpace, clock: Clock) -> None:
        self.pid = pid
        self.node = f"node-{pid}-{os.urandom(4).hex()}"
        self.pubsub = client.pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(ks.wake_prefix + self.node)
        self.near = NearCache(max_entries=10, max_bytes=1 << 20, clock=clock)
        self.heard = 0
        self.leaser = Leaser(
            self.near,
            lease_s=NEAR_LEASE_S,
            skew_margin_s=SKEW_S,
            heard=lambda: self.heard,
            live_until=lambda: clock() + 6.0,  # renewing: its liveness never lapses here
            clock=clock,
        )
        self.reset_call()

    def reset_call(self) -> None:
        self.phase = "idle"  # idle, join, follow, own, done(after loader)
        self.mode = "always"
        self.since = b""
        self.cursor = b"0-0"
        self.gen = b""  # the flight whose events it applies (job generation)
        self.token = 0
        self.claim = b""  # the claim's stream entry
        self.claim_id = ""  # what its fenced writes carry on a Cluster ('' on one server)
        self.confirming = False  # a Cluster claim's confirm_claim is still to be sent
        self.value: bytes | None = None  # the loader's result, once it returned
        self.heard_at_start = self.leaser.heard()
        self.sent = 0.0

    def messages(self) -> list[tuple[bytes, list[Any]]]:
        out = []
        while True:
            message = self.pubsub.get_message(timeout=0.001)
            if message is None:
                return out
            _digest, prev, entries = parse_message(message["data"])
            out.append((prev, entries))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cluster", [False, True], ids=["token-in-join", "cluster-claims"])
def test_the_protocols_invariants_hold_under_chosen_interleavings(
    server: EmbeddedServer, cluster: bool
) -> None:
    """``cluster``: claims as on a Cluster (owner-seq elsewhere): the join claims without a
    token, the owner INCRs and starts at once, and confirm_claim, sent beside the loader,
    or its first fenced write carrying the claim id confirms the claim."""
    client = redis.Redis.from_url(server.url)
    scripts = {name: client.register_script(s.text) for name, s in {**LUA, **LEASE_LUA}.items()}

    class Flights(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.ks = KeySpace("st" + os.urandom(6).hex())  # not `random`: hypothesis seeds it
            self.fk = self.ks.flight("k")
            self.clock = Clock()
            self.procs = [Proc(i, client, self.ks, self.clock) for i in range(PROCS)]
            self.produced: set[bytes] = set()
            self.stored_flights: set[bytes] = set()
            self.ever_stored: set[bytes] = set()
            self.dead: set[bytes] = set()
            self.invalidations: dict[int, tuple[str, float, set[int], set[bytes]]] = {}
            self.token_of: dict[bytes, int] = {}  # claim entry -> its token
            self.n = 0
            for p in self.procs:  # the subscription is confirmed before anything publishes
                p.pubsub.get_message(timeout=1.0)

        def teardown(self) -> None:
            for p in self.procs:
                p.pubsub.close()

        # -- helpers ---------------------------------------------------------------------

        def returns(self, p: Proc, data: bytes | None, lease: tuple[float, int] | None) -> None:
            if data is not None and not ENVELOPE.is_error(data):
                assert data in self.produced, f"p{p.pid} returned {data!r}, which nobody made"
                if lease is not None:
                    self.p_grant(p, data, *lease)
            p.reset_call()

        def p_grant(self, p: Proc, data: bytes, sent: float, ttl_ms: int) -> None:
            p.leaser.grant(self.fk.digest, data, sent, ttl_ms, p.heard_at_start)

        def join(self, p: Proc, mode: str, since: bytes) -> None:
            fk = self.fk
            self.n += 1
            claim_id = f"{p.node}-{self.n}"
            p.sent = self.clock()
            reply = scripts["join_flight"](
                keys=[
                    fk.result,
                    fk.meta,
                    fk.waiters,
                    fk.stream,
                    fk.marker,
                    fk.cost,
                    *(() if cluster else (self.ks.owner_seq,)),
                ],
                args=[
                    p.node,
                    LINGER_MS,
                    mode,
                    claim_id,
                    LEASE_MS,
                    60_000,
                    "k",
                    LINGER_MS,
                    "0",
                    since,
                    0,
                    "" if cluster else random.getrandbits(20),
                    self.ks.wake_prefix,
                    fk.digest,
                    65536,
                ],
            )
            state = state_of(reply, claim_id, p.sent)
            if state.kind == HIT:
                assert state.value is not None
                lease = (state.sent, state.ttl_left_ms) if state.leasable else None
                self.returns(p, state.value, lease)
            elif state.kind == FOLLOW:
                p.phase, p.cursor, p.gen, p.since = "follow", state.last_id, state.last_id, since
            elif state.kind == CLAIMED:
                token = state.token
                if cluster:  # INCR owner-seq; the loader starts, confirm_claim goes beside it
                    assert not token
                    token = (client.incr(self.ks.owner_seq) << 20) | random.getrandbits(20)
                    p.claim_id, p.confirming = claim_id, True
                assert token
                p.phase, p.token, p.claim, p.gen = "own", token, state.last_id, state.last_id
                p.since = state.last_id
                self.token_of[state.last_id] = token
            elif state.kind == VACANT:
                p.phase, p.mode, p.since = "join", "always", since  # after its takeover sleep
            else:
                assert state.kind == ENDED
                self.returns(p, state.value or ENVELOPE.encode_error(RuntimeError("?")), None)

        def apply(self, p: Proc, entries: list[Any]) -> None:
            for entry_id, fields in entries:
                kind = fields[b"t"]
                if kind != b"claimed":  # the event is the flight's this follower holds
                    assert int(fields[b"tok"]) == self.token_of.get(p.gen), (
                        f"p{p.pid} applied {kind!r} of token {fields[b'tok']!r} while it "
                        f"holds the flight claimed at {p.gen!r}"
                    )
                p.cursor = entry_id
                if kind == b"claimed":
                    p.gen = entry_id
                    continue
                if kind == b"done":
                    value = fields.get(b"v")
                    assert value is not None  # small values ride inline
                    lease = (p.sent, int(fields[b"x"])) if b"x" in fields else None
                    self.returns(p, bytes(value), lease)
                    return
                if kind == b"error":
                    self.returns(p, bytes(fields[b"v"]), None)
                    return
                if kind == b"reset":
                    p.phase, p.mode, p.since = "join", "first", entry_id
                    return

        def owned(self, p: Proc) -> bool:
            return p.phase in ("own", "done")

        # -- a do() call -------------------------------------------------------------------

        @rule(i=st.integers(0, PROCS - 1))
        def start_or_join(self, i: int) -> None:
            p = self.procs[i]
            if p.phase == "idle":
                p.reset_call()
                p.heard_at_start = p.leaser.heard()
                data = p.near.get(self.fk.digest)
                if data is not None:
                    assert data not in self.dead, f"p{i} served a copy an invalidation replaced"
                    return
                self.join(p, "always", b"")
            elif p.phase == "join":
                self.join(p, p.mode, p.since)

        @rule(i=st.integers(0, PROCS - 1), ok=st.booleans())
        def loader_returns(self, i: int, ok: bool) -> None:
            p = self.procs[i]
            if p.phase != "own":
                return
            if ok:
                p.value = ENVELOPE.encode(f"v{p.claim.decode()}")
                self.produced.add(p.value)
            else:
                p.value = ENVELOPE.encode_error(RuntimeError("the loader failed"))
            p.phase = "done"

        @rule(i=st.integers(0, PROCS - 1))
        def renew(self, i: int) -> None:
            p = self.procs[i]
            if p.phase != "own":
                return
            fk = self.fk
            ok = scripts["renew_leases"](
                keys=[fk.meta, fk.stream, fk.waiters],
                args=[p.token, LEASE_MS, LINGER_MS, p.claim_id],
            )
            if not int(ok[0]):  # give_up: the loader is cancelled; join again and follow
                p.phase, p.mode, p.since = "join", "always", p.claim

        @rule(i=st.integers(0, PROCS - 1))
        def write(self, i: int) -> None:
            p = self.procs[i]
            if p.phase != "done":
                return
            fk = self.fk
            current, claim_id = client.hmget(fk.meta, "ownerToken", "claimId")
            assert p.value is not None
            if ENVELOPE.is_error(p.value):
                code = scripts["fail_flight"](
                    keys=[fk.result, fk.meta, fk.stream, fk.waiters],
                    args=[
                        p.token,
                        "error",
                        p.value,
                        0,
                        10_000,
                        self.ks.wake_prefix,
                        fk.digest,
                        65536,
                        p.claim_id,
                    ],
                )
                if int(code):
                    self.returns(p, p.value, None)
                else:
                    p.phase, p.mode, p.since = "join", "always", p.claim
                return
            sent = self.clock()
            code = int(
                scripts["complete_flight"](
                    keys=[fk.result, fk.meta, fk.stream, fk.waiters, fk.cost],
                    args=[
                        p.token,
                        p.value,
                        60_000,
                        "1",
                        10_000,
                        "",
                        5,
                        self.ks.wake_prefix,
                        fk.digest,
                        65536,
                        p.claim_id,
                    ],
                )
            )
            if code == 1:  # the current token's, or the claim this write confirmed
                holds = current == str(p.token).encode() or (
                    current is None and p.claim_id and claim_id == p.claim_id.encode()
                )
                assert holds, "stored by a token that is not meta's"
                assert p.claim not in self.stored_flights, "a flight stored twice"
                self.stored_flights.add(p.claim)
                self.ever_stored.add(p.value)
                self.returns(p, p.value, (sent, 60_000))
            elif code == 2:
                self.returns(p, p.value, None)
            else:
                p.phase, p.mode, p.since = "join", "always", p.claim

        @rule(i=st.integers(0, PROCS - 1))
        def give_back(self, i: int) -> None:
            p = self.procs[i]
            if p.phase != "own":
                return
            fk = self.fk
            scripts["fail_flight"](
                keys=[fk.result, fk.meta, fk.stream, fk.waiters],
                args=[
                    p.token,
                    "reset",
                    "",
                    0,
                    10_000,
                    self.ks.wake_prefix,
                    fk.digest,
                    65536,
                    p.claim_id,
                ],
            )
            p.reset_call()  # its cache was closed: the call ends with FlightError

        @rule(i=st.integers(0, PROCS - 1))
        def confirm(self, i: int) -> None:
            """A Cluster owner's confirm_claim lands (its answer is not awaited)."""
            p = self.procs[i]
            if p.confirming:
                p.confirming = False
                scripts["confirm_claim"](keys=[self.fk.meta], args=[p.claim_id, p.token, LEASE_MS])

        @rule(i=st.integers(0, PROCS - 1))
        def wake(self, i: int) -> None:
            """follower.py ``_news`` and ``follow``: messages applied after the cursor, or
            the stream read from the cursor when a message is out of step."""
            p = self.procs[i]
            if p.phase != "follow":
                p.messages()  # nobody waits: dropped
                return
            cursor = p.cursor
            at = entry_key(cursor)
            news: list[Any] = []
            for prev, entries in p.messages():
                if entries and entry_key(entries[-1][0]) <= at:
                    continue
                if not entries or entry_key(prev) > at:  # what the earlier messages told,
                    # then the stream itself from there
                    news += client.xrange(self.fk.stream, b"(" + cursor)
                    break
                news += [e for e in entries if entry_key(e[0]) > at]
                at = entry_key(entries[-1][0])
                cursor = entries[-1][0]
            self.apply(p, news)

        @rule(i=st.integers(0, PROCS - 1))
        def recheck(self, i: int) -> None:
            """follower.py's re-check: peek_flight, and a join in mode first only when meta
            no longer holds the claim it follows. The peek's argument is checked here: while
            meta holds that claim, nothing it waits for is on the stream after its cursor
            (every end deletes meta, a takeover writes another claimEntry)."""
            p = self.procs[i]
            if p.phase != "follow":
                return
            (left,) = scripts["peek_flight"](keys=[self.fk.meta], args=[p.gen])
            if left > 0:
                after = client.xrange(self.fk.stream, b"(" + p.cursor, b"+")
                missed = [(e, f[b"t"]) for e, f in after if f[b"t"] != b"chunk"]
                assert not missed, f"p{p.pid}'s peek said its claim holds; it missed {missed}"
                return
            self.join(p, "first", p.cursor)

        @rule()
        def lease_lapses(self) -> None:
            """The owner stopped renewing (paused, cut off): meta expires on the server."""
            if client.pexpire(self.fk.meta, 1):
                deadline = time.monotonic() + 1.0
                while client.exists(self.fk.meta) and time.monotonic() < deadline:
                    time.sleep(0.001)

        # -- read leases and invalidation --------------------------------------------------

        @rule(i=st.integers(0, PROCS - 1))
        def get(self, i: int) -> None:
            p = self.procs[i]
            if p.phase != "idle":
                return
            data = p.near.get(self.fk.digest)
            if data is not None:
                assert data not in self.dead, f"p{i} served a copy an invalidation replaced"
                return
            fk = self.fk
            heard, sent = p.leaser.heard(), self.clock()
            value, ttl, marked, _cost = scripts["read_result"](keys=[fk.result, fk.marker, fk.cost])
            if value:
                assert value in self.produced
                if not int(marked):
                    p.leaser.grant(fk.digest, value, sent, int(ttl), heard)

        @rule(i=st.integers(0, PROCS - 1), new=st.booleans())
        def invalidate(self, i: int, new: bool) -> None:
            p = self.procs[i]
            if p.phase != "idle" or i in self.invalidations:
                return
            fk = self.fk
            p.near.drop(fk.digest)
            p.heard += 1
            data = b""
            if new:
                self.n += 1
                data = ENVELOPE.encode(f"set-{self.n}")
                self.produced.add(data)
            inval = f"{i}-{self.n}"
            wait = NEAR_LEASE_S + SKEW_S
            superseded = set(self.ever_stored)
            existed = scripts["replace_result"](
                keys=[fk.result, fk.marker, fk.meta, fk.cost],
                args=[inval, int(wait * 1000), data, 60_000, ""],
            )
            if data:
                self.ever_stored.add(data)
            if not data and not int(existed):
                self.dead |= superseded
                return
            holders = {q for q in range(PROCS) if q != i}
            self.invalidations[i] = (inval, self.clock() + wait, holders, superseded)

        @rule(i=st.integers(0, PROCS - 1), inv=st.integers(0, PROCS - 1))
        def hear(self, i: int, inv: int) -> None:
            """Node ``i`` hears invalidation ``inv``'s message: drops its copy, acks."""
            if inv not in self.invalidations or i == inv:
                return
            inval, _deadline, _holders, _sup = self.invalidations[inv]
            p = self.procs[i]
            p.heard += 1
            p.near.drop(self.fk.digest)
            client.rpush(self.ks.ack(self.fk.digest, inval), p.node)

        @rule(inv=st.integers(0, PROCS - 1))
        def invalidation_returns(self, inv: int) -> None:
            if inv not in self.invalidations:
                return
            inval, deadline, holders, superseded = self.invalidations[inv]
            acked = {n.decode() for n in client.lrange(self.ks.ack(self.fk.digest, inval), 0, -1)}
            all_acked = {self.procs[q].node for q in holders} <= acked
            if not all_acked and self.clock() < deadline:
                return  # still waiting
            if all_acked:
                scripts["end_replace"](keys=[self.fk.marker], args=[inval])
            del self.invalidations[inv]
            self.dead |= superseded

        @rule(ms=st.sampled_from([100, 1000, 2500, 5300]))
        def time_passes(self, ms: int) -> None:
            self.clock.now += ms / 1000

        # -- the model's invariants, after every step ---------------------------------------

        @invariant()
        def no_near_cache_serves_a_replaced_value(self) -> None:
            for p in self.procs:
                data = p.near.get(self.fk.digest)
                if data is not None:
                    assert data not in self.dead, f"p{p.pid} may serve a replaced copy"

        @invariant()
        def the_stored_result_is_a_produced_value(self) -> None:
            data = client.get(self.fk.result)
            assert data is None or data in self.produced

        @invariant()
        def only_the_current_token_may_write(self) -> None:
            token = client.hget(self.fk.meta, "ownerToken")
            owners = [p for p in self.procs if self.owned(p) and str(p.token).encode() == token]
            assert len(owners) <= 1, "two processes hold the current token"

    Flights.TestCase.settings = settings(
        max_examples=int(os.environ.get("FLIGHTCACHE_STATEFUL_EXAMPLES", "150")),
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    try:
        Flights.TestCase().runTest()
    finally:
        client.close()


def test_a_lease_is_bounded_by_the_liveness_the_node_had_when_it_sent_the_read() -> None:
    """The model's counterexample, on the real Leaser: a node whose liveness lapsed (it was
    paused past node_ttl) sends a read; an invalidation deletes the value and reads the live
    set, which leaves the node out; the node's renewal lands, then the read's reply: the old
    value is leased for a whole lease, and nothing waits for the node to drop it."""
    clock = Clock()
    live_until = [clock() - 1.0]  # lapsed: the live set does not list this node
    near = NearCache(max_entries=10, max_bytes=1 << 20, clock=clock)
    leaser = Leaser(
        near,
        lease_s=NEAR_LEASE_S,
        skew_margin_s=SKEW_S,
        heard=lambda: 0,
        live_until=lambda: live_until[0],
        clock=clock,
    )
    sent, heard = clock(), leaser.heard()  # the read is sent while the node is not live
    clock.now += 0.01
    live_until[0] = clock() + 6.0  # its renewal's reply arrives first
    leaser.grant("digest", ENVELOPE.encode("old"), sent, 60_000, heard)
    assert near.get("digest") is None  # not live when it asked: no lease


def _netstring(value: bytes) -> bytes:
    return b"%d:%b" % (len(value), value)


_field = st.binary(max_size=40) | st.sampled_from([b"t", b"chunk", b"tok", b"s", b"v", b"1:s"])
_chunk_entry = st.tuples(
    st.binary(max_size=20), st.integers(0, 10**6), st.binary(max_size=300)
).map(lambda t: [b"t", b"chunk", b"tok", t[0], b"s", b"%d" % t[1], b"v", t[2]])
_entry = st.tuples(
    st.binary(min_size=1, max_size=24),
    _chunk_entry
    | st.lists(st.tuples(_field, _field), max_size=5).map(
        lambda pairs: [x for pair in pairs for x in pair]
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    digest=st.text(alphabet="0123456789abcdef", min_size=1, max_size=32),
    prev=st.binary(max_size=24),
    entries=st.lists(_entry, max_size=6),
)
def test_a_wake_message_parses_to_what_was_written(
    digest: str, prev: bytes, entries: list[tuple[bytes, list[bytes]]]
) -> None:
    """``parse_message`` against the format itself (docs/protocol.md, "The wake channel"):
    chunk entries as ``add_chunks`` writes them (read by the parser's shortcut), any other
    entry, and fields that look like the shortcut's markers, read back exactly; a message cut
    short is refused, never read as a shorter one."""
    data = _netstring(digest.encode()) + _netstring(prev)
    for entry_id, fields in entries:
        data += _netstring(entry_id) + _netstring(b"%d" % len(fields))
        data += b"".join(_netstring(f) for f in fields)
    expected = [(i, dict(zip(f[::2], f[1::2], strict=True))) for i, f in entries]
    assert parse_message(data) == (digest, prev, expected)
    if entries:
        with pytest.raises((ValueError, IndexError)):
            parse_message(data[:-1])
