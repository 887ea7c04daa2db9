"""The checker: breadth-first over every reachable state, so the first violation found has
a shortest trace; and, for liveness, a search for fair cycles in the full state graph.

Safety invariants are checked on every step (each names the invariant it breaks, see
``INVARIANTS``). Liveness is checked on the graph of every reachable state under weak
fairness: a step that stays enabled is eventually taken (time advances; a live process
takes its steps; a paused process resumes; a loader returns). A fair cycle on which a
process keeps an operation pending is a run in which it never returns.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .model import Model
from .scripts import live
from .state import World

INVARIANTS = {
    "one_store_per_flight": "at most one result is stored per flight (generation)",
    "no_store_after_takeover": (
        "a result is stored only by the holder of the then-current token: no process stores "
        "after its lease was taken over or lapsed"
    ),
    "stale_owner_stops": "a loader whose renewal was refused does no more work",
    "returns_produced_value": "every value a caller returns is one some owner (or set) made",
    "follower_reads_own_flight": (
        "a follower applies only events of the flight it holds (its join's, or a takeover's "
        "it saw claimed)"
    ),
    "one_run_per_flight": (
        "a caller never starts another flight while the end of its own flight (or of a "
        "takeover of it) is on the stream after its position"
    ),
    "no_stale_near_copy": (
        "after invalidate()/set() returns, no near cache serves a value it replaced (without "
        "a server restart or failover)"
    ),
    "no_stale_store": (
        "a flight running when an invalidation began never stores its result (without a "
        "server restart or failover)"
    ),
    "returns_within_wait_bound": (
        "no call is still pending when time passes its bound: a caller waiting for a flight, "
        "its deadline (2 x (timeout + lease) + 1 s from its start); an owner running its "
        "loader, the loader's timeout + the cancel grace (time spent paused not counted)"
    ),
    "stream_chunks_one_attempt": (
        "the chunks a stream's readers in one process are shown all belong to one flight "
        "attempt, in order from 0, and a reader ends with the list of the flight whose end "
        "it took (or is told StreamRestarted)"
    ),
    "nostore_never_stored": "a store=False flight never leaves a stored result",
}

# Checked in the scopes with sessions only (docs/protocol.md, "Sessions"): the model does not track
# an unbound owner's own proof, so elsewhere there is nothing to compare.
SESSION_INVARIANTS = {
    "owner_view_within_servers": (
        "an owner's loader runs on a flight bound to its session, its session's proof holding "
        "(the loader's lease_left > 0), only while meta is live under its token on the server "
        "(without a server restart or failover)"
    ),
    "follower_notices_within_lease": (
        "time passes while a running follower, with no message queued and no re-read "
        "flagged, follows a flight no longer live under its claim on the server, only while "
        "a re-check that would find it (a peek answering -1) is due within lease + margin "
        "(not after a message carrying a flight's end was lost: then up to B; not across a "
        "server restart or failover, unless --notice-across-faults or the scope says so: "
        "sessions-failover-notice-2)"
    ),
}

LIVENESS = {
    "every_call_returns": "under fairness, every operation of a live process returns",
    "dead_owner_taken_over": (
        "under fairness, no caller waits forever on a flight nobody holds (its owner died, "
        "gave it back, or it ended unheard): it is taken over or its end is found"
    ),
}


@dataclass
class Result:
    scope: str
    mutant: str
    states: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    violation: str = ""
    trace: list[str] = field(default_factory=list)
    liveness: dict[str, str] = field(default_factory=dict)
    complete: bool = True  # False when a state limit stopped the search
    tick_s: float = 1.0

    @property
    def ok(self) -> bool:
        return not self.violation and all(v == "holds" for v in self.liveness.values())


def check(
    m: Model, *, max_states: int = 0, liveness: bool = False, progress: bool = False
) -> Result:
    started = time.perf_counter()
    res = Result(m.scope.name, m.mutant, tick_s=m.scope.tick_s)
    init = m.initial()
    root = m.canon(init)
    parent: dict[World, tuple[World, str] | None] = {root: None}
    depth = {root: 0}
    queue = deque([root])
    edges: dict[World, list[tuple[World, tuple | None]]] | None = {} if liveness else None
    bad: tuple[World, str, str] | None = None
    report_at = 200_000
    while queue:
        world = queue.popleft()
        if progress and len(parent) >= report_at:
            report_at += 200_000
            print(f"  ... {len(parent):,} states, depth {res.depth}", flush=True)
        out = [] if edges is not None else None
        for label, fair, nxt, why in m.successors(world):
            res.transitions += 1
            if why:
                bad = (world, label, why[0])
                break
            key = m.canon(nxt)
            if out is not None:
                out.append((key, fair))
            if key not in parent:
                parent[key] = (world, label)
                depth[key] = depth[world] + 1
                res.depth = max(res.depth, depth[key])
                queue.append(key)
                if max_states and len(parent) >= max_states:
                    res.complete = False
                    queue.clear()
                    break
        if bad:
            break
        if edges is not None:
            edges[world] = out
    res.states = len(parent)
    if bad:
        world, _label, why = bad
        concrete = _replay(m, init, parent, world, res.trace)
        name = why.split(":", 1)[0]
        for label, _fair, _nxt, whys in m.successors(concrete):
            if whys and whys[0].startswith(name):  # the same step, with concrete names
                res.trace.append(label)
                res.violation = whys[0]
                break
    elif liveness and res.complete and edges is not None:
        res.liveness, stuck = _liveness(m, edges)
        if stuck is not None:  # the way into a fair cycle on which a call never returns
            _replay(m, init, parent, stuck, res.trace)
            res.trace.append("... and from here a fair cycle on which the call never returns")
    res.seconds = time.perf_counter() - started
    return res


def _replay(m: Model, init: World, parent: dict, last: World, labels: list[str]) -> World:
    """The path to ``last``, its steps' labels appended to ``labels`` as the concrete
    processes took them (the stored path is of canonical states, so it is replayed from
    the initial state); returns the concrete state reached."""
    path = []
    key = last
    while parent[key] is not None:
        path.append(key)
        key = parent[key][0]
    path.reverse()
    world = init
    for target in path:
        for label, _fair, nxt, _why in m.successors(world):
            if m.canon(nxt) == target:
                labels.append(label)
                world = nxt
                break
        else:  # pragma: no cover - the graph was built by the same successors
            raise AssertionError("trace replay lost its way")
    return world


def _liveness(m: Model, edges: dict) -> tuple[dict[str, str], World | None]:
    index = {w: i for i, w in enumerate(edges)}
    worlds = list(edges)
    succ = [[(index[k], f) for k, f in edges[w]] for w in worlds]
    out = {}
    stuck = None
    n_procs = m.scope.processes
    for name in LIVENESS:
        verdict = "holds"
        for pid in range(n_procs):
            if name == "every_call_returns":
                keep = [m.pending(w, pid) for w in worlds]
            else:
                keep = [m.pending(w, pid) and _orphaned(w) for w in worlds]
            cycle = _fair_scc(succ, keep)
            if cycle is not None:
                w = worlds[cycle]
                verdict = f"violated: p{pid} can wait forever (in phase {w.procs[pid].pc})"
                stuck = stuck or w
                break
        out[name] = verdict
    return out, stuck


def _orphaned(world: World) -> bool:
    """Nobody holds the flight: meta is a crashed process's, or gone while followers wait,
    or (with sessions) present but not live while they wait: its session is dead."""
    s = world.server
    if s.meta and live(s, s.meta[0]):
        return not world.procs[s.meta[0].owner].alive
    return any(p.pc in ("follow", "sleep") for p in world.procs if p.alive)


def _fair_scc(succ: list[list[tuple[int, tuple | None]]], keep: list[bool]) -> int | None:
    """A state on a fair cycle among ``keep`` states, or None. An SCC is fair (weak
    fairness) when every fairness class either is taken inside it or is disabled in one
    of its states."""
    n = len(succ)
    index = [-1] * n
    low = [0] * n
    on = [False] * n
    stack: list[int] = []
    counter = 0
    for root in range(n):
        if not keep[root] or index[root] >= 0:
            continue
        work = [(root, 0)]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on[root] = True
        while work:
            v, i = work[-1]
            edges = succ[v]
            if i < len(edges):
                work[-1] = (v, i + 1)
                w = edges[i][0]
                if not keep[w]:
                    continue
                if index[w] < 0:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on[w] = True
                    work.append((w, 0))
                elif on[w]:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                u = work[-1][0]
                low[u] = min(low[u], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on[w] = False
                    comp.append(w)
                    if w == v:
                        break
                if _is_fair(comp, succ):
                    return comp[0]
    return None


def _is_fair(comp: list[int], succ: list[list[tuple[int, tuple | None]]]) -> bool:
    members = set(comp)
    internal = [(v, w, f) for v in comp for w, f in succ[v] if w in members]
    if not internal:
        return False
    taken = {f for _v, _w, f in internal if f is not None}
    classes = {f for v in comp for _w, f in succ[v] if f is not None}
    for cls in classes - taken:
        if all(any(f == cls for _w, f in succ[v]) for v in comp):
            return False  # enabled throughout, never taken: no fair run stays here
    return True
