"""The model's invariants against real ``FlightCache`` objects: hypothesis chooses the
interleavings.

``tests/test_stateful.py`` drives the Lua scripts and the client's pure helpers; this one
drives the whole client: three ``FlightCache`` objects (each its own node, listener,
``Renewer``, ``Follower`` and near cache) on one asyncio loop and the session's private
server. Each loader is the machine's: it records its fencing token and the flight's claim
as the server holds it, then waits on an ``asyncio.Event`` the machine sets (a held loader
is a paused owner). Rules: a ``do()`` call, a loader returning a value or raising, a lease
lapsing, a caller cancelled, ``get``, ``invalidate``, ``set``, time passing.

A lease lapses by ``PEXPIRE`` of the flight's meta on the server. ``FlightCache`` has no
clock to inject (``RedisFlights`` takes ``clock=`` but ``server_parts`` does not pass one),
and a fake clock would not help: the ``Renewer``'s and the ``Follower``'s waits are asyncio
timers, which run on the loop's real time whatever the clock says. The server's clock is the
one that decides a lease, so lapsing the key is what an owner paused past its lease looks
like from everywhere else; its own heartbeat finds out at its next renewal (a held loader
released before that writes with a token that no longer holds: the fence must refuse it).
Leases are short (0.5 s) so that renewals, re-checks and takeovers happen within an example.

After every step (docs/protocol.md "The model check", the real-server half):

- every value a call returned is one some loader produced for the key, or one ``set`` gave;
- at most one stored result per flight (claim), and it was written under the token that
  held that claim: each ``done`` event with ``x`` (stored) on the flight's stream comes after
  its claim's ``claimed`` event with no other claim between, carries the token the claim's
  loader ran with, and the value that loader returned;
- after ``invalidate``/``set`` returns, no near cache serves a value it replaced (the stored
  one, and the value of any loader run that began before it), and the server does not store
  one either.

Timing on a loaded machine changes which interleaving a step makes, never what is checked:
every check is a safety property, true of every interleaving. (Nor what hypothesis draws:
no rule has a precondition or draws from what happens to be running.) Only the drain at the end of
an example waits for calls to return, with a generous bound.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from flightcache import MISSING, EmbeddedServer, FlightCache, FlightTimeout, RemoteError
from flightcache._protocol.state import LUA

PROCS = 3
LEASE_S = 0.5
NEAR_LEASE_S = 1.0
TTL_S = 1.5  # stored results lapse within an example: later calls miss again
# Which held loader or pending call a rule picks (modulo how many there are; none: the rule
# does nothing). Rules draw nothing whose shape depends on what is running: timing decides
# that, and hypothesis must draw the same way each time it replays a choice sequence.
PICK = st.integers(0, 7)


class LoaderFailed(Exception):
    """What a loader the machine fails raises."""


class Run:
    """One run of a loader: its token, its claim, and the event that releases it."""

    def __init__(self, n: int, cache: int, value: str) -> None:
        self.n = n
        self.cache = cache
        self.value = value
        self.token = 0
        self.claim = b""
        self.release = asyncio.Event()
        self.ok = True
        self.state = "running"  # running, returned, failed, cancelled


class Harness:
    """One loop, ``PROCS`` FlightCache objects and a plain client, for a whole test."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        namespace = "sc" + os.urandom(5).hex()
        self.caches = [
            FlightCache(
                url,
                namespace=namespace,
                ttl=TTL_S,
                lease=LEASE_S,
                timeout=60.0,
                near_lease=NEAR_LEASE_S,
                fail_open=False,
            )
            for _ in range(PROCS)
        ]
        self.client = aioredis.Redis.from_url(url)
        self.keys = itertools.count()
        for fc in self.caches:
            self.run(fc.ping())

    def run(self, aw: Awaitable[Any], timeout: float = 15.0) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(aw, timeout))

    def settle(self, until: Callable[[], bool], at_most: float) -> None:
        """Let the loop run until ``until()`` holds or ``at_most`` seconds passed."""
        loop = self.loop

        async def wait() -> None:
            deadline = loop.time() + at_most
            while not until() and loop.time() < deadline:  # noqa: ASYNC110 (any predicate)
                await asyncio.sleep(0.005)

        loop.run_until_complete(wait())

    def close(self) -> None:
        for fc in self.caches:
            self.run(fc.aclose())
        self.run(self.client.aclose())
        self.loop.close()


