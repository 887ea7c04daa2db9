"""The client's steps: each process runs its operations (``do``, ``get``, ``invalidate``,
``set``) one at a time, as the state machines of ``_protocol/flight.py``, ``owner.py``,
``follower.py``, ``heartbeat.py`` and ``_leases/near.py``, ``nodes.py`` take them.

A step is one server script (atomic) with the client work around it, or one purely local
step (a listener hearing an invalidation, a timer firing). ``steps(m, world, pid)`` yields
``(label, fairness class, next world, violations)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from . import scripts
from .state import ERROR, MISSING, SET_BASE, Entry, Proc, World

if TYPE_CHECKING:
    from .model import Model

Step = tuple[str, tuple, World, tuple[str, ...]]


def _put(world: World, pid: int, proc: Proc, server=None, ghost=None, wake=()) -> World:
    procs = list(world.procs)
    procs[pid] = proc
    for to, message in wake:  # a wake message reaches a node whose listener is subscribed
        q = procs[to]
        if q.alive and q.sub:
            procs[to] = q._replace(mail=(*q.mail, message))
    new_server = world.server if server is None else server
    undo = world.undo
    if world.budget.failover and new_server != world.server:
        undo = (world.server,)  # the replica still has the state before this write
    return world._replace(
        procs=tuple(procs),
        server=new_server,
        ghost=world.ghost if ghost is None else ghost,
        undo=undo,
    )


def _done(m: Model, world: World, pid: int, proc: Proc, value: int, why: list[str]) -> Proc:
    """The operation returns ``value``; the call's state is cleared."""
    if value not in (MISSING, ERROR) and value not in world.ghost.produced:
        why.append(f"returns_produced_value: p{pid} returned v{value}, which no owner made")
    return Proc(
        op=proc.op + 1,
        alive=proc.alive,
        paused=proc.paused,
        near=proc.near,
        live=proc.live,
        beat=proc.beat,
        sub=proc.sub,
        inbox=proc.inbox,
        acks=proc.acks,
        drift=proc.drift,
    )


def _sent(m: Model, proc: Proc) -> int:
    """A leasable request is sent: the lease it may grant, in ticks from now, bounded by
    the node's liveness as of now (``Leaser.heard()``, taken at the send). With known issue
    ``late-liveness``, the code before 28bd9ef: liveness read when the reply arrives."""
    if "late-liveness" in m.known:
        return m.t.near_lease
    return min(m.t.near_lease, proc.live)


def _lease(m: Model, proc: Proc, value: int, ticks: int) -> Proc:
    """near.py Leaser.grant: min(sent + lease, live_until) - skew_margin, unless an
    invalidation was heard since the call began."""
    if proc.heard or value in (MISSING, ERROR):
        return proc
    end = min(ticks, proc.live) - (0 if m.mutant == "no-skew" else m.t.skew)
    return proc._replace(near=(value, end)) if end > 0 else proc


def _serve_near(m: Model, world: World, pid: int, proc: Proc, why: list[str]) -> int:
    """A near-cache hit: the copy is served while its lease holds."""
    value = proc.near[0]
    g = world.ghost
    if not g.server_fault and (value in g.dead or 0 < value < g.dead_below):
        why.append(
            f"no_stale_near_copy: p{pid} served v{value} after an invalidation that "
            "replaced it returned"
        )
    return value


# -- a do() call ---------------------------------------------------------------------------


