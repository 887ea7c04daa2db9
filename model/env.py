"""The environment: time, each node's own background steps, and faults.

Time advances one tick at a time for everybody; a server key whose TTL reaches 0 is gone
at that tick, and a local deadline at 0 has passed. A paused process's clock keeps counting
(Linux CLOCK_MONOTONIC under SIGSTOP), so its timers run down too. A process's clock may be
off real time by at most ``scope.drift`` ticks over the run (``drift`` steps): its local
timers then end one tick later or earlier. Faults are bounded by the scope's budget.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from .state import MISSING, Proc, Server, World

if TYPE_CHECKING:
    from .model import Model
    from .procs import Step

LOCAL_TIMER_PHASES = ("run", "follow", "list", "publish", "await")


def _tick_server(
    server: Server, liveness: bool = True, backstop: bool = True, linger: int = 0
) -> Server:
    if server.fresh:  # the newest end's linger runs down (written in the tick just past: -1)
        fresh = max(0, (linger if server.fresh < 0 else server.fresh) - 1)
        server = server._replace(fresh=fresh)
    meta = server.meta
    if meta and (backstop or not meta[0].se):  # no backstop: a bound meta never lapses
        left = meta[0].ttl - 1
        meta = (meta[0]._replace(ttl=left),) if left > 0 else ()  # the lease lapses
    marker = server.marker
    if marker:
        marker = (marker[0], marker[1] - 1) if marker[1] > 1 else ()
    nodes = tuple(max(0, n - 1) for n in server.nodes) if liveness else server.nodes
    if not server.sessions:
        return server._replace(meta=meta, marker=marker, nodes=nodes)
    # a session key lapses like meta: at 0 it is gone (its epoch with it)
    sessions = tuple((e, left - 1) if left > 1 else (0, 0) for e, left in server.sessions)
    return server._replace(meta=meta, marker=marker, nodes=nodes, sessions=sessions)


def _shift(proc: Proc, d: int, liveness: bool = True) -> Proc:
    """Every running local timer of ``proc`` moves by ``d`` ticks (floored at 0)."""
    changes = {}
    if proc.pc in LOCAL_TIMER_PHASES:
        changes["timer"] = max(0, proc.timer + d)
    if proc.near:
        left = proc.near[1] + d
        changes["near"] = (proc.near[0], left) if left > 0 else ()
    if proc.reply:
        changes["reply"] = (proc.reply[0], max(0, proc.reply[1] + d), proc.reply[2])
    if proc.pc == "follow" and proc.wait:
        changes["wait"] = max(0, proc.wait + d)
    if proc.ftimer:  # a bound follower's flight timer (only ever set while it follows)
        changes["ftimer"] = max(0, proc.ftimer + d)
    if proc.live and liveness:
        changes["live"] = max(0, proc.live + d)
    if proc.beat:
        changes["beat"] = max(0, proc.beat + d)
    if proc.due > 0:
        changes["due"] = max(0, proc.due + d)
    if proc.ltimer > 0:
        changes["ltimer"] = max(0, proc.ltimer + d)
    if proc.sproof:
        changes["sproof"] = max(0, proc.sproof + d)
    if proc.sbeat:
        changes["sbeat"] = max(0, proc.sbeat + d)
    return proc._replace(**changes) if changes else proc


def _drift(proc: Proc, d: int) -> Proc:
    """The process's clock is off by ``d`` ticks over the interval it measures now: its
    near-cache lease, or its invalidation's wait (what the skew margins cover)."""
    changes = {}
    if proc.pc in ("list", "publish", "await"):
        changes["timer"] = max(0, proc.timer + d)
    if proc.near:
        left = proc.near[1] + d
        changes["near"] = (proc.near[0], left) if left > 0 else ()
    return proc._replace(**changes)


def tick(m: Model, world: World) -> World:
    procs = tuple(_shift(p, -1, m.scope.liveness) if p.alive else p for p in world.procs)
    live, backstop = m.scope.liveness, m.scope.backstop
    linger = m.t.linger
    undo = tuple(_tick_server(s, live, backstop, linger) for s in world.undo)
    world = world._replace(
        server=_tick_server(world.server, live, backstop, linger), procs=procs, undo=undo
    )
    return _renew_sessions(m, world) if m.scope.sessions else world