def machine(h: Harness) -> type[RuleBasedStateMachine]:
    loop, caches, client = h.loop, h.caches, h.client
    run, settle = h.run, h.settle
    keys = h.keys

    class Caches(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.key = f"k{next(keys)}"
            self.fk = caches[0].keyspace.flight(self.key)
            self.runs: list[Run] = []
            self.numbers = itertools.count()  # each run's, taken before its first await
            self.produced: set[str] = set()  # values loaders returned, and set() values
            self.dead: set[str] = set()  # values an invalidate/set that returned replaced
            self.calls: list[tuple[int, asyncio.Task[Any]]] = []
            self.checked: set[int] = set()  # ids of calls whose outcome was checked
            self.sets = 0
            self.draining = False

        # -- the machine's loaders --------------------------------------------------------

        def loader(self, i: int) -> Callable[[Any], Awaitable[str]]:
            async def load(ctx: Any) -> str:
                n = next(self.numbers)
                run_ = Run(n, i, f"{self.key}:run{n}")
                meta = await client.hgetall(self.fk.meta)
                run_.token = ctx.token
                run_.claim = meta.get(b"claimEntry", b"")
                token = meta.get(b"ownerToken")
                # The loader runs under the token meta holds (unless its lease lapsed already).
                assert token is None or int(token) == ctx.token, (token, ctx.token)
                self.runs.append(run_)
                try:
                    if not self.draining:
                        await run_.release.wait()
                except asyncio.CancelledError:
                    run_.state = "cancelled"
                    raise
                if not run_.ok:
                    run_.state = "failed"
                    raise LoaderFailed(run_.value)
                run_.state = "returned"
                self.produced.add(run_.value)
                return run_.value

            return load

        def held(self) -> list[Run]:
            return [r for r in self.runs if r.state == "running" and not r.release.is_set()]

        def pending(self) -> list[tuple[int, asyncio.Task[Any]]]:
            return [(i, t) for i, t in self.calls if not t.done()]

        # -- rules -----------------------------------------------------------------------

        @rule(i=st.integers(0, PROCS - 1))
        def call(self, i: int) -> None:
            fc = caches[i]
            runs, joined = len(self.runs), self.joined(fc)
            task = loop.create_task(fc.do(self.key, self.loader(i)))
            self.calls.append((i, task))
            # until it returned, started a loader, follows a flight, or shares its process's
            settle(lambda: task.done() or len(self.runs) > runs or self.joined(fc) > joined, 0.5)

        @rule(i=st.integers(0, PROCS - 1))
        def another_call(self, i: int) -> None:
            """Calls are most of what happens (a second rule: twice as likely)."""
            self.call(i)

        @staticmethod
        def joined(fc: FlightCache) -> int:
            stats = fc.stats
            return stats["follows"] + stats["coalesced"] + stats["hits"]

        @rule(pick=PICK, ok=st.booleans())
        def loader_returns(self, pick: int, ok: bool) -> None:
            held = self.held()
            if not held:
                return
            run_ = held[pick % len(held)]
            run_.ok = ok
            run_.release.set()
            settle(lambda: run_.state != "running", 0.5)
            settle(lambda: False, 0.02)  # its writes, and the followers' wake-ups

        @rule()
        def lease_lapses(self) -> None:
            """The owner is paused past its lease, by the server's clock."""
            if not self.held():
                return
            run(client.pexpire(self.fk.meta, 1))
            settle(lambda: False, 0.005)

        @rule(pick=PICK, i=st.integers(0, PROCS - 1), ok=st.booleans())
        def lease_lapses_and_the_paused_owner_finishes(self, pick: int, i: int, ok: bool) -> None:
            held = self.held()
            if held:
                self.lapse_then_finish(held[pick % len(held)], i, ok)

        def lapse_then_finish(self, run_: Run, i: int, ok: bool) -> None:
            """Its lease lapsed and cache ``i``'s caller claimed before the held loader
            returns: the stale owner's write must be fenced."""
            run(client.pexpire(self.fk.meta, 1))
            settle(lambda: False, 0.005)
            self.call(i)
            run_.ok = ok
            run_.release.set()
            settle(lambda: run_.state != "running", 0.5)
            settle(lambda: False, 0.02)

        @rule(pick=PICK)
        def caller_cancelled(self, pick: int) -> None:
            pending = self.pending()
            if not pending:
                return
            _i, task = pending[pick % len(pending)]
            task.cancel()
            settle(lambda: task.done(), 0.5)

        @rule(i=st.integers(0, PROCS - 1))
        def get(self, i: int) -> None:
            value = run(caches[i].get(self.key))
            self.returned(value, f"get on cache {i}")

        @rule(i=st.integers(0, PROCS - 1), new=st.booleans())
        def invalidate_or_set(self, i: int, new: bool) -> None:
            # everything made before it began is replaced (a running flight's result is
            # delivered to its callers, not stored); what is made meanwhile is not judged
            before = self.produced | {r.value for r in self.runs}
            if new:
                self.sets += 1
                value = f"{self.key}:set{self.sets}"
                self.produced.add(value)
                run(caches[i].set(self.key, value))
            else:
                run(caches[i].invalidate(self.key))
            self.dead |= before
            if new:
                self.dead.discard(value)

        @rule(ms=st.sampled_from([50, 300, 700]))
        def time_passes(self, ms: int) -> None:
            """Renewals, a follower's lease re-check, a lapsed owner noticing."""
            settle(lambda: False, ms / 1000)

        # -- checks ----------------------------------------------------------------------

        def returned(self, value: Any, what: str) -> None:
            if value is MISSING:
                return
            assert value in self.produced, f"{what} returned {value!r}, which no loader made"
            assert value not in self.dead, f"{what} returned {value!r}, replaced already"

        @invariant()
        def every_call_returned_a_value_some_loader_produced(self) -> None:
            for i, task in self.calls:
                if not task.done() or id(task) in self.checked:
                    continue
                self.checked.add(id(task))
                if task.cancelled():
                    continue
                exc = task.exception()
                if exc is None:
                    value = task.result()
                    assert value in self.produced, f"cache {i} returned {value!r}"
                elif isinstance(exc, LoaderFailed):
                    assert any(r.value == str(exc) and r.state == "failed" for r in self.runs)
                elif isinstance(exc, RemoteError):
                    assert exc.type_name == "LoaderFailed", exc
                else:
                    raise AssertionError(f"cache {i}'s call raised {exc!r}")

        @invariant()
        def one_stored_result_per_flight_by_its_current_token(self) -> None:
            entries = run(client.xrange(self.fk.stream))
            by_claim = {r.claim: r for r in self.runs if r.claim}
            claim = b""
            stored_in: set[bytes] = set()
            for entry_id, fields in entries:
                kind = fields.get(b"t")
                if kind == b"claimed":
                    claim = entry_id
                    continue
                if kind != b"done" or b"x" not in fields:
                    continue
                assert claim not in stored_in, f"flight {claim!r} stored twice"
                stored_in.add(claim)
                owner = by_claim.get(claim)
                assert owner is not None, f"a result stored in flight {claim!r}, no loader ran"
                assert int(fields[b"tok"]) == owner.token, (
                    f"flight {claim!r} stored under token {fields[b'tok']!r}, not its owner's "
                    f"{owner.token}"
                )
                if b"v" in fields:
                    value = caches[0].envelope.decode(fields[b"v"], key=self.fk.digest)
                    assert value == owner.value, (value, owner.value)

        @invariant()
        def nothing_serves_a_replaced_value(self) -> None:
            data = run(client.get(self.fk.result))
            if data is not None and not caches[0].envelope.is_error(data):  # an error record
                value = caches[0].envelope.decode(data, key=self.fk.digest)
                assert value in self.produced and value not in self.dead, value
            for i, fc in enumerate(caches):
                near = fc._near
                copy = near.get(self.fk.digest) if near is not None else None
                if copy is not None:
                    value = fc.envelope.decode(copy, key=self.fk.digest)
                    assert value not in self.dead, f"cache {i}'s near cache serves {value!r}"

        def teardown(self) -> None:
            """Release every loader; every call returns (a generous bound: leases of 0.5 s)."""
            self.draining = True
            for run_ in self.runs:
                run_.release.set()
            settle(lambda: not self.pending(), 20.0)
            stuck = self.pending()
            for _i, task in stuck:
                task.cancel()
            settle(lambda: not self.pending(), 2.0)
            assert not stuck, f"{len(stuck)} calls did not return within 20 s"
            self.every_call_returned_a_value_some_loader_produced()

    return Caches


@pytest.mark.timeout(180)
def test_flightcaches_keep_the_invariants_under_chosen_interleavings(
    server: EmbeddedServer,
) -> None:
    h = Harness(server.url)
    Caches = machine(h)
    Caches.TestCase.settings = settings(
        max_examples=int(os.environ.get("FLIGHTCACHE_STATEFUL_CACHE_EXAMPLES", "12")),
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    try:
        Caches.TestCase().runTest()
    finally:
        h.close()


def test_the_checks_catch_a_stale_owners_store_when_the_fence_is_cut(
    server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The machine's checks can fail: with the token check cut out of complete_flight, an
    owner paused past its lease (its loader held, its lease lapsed, another caller's claim
    made) stores its result under its old token, and the check says so."""
    script = LUA["complete_flight"]
    fence = "if not owns(KEYS[2], ARGV[1], ARGV[11] or '') then\n  return 0\nend"
    assert fence in script.text
    cut = script.text.replace(fence, "")
    monkeypatch.setattr(script, "text", cut)
    monkeypatch.setattr(script, "sha", hashlib.sha1(cut.encode()).hexdigest().encode())
    h = Harness(server.url)
    try:
        state = machine(h)()
        state.call(0)
        (stale,) = state.held()
        state.lapse_then_finish(stale, 1, ok=True)
        with pytest.raises(AssertionError, match="stored under token"):
            state.one_stored_result_per_flight_by_its_current_token()
        state.teardown()
    finally:
        h.close()


async def test_a_caller_whose_wait_bound_passes_as_it_claims_gives_the_claim_back(
    make_cache: Callable[..., FlightCache], redis_client: aioredis.Redis
) -> None:
    owner, follower = make_cache(), make_cache(timeout=1.0)  # its wait bound: 9 s
    fk = owner.keyspace.flight("k")
    started, hold = asyncio.Event(), asyncio.Event()
    ran: list[str] = []

    async def held() -> str:
        started.set()
        await hold.wait()
        return "never"

    async def load() -> str:
        ran.append("follower")
        return "v"

    owning = asyncio.ensure_future(owner.do("k", held))
    await asyncio.wait_for(started.wait(), 5)
    following = asyncio.ensure_future(follower.do("k", load))
    while follower.stats["follows"] == 0:  # noqa: ASYNC110 (it follows the held flight)
        await asyncio.sleep(0.01)
    flights: Any = follower._flights
    skew = [0.0]
    flights.clock = lambda: time.monotonic() + skew[0]
    skew[0] = 100.0  # its wait bound has passed, by the clock it reads; it waits on
    await owner.aclose()  # the owner gives the flight back: the follower, first in line, claims
    with pytest.raises(FlightTimeout):
        await asyncio.wait_for(following, 10)
    with pytest.raises(BaseException):  # noqa: B017 (cancelled or closed: either)
        await owning
    assert ran == []
    await asyncio.sleep(0.2)
    meta = await redis_client.hgetall(fk.meta)
    assert not meta, f"the flight is still claimed after the caller gave up: {meta}"