def _on_join(m: Model, world: World, pid: int, proc: Proc, reply: tuple, why: list[str]):
    """What the flight task does with a join's answer (flight.py ``_resolve``). Returns the
    new proc and the ghost (a claim may be checked)."""
    kind = reply[0]
    t = m.t
    if kind == "hit":
        _, value, marked = reply
        if m.scope.near:
            return proc._replace(pc="rhit", reply=(value, _sent(m, proc), not marked)), None
        return _done(m, world, pid, proc, value, why), None
    if kind == "follow":
        _, _token, lease_left, _rank, from_id = reply
        return proc._replace(
            pc="follow",
            cursor=from_id,
            gen=from_id,  # job.on_follow
            timer=lease_left + t.margin,
            wait=_sent(m, proc) if m.scope.near else 0,
        ), None
    if kind == "claimed":
        _, entry, token = reply
        if proc.gen:
            for e in world.server.stream:
                if e.t in ("done", "error") and e.tok >= proc.gen:
                    why.append(
                        f"one_run_per_flight: p{pid} claimed a new flight while the end "
                        f"of its flight (entry {e.id}, {e.t}) is on the stream"
                    )
                    break
        proc = proc._replace(since=entry, claim=entry, gen=entry, token=token, cursor=0)
        if token:
            return proc._replace(pc="run", timer=t.renew, wait=0), None
        return proc._replace(pc="incr", timer=0, wait=0), None
    if kind == "vacant":
        return proc._replace(pc="sleep", timer=0, wait=0), None
    assert kind == "ended"
    _, end, value, _crossed = reply
    return _done(m, world, pid, proc, value if end == "done" else ERROR, why), None


def _claims(m: Model, world: World, reply: tuple):
    """The ghost after a join: a claim is counted; None when it passes the scope's bound
    (the path is not explored further)."""
    if reply[0] != "claimed":
        return world.ghost
    if world.ghost.claims >= m.scope.flights:
        return None
    return world.ghost._replace(claims=world.ghost.claims + 1)


def _join(m: Model, world: World, pid: int, proc: Proc, mode: str, since: int, label: str):
    why: list[str] = []
    server, reply, wake = scripts.join_flight(
        world.server, pid, mode, since, m.t.lease, m.scope.token_in_join, m.mutant
    )
    ghost = _claims(m, world, reply)
    if ghost is None:
        return None
    proc = proc._replace(since=since)
    proc, _ = _on_join(m, world, pid, proc, reply, why)
    return (f"{label} -> {_show(reply)}", _put(world, pid, proc, server, ghost, wake), why)


def _show(reply: tuple) -> str:
    kind = reply[0]
    if kind == "hit":
        return f"hit v{reply[1]}" + (" (marked)" if reply[2] else "")
    if kind == "follow":
        return f"follow token {reply[1]} from {reply[4]}, lease {reply[2]}, rank {reply[3]}"
    if kind == "claimed":
        return f"claimed entry {reply[1]}" + (f", token {reply[2]}" if reply[2] else "")
    if kind == "vacant":
        return f"vacant, rank {reply[1]}"
    return f"ended: {reply[1]} v{reply[2]}"


def _news(m: Model, world: World, proc: Proc) -> list[Entry]:
    """follower.py ``_news``: entries after the cursor, from the messages or, when one is
    out of step (or a gap was flagged), from a read of the stream."""

    def read_after(at: int) -> list[Entry]:
        return [e for e in world.server.stream if e.id > at]

    if proc.gap:
        return read_after(proc.cursor)
    at = proc.cursor
    news: list[Entry] = []
    for prev, entries in proc.mail:
        if entries and entries[-1].id <= at:
            continue
        if not entries or prev > at:
            if "news-drop" in m.known:  # the code before ecab0e6: earlier messages dropped
                return read_after(at)
            return news + read_after(at)
        news += [e for e in entries if e.id > at]
        at = entries[-1].id
    return news


def _wake(m: Model, world: World, pid: int, proc: Proc) -> tuple[str, World, list[str]]:
    why: list[str] = []
    news = _news(m, world, proc)
    proc = proc._replace(mail=(), gap=False)
    wait = _sent(m, proc) if m.scope.near else 0
    for e in news:
        if e.t != "claimed" and e.tok != proc.gen:
            why.append(
                f"follower_reads_own_flight: p{pid} applied {e.t} entry {e.id} of flight "
                f"{e.tok} while it holds flight {proc.gen}"
            )
        proc = proc._replace(cursor=e.id)
        if e.t == "claimed":  # job.on_claimed: a new generation
            proc = proc._replace(gen=e.id)
            continue
        if e.t == "done":
            if e.stored and m.scope.near:
                proc = _lease(m, proc, e.v, proc.wait)
            proc = _done(m, world, pid, proc, e.v, why)
            return f"p{pid} wake: {_entries(news)} -> returns v{e.v}", _put(world, pid, proc), why
        if e.t == "error":
            proc = _done(m, world, pid, proc, ERROR, why)
            return f"p{pid} wake: {_entries(news)} -> returns error", _put(world, pid, proc), why
        if e.t == "reset":  # join in mode first with the reset entry as position
            proc = proc._replace(pc="join", mode="first", since=e.id, timer=0, wait=0)
            return f"p{pid} wake: {_entries(news)} -> join first", _put(world, pid, proc), why
    if news:
        proc = proc._replace(timer=m.t.lease + m.t.margin, wait=wait)
    else:
        proc = proc._replace(wait=wait)
    return f"p{pid} wake: {_entries(news) or 'nothing new'}", _put(world, pid, proc), why