def _renew_sessions(m: Model, world: World) -> World:
    """The sessions' renewals due at this tick, of running nodes whose key still holds
    their epoch, go first in the tick (renewals run on a thread of their own): the same
    renew_session as ``procs.session_steps``, which takes every other renewal (a node that
    resumes, one whose key is gone) as a step of its own. So the renewals of healthy
    sessions do not interleave with the tick's other steps (a follower that joins or peeks
    in the tick reads the session's full lease, one tick more than just before it)."""
    t = m.t
    procs = list(world.procs)
    servers = [world.server, *world.undo]
    for pid, p in enumerate(procs):
        key = world.server.sessions[pid]
        if p.alive and not p.paused and p.est and p.sbeat == 0 and p.sproof and key[1]:
            if key[0] != p.epoch:
                continue
            procs[pid] = p._replace(sproof=t.lease, sbeat=t.renew)
            for i, s in enumerate(servers):  # the replica has every renewal
                if s.sessions[pid][0] == p.epoch:
                    sessions = list(s.sessions)
                    sessions[pid] = (p.epoch, t.lease)
                    servers[i] = s._replace(sessions=tuple(sessions))
    return world._replace(procs=tuple(procs), server=servers[0], undo=tuple(servers[1:]))


def _lost_listener(proc: Proc) -> Proc:
    """The listener lost its connection: what was in transit is gone; the waiter re-reads
    its stream, the near cache is cleared, reads under way are not leased."""
    busy = proc.pc != "idle"
    return proc._replace(sub=False, mail=(), inbox=(), gap=busy, near=(), heard=busy)


def node_steps(m: Model, world: World, pid: int, proc: Proc) -> Iterator[Step]:
    """The node's background tasks: hearing invalidations, liveness renewals, the listener
    reconnecting."""
    if proc.inbox:  # nodes.py _heard: drop the copy, count it, acknowledge (unless ours)
        (inval, sender), rest = proc.inbox[0], proc.inbox[1:]
        nxt = proc._replace(inbox=rest, near=(), heard=proc.pc != "idle")
        server = world.server
        if sender != pid:
            server = server._replace(acks=tuple(sorted({*server.acks, (inval, pid)})))
        procs = list(world.procs)
        procs[pid] = nxt
        w = world._replace(procs=tuple(procs), server=server)
        acks = "acks" if sender != pid else "its own: no ack"
        yield f"p{pid} hears invalidation {inval}, drops its copy, {acks}", (pid, "hear"), w, ()
    if (
        m.scope.near and m.scope.liveness and proc.beat == 0
    ):  # SET node key PX node_ttl (GET; SADD when gone)
        nodes = list(world.server.nodes)
        nodes[pid] = m.t.node_ttl
        nxt = proc._replace(live=m.t.node_ttl, beat=m.t.node_renew)
        procs = list(world.procs)
        procs[pid] = nxt
        server = world.server._replace(nodes=tuple(nodes))
        w = world._replace(procs=tuple(procs), server=server)
        yield f"p{pid} renews its liveness", (pid, "beat"), w, ()
    if not proc.sub:  # reconnect and subscribe again: clear the near cache again
        busy = proc.pc != "idle"
        nxt = proc._replace(sub=True, gap=busy, near=(), heard=busy)
        if m.watch and busy:  # WakeHub.gaps counts it: the call's mark is behind now
            nxt = nxt._replace(gapped=True)
        if proc.watch and m.mutant != "watch-ignores-gap":
            # rechecks.py Rechecks.gap: the follower of a bound flight is woken to join
            # again (mode first, its cursor), as after a peek's -1; it first re-reads its
            # stream (the waiter was flagged lost too, and follower.py reads the news
            # before it joins: pc 'gapjoin'). A meta that vanished without a publish (a
            # restart, a failover), or a waiters list that lost this node (a failover that
            # lost its join), is found only by that join.
            nxt = nxt._replace(pc="gapjoin", watch=(), ftimer=0)
        procs = list(world.procs)
        procs[pid] = nxt
        yield (
            f"p{pid} listener subscribed again",
            (pid, "resub"),
            world._replace(procs=tuple(procs)),
            (),
        )


