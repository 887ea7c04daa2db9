"""A scope (how many processes doing what, which faults, how fine the ticks) and the model
built from it: the initial state, every successor of a state, and the canonical form of a
state under the symmetry of interchangeable processes."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from . import env, invals, procs
from .constants import Timing
from .state import INITIAL, MISSING, Budget, Ghost, Proc, Server, World

MUTANTS = {
    "no-token-check": "complete_flight stores without checking the owner's token",
    "no-cancel": "a refused renewal does not cancel the loader",
    "no-skew": "read leases are not shortened by the skew margin",
    "no-marker": "replace_result does not set the invalidation marker",
    "no-since": "join_flight ignores the caller's stream position",
    "no-recheck": "a follower whose wait runs out never re-checks the flight (liveness)",
    "no-deadline-wait": (
        "a follower waits for its lease re-check without bounding the wait by its deadline "
        "(it notices the wait bound only when the re-check is due)"
    ),
    "no-loader-timeout": (
        "an owner's loader is not cancelled at its timeout (wait_bounded): it may run on"
    ),
    "no-restart": (
        "a stream follower that reads a takeover's 'claimed' keeps the chunks it holds "
        "(no new generation, no StreamRestarted)"
    ),
    "no-chunk-fence": "append_chunks appends without checking the owner's token",
    "nostore-stores": "complete_flight stores the result of a store=False flight (TTL 0)",
    "session-renew-creates": (
        "a session's renewal recreates its key when it is missing (a lapsed epoch comes back)"
    ),
    "fence-ignores-session": "owns checks the token only, not that the flight's session holds",
    "bind-ignores-epoch": (
        "bind_leases binds a flight to the epoch sent without checking that its owner's "
        "session key holds it"
    ),
    "bind-not-given-up": (
        "a flight bound by a renewal (bind_leases) is not given up when its session is "
        "refused or lapses: its loader runs on"
    ),
    "no-give-back": (
        "an owner whose lease ran out before its bind's answer came gives the flight up "
        "without giving it back (it stays bound to a session that lives on)"
    ),
    "join-keeps-dead-meta": (
        "join_flight follows a meta whose session is dead, as if it were live (no DEL)"
    ),
    "watch-no-flight-peek": (
        "a follower of a bound flight runs only the session check (peek_sessions), never the "
        "per-flight peek_flight (its flight timer is ignored)"
    ),
    "watch-ignores-gap": (
        "a resubscribe (a gap of the wake channel) leaves a bound follower as it was: no "
        "join again (its stream is re-read, its timers run on)"
    ),
    "watch-binds-across-gap": (
        "a follower binds to its flight's session (watches it) even when its wake channel "
        "had a gap since the join it follows was sent (no join again)"
    ),
    "watch-trusts-stale-epoch": (
        "peek_sessions answers the TTL of the owner's session key whatever epoch it holds"
    ),
}

LAZY = ("start", "loader", "append")  # steps that may wait any number of ticks

KNOWN_ISSUES = {
    "late-liveness": (
        "(fixed in 28bd9ef) near.py Leaser.grant bounded a lease by the node's liveness as of "
        "the reply, not as of the request: a node whose liveness had lapsed, and that an "
        "invalidation's live set therefore left out, renewed before the reply arrived and "
        "leased the old value"
    ),
    "news-drop": (
        "(fixed in ecab0e6) follower.py _news: when a later wake message was out of step, the "
        "entries that "
        "earlier messages of the same batch gave are dropped and the stream is read after "
        "them, so a takeover's 'claimed' entry can be skipped (a stream follower then keeps "
        "the dead owner's chunks)"
    ),
}


@dataclass(frozen=True)
class Scope:
    name: str
    ops: tuple[tuple[str, ...], ...]  # each process's operations, in order
    tick_s: float = 1.0
    near: bool = False  # nodes keep near caches (read leases, liveness, invalidations)
    token_in_join: bool = True  # one server; False: a Cluster (INCR + confirm_claim)
    initial: bool = False  # a value is stored when the run begins
    outcomes: tuple[str, ...] = ("ok", "err")  # what a loader may end with
    budget: Budget = field(default_factory=Budget)
    drift: int = 0  # how many ticks a process's clock may be off, over the run
    linger: bool = True  # a finished flight's stream entries may lapse
    symmetry: bool = True  # processes with the same operations are interchangeable
    flights: int = 3  # at most this many claims in a run (paths past it are not explored)
    liveness: bool = True  # near scopes: nodes renew liveness leases (False: always live,
    # for scopes with no pause or crash, where no node can drop out of the live set)
    timeouts: tuple[float, ...] = ()  # per process, its calls' timeout (s); 0 or absent: the
    # wait bound is not modelled (the default 60 s: no deadline within the run's reach)
    chunks: int = 2  # how many chunks a stream's producer yields at most, per run
    sessions: bool = False  # session leases (docs/protocol.md "Sessions", one server only): each
    # process starts with a session established (a node that has run for a while)
    backstop: bool = True  # sessions: False: a bound meta never lapses by its TTL (B taken
    # as unbounded), so a dead owner's flight can end only by its session's liveness
    notice_across_faults: bool = False  # sessions: follower_notices_within_lease is checked
    # across a server restart or failover too (as --notice-across-faults)
    established: bool = True  # sessions: each node starts with its session established;
    # False: with none yet (a fresh node), so its first claim starts one and is unbound
    doc: str = ""

    def timeout(self, pid: int) -> float:
        return self.timeouts[pid] if pid < len(self.timeouts) else 0

    @property
    def processes(self) -> int:
        return len(self.ops)

    def describe(self) -> str:
        ops = "; ".join(f"p{i}: {', '.join(o)}" for i, o in enumerate(self.ops))
        faults = ", ".join(f"{k} {v}" for k, v in self.budget._asdict().items() if v)
        extra = [f"tick {self.tick_s:g} s", f"at most {self.flights} flights"]
        if self.drift:
            extra.append(f"clock drift {self.drift} tick")
        if not self.token_in_join:
            extra.append("Cluster claims (INCR, confirm_claim beside the loader)")
        if self.initial:
            extra.append("a value stored at the start")
        if any(self.timeouts):
            shown = ", ".join(f"p{i} {t:g} s" for i, t in enumerate(self.timeouts) if t)
            extra.append(f"timeout {shown}")
        if self.sessions:
            if self.established:
                extra.append("sessions (established at the start)")
            else:
                extra.append("sessions (none at the start: a node's first claim starts one)")
            if not self.backstop:
                extra.append("no backstop (a bound meta never lapses)")
            if self.notice_across_faults:
                extra.append("follower_notices_within_lease across a failover or restart")
        if any("stream" in o for o in self.ops):
            extra.append(f"at most {self.chunks} chunk{'s' if self.chunks > 1 else ''} a run")
        return f"{ops} | faults: {faults or 'none'} | {', '.join(extra)}"


class Model:
    def __init__(
        self,
        scope: Scope,
        mutant: str = "",
        known: frozenset[str] = frozenset(),
        peek: bool = True,
        watch: bool = True,
        notice_across_faults: bool = False,
    ):
        if mutant and mutant not in MUTANTS:
            raise ValueError(f"unknown mutant {mutant!r}")
        if scope.sessions and (not scope.token_in_join or scope.near):
            raise ValueError("sessions are modelled on one server, in flight scopes only")
        self.scope = scope
        # A follower's re-check starts with peek_flight (is the claim it follows still the
        # flight's?) and joins only when it is not (0cfd53e); False: the re-check before it,
        # a join_flight in mode first at once.
        self.peek = peek
        # Followers watch sessions (scopes with sessions, with the peek): a follower of a
        # bound flight keeps two timers, the session's (peek_sessions) and the flight's own
        # (peek_flight, up to B); False: one timer, peek_flight answering the session's TTL.
        self.watch = watch and peek and scope.sessions
        # follower_notices_within_lease across a server restart or failover too (off: like
        # the other lease guarantees, it is not claimed across one; see docs/protocol.md)
        self.notice_across_faults = notice_across_faults or scope.notice_across_faults
        self.mutant = mutant
        self.known = known

        self.t = Timing.of(scope.tick_s, leases_for_readers=scope.near)
        groups: dict[tuple, list[int]] = {}
        for pid, ops in enumerate(scope.ops):  # the same operations with the same timeout
            groups.setdefault((ops, scope.timeout(pid)), []).append(pid)
        self.bounds = [
            (self.t.wait_bound(scope.timeout(p)), self.t.loader_bound(scope.timeout(p)))
            if scope.timeout(p)
            else (-1, -1)
            for p in range(scope.processes)
        ]
        self.grace = self.t.loader_bound(0)  # CANCEL_GRACE_S in ticks
        self._groups = [g for g in groups.values() if len(g) > 1] if scope.symmetry else []

    def initial(self) -> World:
        n = self.scope.processes
        t = self.t
        near = self.scope.near
        server = Server(
            result=INITIAL if self.scope.initial else MISSING,
            meta=(),
            stream=(),
            waiters=(),
            marker=(),
            nodes=(t.node_ttl,) * n if near else (),
            acks=(),
            next_id=1,
        )
        proc = Proc()
        if near:
            proc = Proc(live=t.node_ttl, beat=t.node_renew if self.scope.liveness else 0)
        ghost = Ghost(ever_stored=frozenset({INITIAL}) if self.scope.initial else frozenset())
        procs = (proc,) * n
        if self.scope.sessions and not self.scope.established:  # fresh nodes: no session
            server = server._replace(sessions=((0, 0),) * n)
        elif self.scope.sessions:  # each node's session, epoch pid + 1, renewed just now
            server = server._replace(sessions=tuple((p + 1, t.lease) for p in range(n)))
            procs = tuple(
                proc._replace(epoch=p + 1, est=True, sproof=t.lease, sbeat=t.renew)
                for p in range(n)
            )
            ghost = ghost._replace(epochs=n)
        return World(server, procs, ghost, self.scope.budget, ())

    def successors(self, world: World) -> Iterator[procs.Step]:
        """Every step from ``world``. Time is prompt for running processes (maximal
        progress): a tick comes only when no live, running process has a step to take
        other than starting an operation or ending its loader, which take any time. A
        process slower than that is a paused one (a fault). With sessions, every step's
        result is also checked for ``owner_view_within_servers``."""
        if not self.scope.sessions:
            return self._steps(world)
        return (
            (label, fair, nxt, (*why, *procs.owner_views(nxt)))
            for label, fair, nxt, why in self._steps(world)
        )

    def _steps(self, world: World) -> Iterator[procs.Step]:
        urgent = False
        for pid, proc in enumerate(world.procs):
            if not proc.alive or proc.paused:
                continue
            if proc.pc == "idle":
                if proc.op < len(self.scope.ops[pid]):
                    yield from procs.start(self, world, pid, proc)
                steps: Iterator[procs.Step] = iter(())
            elif proc.pc in ("list", "publish", "await"):
                steps = invals.inval_steps(self, world, pid, proc)
            else:
                steps = procs.do_steps(self, world, pid, proc)
            node = env.node_steps(self, world, pid, proc)
            sessions = procs.session_steps(self, world, pid, proc)
            for step in itertools.chain(steps, node, sessions):
                urgent = urgent or step[1][1] not in LAZY
                yield step
        yield from env.faults(self, world)
        if not urgent:
            yield "tick", ("tick",), env.tick(self, world), self._overdue(world)

    def _overdue(self, world: World) -> tuple[str, ...]:
        """returns_within_wait_bound: time passes while a running process's call is past
        its bound (a caller waiting for its flight's events: its deadline; an owner running
        its loader: the loader's timeout + grace).
        The time a process spends paused is not counted (the code's clock counts it, so
        the call ends as soon as it resumes)."""
        why = []
        for pid, p in enumerate(world.procs):
            if not p.alive or p.paused or p.pc == "idle":
                continue
            # A caller that is joining ("join", "sleep") has an urgent step: time passes then
            # only when the scope's bound on flights cut that step off (the path ends).
            if p.due == 0 and p.pc == "follow":
                why.append(
                    f"returns_within_wait_bound: p{pid} still waits ({p.pc}) past its wait "
                    f"bound of {self.bounds[pid][0]} ticks"
                )
            elif p.ltimer == 0 and p.pc == "run":
                why.append(f"returns_within_wait_bound: p{pid}'s loader runs past its timeout")
        g = world.ghost
        if self.scope.sessions and not g.lost_end:
            if self.notice_across_faults or not g.server_fault:
                why.extend(procs.unnoticed(self, world))
        return tuple(why)

    def op(self, pid: int, proc: Proc) -> str:
        """The operation process ``pid`` is running (or about to start)."""
        return self.scope.ops[pid][proc.op]

    def pending(self, world: World, pid: int) -> bool:
        """Process ``pid`` has an operation not yet returned (and is not dead)."""
        proc = world.procs[pid]
        return proc.alive and (proc.pc != "idle" or proc.op < len(self.scope.ops[pid]))

    # -- symmetry ------------------------------------------------------------------------

    def canon(self, world: World) -> World:
        """A canonical member of the state's orbit under renaming interchangeable processes
        (sound: every invariant is symmetric in the processes, and renamed processes run the
        same operations). The candidates are the renamings that sort each group of
        interchangeable processes by a key that renaming does not change; the least of
        those is the representative, the same for every state of the orbit."""
        if not self._groups:
            return world
        procs = world.procs
        keys = [_key(p) for p in procs]
        choices = []
        for group in self._groups:
            ordered = sorted(group, key=keys.__getitem__)
            # runs of equal keys may go in any order
            runs: list[list[int]] = []
            for pid in ordered:
                if runs and keys[runs[-1][0]] == keys[pid]:
                    runs[-1].append(pid)
                else:
                    runs.append([pid])
            options = [
                [x for run in combo for x in run]
                for combo in itertools.product(*(itertools.permutations(r) for r in runs))
            ]
            choices.append([(tuple(group), tuple(o)) for o in options])
        best = None
        n = len(procs)
        for combo in itertools.product(*choices):
            perm = list(range(n))
            for group, order in combo:
                for slot, pid in zip(group, order, strict=True):
                    perm[pid] = slot  # the pid sorted into this slot is renamed to it
            tperm = tuple(perm)
            other = world if tperm == tuple(range(n)) else _rename(world, tperm)
            if best is None or other < best:
                best = other
        assert best is not None
        return best


def _key(proc: Proc) -> tuple:
    """A process's state without the pids it holds: unchanged by renaming."""
    return (
        *proc[:_INBOX],
        len(proc.inbox),
        *proc[_INBOX + 1 : _WATCH],
        proc.watch[1:],
        *proc[_WATCH + 1 : _INV],
        bool(proc.inv),
    )


_INBOX = Proc._fields.index("inbox")
_WATCH = Proc._fields.index("watch")
_INV = Proc._fields.index("inv")
assert _INBOX < _WATCH < _INV
assert _INV == len(Proc._fields) - 1


def _rename_server(s: Server, perm: tuple[int, ...]) -> Server:
    meta = tuple(m._replace(owner=perm[m.owner]) for m in s.meta)
    nodes = s.nodes
    if nodes:
        renamed = [0] * len(nodes)
        for i, left in enumerate(nodes):
            renamed[perm[i]] = left
        nodes = tuple(renamed)
    acks = tuple(sorted((i, perm[q]) for i, q in s.acks))
    sessions = s.sessions
    if sessions:
        moved: list[tuple[int, int]] = [(0, 0)] * len(sessions)
        for i, key in enumerate(sessions):
            moved[perm[i]] = key
        sessions = tuple(moved)
    return s._replace(
        meta=meta,
        waiters=tuple(perm[w] for w in s.waiters),
        nodes=nodes,
        acks=acks,
        sessions=sessions,
    )


def _rename(world: World, perm: tuple[int, ...]) -> World:
    """``world`` with process ``i`` renamed ``perm[i]`` everywhere a pid appears."""
    server = _rename_server(world.server, perm)
    undo = tuple(_rename_server(s, perm) for s in world.undo)
    old = world.procs
    new: list[Proc] = [old[0]] * len(old)
    for i, proc in enumerate(old):
        inbox = tuple((inval, perm[sender]) for inval, sender in proc.inbox)
        inv = proc.inv
        if inv:
            inv = (inv[0], tuple(sorted(perm[q] for q in inv[1])), *inv[2:])
        watch = (perm[proc.watch[0]], proc.watch[1]) if proc.watch else ()
        new[perm[i]] = proc._replace(inbox=inbox, inv=inv, watch=watch)
    # Invalidation ids name their invalidator ((pid + 1) * 100 + op); they are compared for
    # equality only, so they are left as they are: two renamings that differ only there
    # stay apart (the reduction is smaller, never unsound).
    return world._replace(server=server, procs=tuple(new), undo=undo)