def _entries(entries: list[Entry]) -> str:
    return ", ".join(f"{e.t}@{e.id}" for e in entries)


def do_steps(m: Model, world: World, pid: int, proc: Proc) -> Iterator[Step]:
    pc = proc.pc
    t = m.t
    if pc in ("join", "sleep"):  # sleep: after rank x 30 ms, join in mode always
        mode = proc.mode if pc == "join" else "always"
        label = f"p{pid} join {mode}" if pc == "join" else f"p{pid} rejoin"
        joined = _join(m, world, pid, proc, mode, proc.since, label)
        if joined:
            yield joined[0], (pid, "join"), joined[1], tuple(joined[2])
    elif pc == "follow":
        if proc.mail or proc.gap:
            label, w, why = _wake(m, world, pid, proc)
            yield label, (pid, "wake"), w, tuple(why)
        if proc.timer == 0 and m.mutant != "no-recheck":  # the wait ran out: re-check
            why: list[str] = []
            server, reply, wake = scripts.join_flight(
                world.server, pid, "first", proc.cursor, t.lease, m.scope.token_in_join, m.mutant
            )
            ghost = _claims(m, world, reply)
            if ghost is None:
                return
            if reply[0] == "follow":
                _, _tok, lease_left, _rank, from_id = reply
                nxt = proc._replace(
                    gen=from_id,
                    cursor=max(proc.cursor, from_id),
                    timer=lease_left + t.margin,
                    wait=_sent(m, proc) if m.scope.near else 0,
                )
            else:
                nxt, _ = _on_join(m, world, pid, proc._replace(since=proc.cursor), reply, why)
            w = _put(world, pid, nxt, server, ghost, wake)
            yield f"p{pid} re-check -> {_show(reply)}", (pid, "recheck"), w, tuple(why)
    elif pc == "incr":  # INCR owner-seq: the token; the loader starts at once
        nxt = proc._replace(pc="run", token=proc.claim, timer=t.renew, confirming=True)
        w = _put(world, pid, nxt)
        yield f"p{pid} INCR owner-seq: token {proc.claim}, loader starts", (pid, "incr"), w, ()
    elif pc == "run":
        yield from _run_steps(m, world, pid, proc)
    if proc.confirming:  # confirm_claim, sent beside the loader; its answer is not awaited
        server, ok = scripts.confirm_claim(world.server, proc.claim, t.lease)
        w = _put(world, pid, proc._replace(confirming=False), server)
        yield f"p{pid} confirm_claim -> {ok:d}", (pid, "confirm"), w, ()
    elif pc == "write":
        yield _write(m, world, pid, proc)
    elif pc in ("rhit", "rdone", "rget"):  # a leasable reply arrives
        value, ticks, leasable = proc.reply
        nxt = _lease(m, proc, value, ticks) if leasable else proc
        why = []
        nxt = _done(m, world, pid, nxt, value, why)
        leased = "leased" if nxt.near and nxt.near[0] == value and leasable else "not leased"
        yield f"p{pid} reply v{value} ({leased})", (pid, "reply"), _put(world, pid, nxt), tuple(why)