def faults(m: Model, world: World) -> Iterator[Step]:
    b = world.budget
    scope = m.scope
    for pid, proc in enumerate(world.procs):
        if not proc.alive:
            continue
        if b.crash and _active(m, pid, proc):
            yield _with(
                world,
                pid,
                proc._replace(alive=False, paused=False),
                b._replace(crash=b.crash - 1),
                f"p{pid} crashes",
            )
        if proc.paused:
            yield _with(
                world, pid, proc._replace(paused=False), b, f"p{pid} resumes", fair=(pid, "resume")
            )
        elif b.pause and _active(m, pid, proc):
            yield _with(
                world,
                pid,
                proc._replace(paused=True),
                b._replace(pause=b.pause - 1),
                f"p{pid} pauses",
            )
        if b.lose:  # any one message in transit, not only the first
            spent = b._replace(lose=b.lose - 1)
            for i in range(len(proc.mail)):
                mail = proc.mail[:i] + proc.mail[i + 1 :]
                label = f"a wake message to p{pid} ({_shown(proc.mail[i][1])}) is lost"
                step = _with(world, pid, proc._replace(mail=mail), spent, label)
                ends = any(e.t in ("done", "error", "reset") for e in proc.mail[i][1])
                if ends and m.scope.sessions:  # ghost: follower_notices_within_lease
                    g = step[2].ghost._replace(lost_end=True)
                    step = (step[0], step[1], step[2]._replace(ghost=g), step[3])
                yield step
            for i in range(len(proc.inbox)):
                inbox = proc.inbox[:i] + proc.inbox[i + 1 :]
                label = f"invalidation {proc.inbox[i][0]} to p{pid} is lost"
                yield _with(world, pid, proc._replace(inbox=inbox), spent, label)
        if b.drop and proc.sub:
            yield _with(
                world,
                pid,
                _lost_listener(proc),
                b._replace(drop=b.drop - 1),
                f"p{pid}'s listener loses its connection",
            )
        timed = proc.near or proc.pc in ("list", "publish", "await")
        if scope.drift and proc.drift == 0 and timed:  # once per run, on a lease or a wait
            for d in (scope.drift, -scope.drift):
                nxt = _drift(proc, d)._replace(drift=d)
                how = "slow" if d > 0 else "fast"
                yield _with(world, pid, nxt, b, f"p{pid}'s clock runs {how} by {abs(d)} tick")
        if b.close and proc.pc == "run" and not proc.paused:
            yield _close(m, world, pid, proc)
    if b.restart:
        s = world.server
        sessions = ((0, 0),) * len(s.sessions)  # session keys are gone too
        empty = Server(MISSING, (), (), (), (), (0,) * len(s.nodes), (), s.next_id, sessions)
        yield _server_fault(
            world, empty, b._replace(restart=b.restart - 1), "the server restarts empty"
        )
    if b.failover and world.undo:
        replica = world.undo[0]._replace(next_id=world.server.next_id)
        yield _server_fault(
            world,
            replica,
            b._replace(failover=b.failover - 1),
            "failover to a replica that missed the last write",
        )
    # An ended flight's entries may lapse (a claim's XTRIM, the key's TTL) at any time once
    # the newest end is a linger old (Server.fresh 0; with sessions, m.t.linger ticks after
    # it was written; without, at once): a flight still running keeps its own.
    if scope.linger and world.server.stream and not world.server.fresh:
        s = world.server
        keep = tuple(e for e in s.stream if s.meta and e.id >= s.meta[0].claim)
        if keep != s.stream:
            w = world._replace(server=s._replace(stream=keep))
            yield "the stream's ended flights lapse (linger, XTRIM)", None, w, ()


def _shown(entries: tuple) -> str:
    return ", ".join(f"{e.t}@{e.id}" for e in entries) or "a bare hint"


def _active(m: Model, pid: int, proc: Proc) -> bool:
    """A fault is worth trying only on a process that has something left to do."""
    return proc.pc != "idle" or proc.op < len(m.scope.ops[pid]) or bool(proc.near)


def _with(world: World, pid: int, proc: Proc, budget, label: str, fair=None) -> Step:
    procs = list(world.procs)
    procs[pid] = proc
    return label, fair, world._replace(procs=tuple(procs), budget=budget), ()


def _close(m: Model, world: World, pid: int, proc: Proc) -> Step:
    """The owner's cache is closed: the loader is cancelled and the flight given back
    (fail_flight reset); the process is gone."""
    from . import scripts
    from .procs import _put

    claim = 0 if m.scope.token_in_join else proc.claim
    server, _code, wake = scripts.fail_flight(world.server, proc.token, claim, "reset", m.mutant)
    w = _put(world, pid, proc._replace(alive=False, pc="idle"), server, wake=wake)
    w = w._replace(budget=w.budget._replace(close=w.budget.close - 1))
    return f"p{pid} is closed and gives its flight back (reset)", None, w, ()


def _server_fault(world: World, server: Server, budget, label: str) -> Step:
    procs = tuple(_lost_listener(p) if p.alive else p for p in world.procs)
    ghost = world.ghost._replace(server_fault=True)
    return label, None, World(server, procs, ghost, budget, ()), ()