def _run_steps(m: Model, world: World, pid: int, proc: Proc) -> Iterator[Step]:
    for outcome in m.scope.outcomes:
        why = []
        if proc.refused:
            why.append(f"stale_owner_stops: p{pid}'s loader ran on after its renewal was refused")
        g = world.ghost
        if outcome == "ok":
            g = g._replace(produced=g.produced | {proc.claim})
            value = proc.claim
        else:
            value = ERROR
        if proc.refused:  # heartbeat.lost: the result is dropped, the flight joined again
            nxt = proc._replace(pc="join", mode="always", since=proc.claim, timer=0, refused=False)
        else:
            nxt = proc._replace(pc="write", outcome=value, timer=0)
        shown = f"v{value}" if outcome == "ok" else "an error"
        w = _put(world, pid, nxt, ghost=g)
        yield f"p{pid} loader returns {shown}", (pid, "loader"), w, tuple(why)
    if proc.timer == 0 and not proc.refused:
        server, ok = scripts.renew_leases(world.server, proc.token, _claim(m, proc), m.t.lease)
        if ok:
            nxt = proc._replace(timer=m.t.renew)
        elif m.mutant == "no-cancel":
            nxt = proc._replace(refused=True, timer=0)
        else:  # give_up: the loader is cancelled, Lost: join again from the claim entry
            nxt = proc._replace(pc="join", mode="always", since=proc.claim, timer=0)
        w = _put(world, pid, nxt, server)
        yield f"p{pid} renew -> {'ok' if ok else 'refused'}", (pid, "renew"), w, ()


def _claim(m: Model, proc: Proc) -> int:
    """The claim id an owner's fenced writes carry: only where the join took no token."""
    return 0 if m.scope.token_in_join else proc.claim


def _write(m: Model, world: World, pid: int, proc: Proc) -> Step:
    why: list[str] = []
    g = world.ghost
    server0 = world.server
    if proc.outcome == ERROR:
        server, code, wake = scripts.fail_flight(server0, proc.token, _claim(m, proc), "error")
        if code:
            nxt = _done(m, world, pid, proc, ERROR, why)
        else:
            nxt = proc._replace(pc="join", mode="always", since=proc.claim)
        w = _put(world, pid, nxt, server, wake=wake)
        return f"p{pid} fail_flight -> {'published' if code else 'fenced'}", (pid, "write"), w, ()
    value = proc.outcome
    server, code, wake = scripts.complete_flight(
        server0, proc.token, _claim(m, proc), value, m.mutant
    )
    if code == 1:
        _, holds = scripts.owns(server0, proc.token, _claim(m, proc))
        if not holds:
            why.append(
                f"no_store_after_takeover: p{pid} stored v{value} under token {proc.token}, "
                "which no longer holds the flight"
            )
        if proc.claim in g.stored_gens:
            why.append(f"one_store_per_flight: flight {proc.claim} stored a second result")
        if not g.server_fault and proc.claim < g.replaced_below:
            why.append(
                f"no_stale_store: flight {proc.claim}, running when an invalidation began, "
                "stored its result"
            )
        g = g._replace(
            stored_gens=g.stored_gens | {proc.claim}, ever_stored=g.ever_stored | {value}
        )
    if code == 0:  # fenced: Lost, join again and follow the new owner
        nxt = proc._replace(pc="join", mode="always", since=proc.claim, outcome=0)
    elif code == 1 and m.scope.near:  # leased from when complete_flight was sent
        nxt = proc._replace(pc="rdone", reply=(value, _sent(m, proc), True), outcome=0)
    else:
        nxt = _done(m, world, pid, proc, value, why)
    shown = {0: "fenced", 1: "stored", 2: "delivered, not stored"}[code]
    w = _put(world, pid, nxt, server, g, wake)
    return f"p{pid} complete_flight v{value} -> {shown}", (pid, "write"), w, tuple(why)


# -- starting an operation -----------------------------------------------------------------


def start(m: Model, world: World, pid: int, proc: Proc) -> Iterator[Step]:
    op = m.scope.ops[pid][proc.op]
    why: list[str] = []
    if op in ("do", "get") and proc.near:  # a near-cache hit: no round trip
        value = _serve_near(m, world, pid, proc, why)
        nxt = _done(m, world, pid, proc, value, why)
        yield f"p{pid} {op}: near cache v{value}", (pid, "start"), _put(world, pid, nxt), tuple(why)
        return
    fresh = proc._replace(heard=False, mail=(), gap=not proc.sub, gen=0, since=0, cursor=0)
    if op == "do":  # the call's first read is the join itself
        joined = _join(m, world, pid, fresh, "always", 0, f"p{pid} do: join always")
        if joined:
            yield joined[0], (pid, "start"), joined[1], tuple(joined[2])
    elif op == "get":
        value, marked = scripts.read_result(world.server)
        if m.scope.near:
            nxt = fresh._replace(pc="rget", reply=(value, _sent(m, proc), not marked))
        else:
            nxt = _done(m, world, pid, fresh, value, why)
        yield f"p{pid} get: read_result v{value}", (pid, "start"), _put(world, pid, nxt), tuple(why)
    else:
        yield _replace(m, world, pid, fresh, op)


def _replace(m: Model, world: World, pid: int, proc: Proc, op: str) -> Step:
    """nodes.py ``replace``: drop the own copy, replace_result, then (unless absent) find
    the holders, publish, and wait for acknowledgements or the deadline."""
    g = world.ghost
    value = MISSING
    if op == "set":
        value = SET_BASE + g.sets + 1
        g = g._replace(sets=g.sets + 1, produced=g.produced | {value})
    inval = (pid + 1) * 100 + proc.op + 1
    wait = m.t.near_lease + m.t.skew  # the longest lease, plus the skew margin
    server0 = world.server
    server, existed = scripts.replace_result(server0, inval, value, wait, m.mutant)
    superseded = tuple(sorted(g.ever_stored))
    below = server0.next_id  # flights claimed before this point computed from old inputs
    g = g._replace(replaced_below=max(g.replaced_below, below))
    if value != MISSING:
        g = g._replace(ever_stored=g.ever_stored | {value})
    proc = proc._replace(near=(), heard=True)
    if value == MISSING and not existed:  # absent: nothing to wait for
        g = _returned(g, superseded, below)
        nxt = _done(m, world, pid, proc, MISSING, [])
        w = _put(world, pid, nxt, server, g)
        return f"p{pid} {op}: replace_result -> absent, returns", (pid, "start"), w, ()
    nxt = proc._replace(pc="list", timer=wait, inv=(inval, (), True, superseded, below))
    w = _put(world, pid, nxt, server, g)
    shown = f"v{value}" if value else "delete"
    return f"p{pid} {op}: replace_result {shown} (id {inval})", (pid, "start"), w, ()


def _returned(g, superseded: tuple[int, ...], below: int):
    return g._replace(dead=g.dead.union(superseded), dead_below=max(g.dead_below, below))


def inval_steps(m: Model, world: World, pid: int, proc: Proc) -> Iterator[Step]:
    inval, holders, trusted, superseded, below = proc.inv
    if proc.pc == "list":  # live_nodes, read after the delete
        live = scripts.live_nodes(world.server)
        holders = tuple(sorted(q for q in live if q != pid))
        trusted = pid in live or proc.live == 0
        nxt = proc._replace(pc="publish", inv=(inval, holders, trusted, superseded, below))
        shown = ",".join(f"p{q}" for q in sorted(holders)) or "none"
        w = _put(world, pid, nxt)
        yield f"p{pid} live_nodes: holders {shown}", (pid, "inval"), w, ()
    elif proc.pc == "publish":
        procs = list(world.procs)
        for q, other in enumerate(procs):
            if other.alive and other.sub:
                procs[q] = other._replace(inbox=(*other.inbox, (inval, pid)))
        nxt = procs[pid]._replace(pc="await")
        procs[pid] = nxt
        w = world._replace(procs=tuple(procs))
        yield f"p{pid} publish invalidation {inval}", (pid, "inval"), w, ()
    elif proc.pc == "await":
        acked = {q for (i, q) in world.server.acks if i == inval}
        all_acked = set(holders) <= acked
        if (all_acked and trusted) or proc.timer == 0:
            server = world.server
            how = "lease"
            if all_acked and trusted:
                server, how = scripts.end_replace(server, inval), "acked"
            g = _returned(world.ghost, superseded, below)
            nxt = _done(m, world, pid, proc._replace(inv=()), MISSING, [])
            w = _put(world, pid, nxt, server, g)
            yield f"p{pid} invalidation {inval} returns ({how})", (pid, "inval"), w, ()
