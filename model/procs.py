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

from . import scripts, streams
from .state import ERROR, MISSING, TIMEOUT, Entry, Ghost, Proc, World

if TYPE_CHECKING:
    from .model import Model

DO_OPS = ("do", "stream", "nostore")  # a flight's call: do(), stream(), do(store=False)

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
    if value not in (MISSING, ERROR, TIMEOUT) and value not in world.ghost.produced:
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
        epoch=proc.epoch,
        est=proc.est,
        sproof=proc.sproof,
        sbeat=proc.sbeat,
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
    if proc.heard or value in (MISSING, ERROR, TIMEOUT):
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
    if proc.bound:  # whatever flight it held is over; a claim below sets it again
        proc = proc._replace(bound=False, late=False)
    if kind == "hit":
        _, value, marked = reply
        if m.scope.near:
            return proc._replace(pc="rhit", reply=(value, _sent(m, proc), not marked)), None
        return _done(m, world, pid, proc, value, why), None
    stream = m.op(pid, proc) == "stream"
    if kind == "follow":
        from_id = reply[4]
        if stream:  # job.on_follow; the stream is read at once (waiter.lost())
            proc = streams.new_generation(m, proc, from_id)._replace(gap=True)
        proc = proc._replace(
            pc="follow",
            cursor=from_id,
            gen=from_id,  # job.on_follow
            wait=_sent(m, proc) if m.scope.near else 0,
        )
        return _follow_timers(m, proc, *reply[2:3], *reply[5:]), None
    if kind == "claimed":
        _, entry, token, se = reply
        if proc.gen:
            for e in world.server.stream:
                if e.t in ("done", "error") and e.tok >= proc.gen:
                    why.append(
                        f"one_run_per_flight: p{pid} claimed a new flight while the end "
                        f"of its flight (entry {e.id}, {e.t}) is on the stream"
                    )
                    break
        proc = proc._replace(since=entry, claim=entry, gen=entry, token=token, cursor=0, sent=0)
        if stream:  # this process becomes the owner: a new generation, its own
            proc = streams.new_generation(m, proc, entry)
        if token:
            every = t.backstop_renew if se else t.renew  # a bound flight's own: every B/3
            proc = proc._replace(pc="run", timer=every, wait=0, ltimer=m.bounds[pid][1])
            return proc._replace(bound=bool(se)), None
        return proc._replace(pc="incr", timer=0, wait=0), None
    if kind == "vacant":
        return proc._replace(pc="sleep", timer=0, wait=0), None
    assert kind == "ended"
    _, end, value, crossed, n = reply
    if stream and end == "done":
        if crossed:  # it ended after a takeover: job.on_claimed
            proc = streams.new_generation(m, proc, crossed)
        proc = streams.end(m, pid, proc, value, n, why)
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
    server, reply, wake = scripts.join_flight(world.server, pid, mode, since, *_join_args(m, proc))
    ghost = _claims(m, world, reply)
    if ghost is None:
        return None
    proc = proc._replace(since=since)
    shown = _show(reply)
    if proc.due == 0:  # _resolve's loop checks the deadline before it acts on any answer
        proc = _done(m, world, pid, proc, TIMEOUT, why)
        shown += ", past the wait bound: FlightTimeout"
        if reply[0] == "claimed" and reply[2]:  # a claim with its token: given back at once
            server, _code, more = scripts.fail_flight(server, reply[2], 0, "reset", m.mutant)
            wake = (*wake, *more)
            shown += " (the claim given back)"
        elif reply[0] == "claimed":  # a Cluster's claim without its token yet
            shown += " (the claim is left to lapse)"
    else:
        proc, _ = _on_join(m, world, pid, proc, reply, why)
        proc, ghost = _start_session(m, proc, reply, ghost)
        shown += _refused(proc)
    return (f"{label} -> {shown}", _put(world, pid, proc, server, ghost, wake), why)


def _refused(proc: Proc) -> str:
    """A bound answer not watched (``_follow_timers``): shown in the step's label."""
    return "; not watched (a gap since its join): it joins again" if proc.pc == "gapjoin" else ""


def _join_args(m: Model, proc: Proc) -> tuple[int, bool, str, int, int]:
    """join_flight's arguments after the position: the lease, whether it takes the token,
    the mutant, and the session it carries (once its create was answered) with B."""
    epoch = proc.epoch if proc.est else 0
    return (m.t.lease, m.scope.token_in_join, m.mutant, epoch, m.t.backstop)


def _start_session(
    m: Model, proc: Proc, reply: tuple[object, ...], ghost: Ghost
) -> tuple[Proc, Ghost]:
    """A claim by a node with no session starts one: a fresh epoch, whose create is sent
    next (``session_steps``); claims bind to it once the create was answered."""
    if not m.scope.sessions or proc.epoch or reply[0] != "claimed":
        return proc, ghost
    epoch = ghost.epochs + 1
    return proc._replace(epoch=epoch), ghost._replace(epochs=epoch)


def _show(reply: tuple) -> str:
    kind = reply[0]
    if kind == "hit":
        return f"hit v{reply[1]}" + (" (marked)" if reply[2] else "")
    if kind == "follow":
        shown = f"follow token {reply[1]} from {reply[4]}, lease {reply[2]}, rank {reply[3]}"
        if reply[5]:
            shown += f", bound to p{reply[6]}'s session {reply[5]}, meta's TTL {reply[7]}"
        return shown
    if kind == "claimed":
        shown = f"claimed entry {reply[1]}" + (f", token {reply[2]}" if reply[2] else "")
        return shown + (f", bound to session {reply[3]}" if reply[3] else "")
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
    stream = m.op(pid, proc) == "stream"
    for e in news:
        if e.t != "claimed" and e.tok != proc.gen:
            why.append(
                f"follower_reads_own_flight: p{pid} applied {e.t} entry {e.id} of flight "
                f"{e.tok} while it holds flight {proc.gen}"
            )
        proc = proc._replace(cursor=e.id)
        if e.t == "claimed":  # job.on_claimed: a new generation, its binding not known
            proc = proc._replace(gen=e.id, watch=(), ftimer=0)
            if stream:
                proc = streams.new_generation(m, proc, e.id)
            continue
        if e.t == "chunk":  # job.on_chunk
            proc = streams.apply_chunk(pid, proc, e, why)
            continue
        if e.t == "done":
            if stream:
                proc = streams.end(m, pid, proc, e.tok, e.n, why)
            if e.stored and m.scope.near:
                proc = _lease(m, proc, e.v, proc.wait)
            proc = _done(m, world, pid, proc, e.v, why)
            return f"p{pid} wake: {_entries(news)} -> returns v{e.v}", _put(world, pid, proc), why
        if e.t == "error":
            proc = _done(m, world, pid, proc, ERROR, why)
            return f"p{pid} wake: {_entries(news)} -> returns error", _put(world, pid, proc), why
        if e.t == "reset":  # join in mode first with the reset entry as position
            proc = proc._replace(
                pc="join", mode="first", since=e.id, timer=0, wait=0, watch=(), ftimer=0
            )
            return f"p{pid} wake: {_entries(news)} -> join first", _put(world, pid, proc), why
    if news:
        proc = proc._replace(timer=m.t.lease + m.t.margin, wait=wait)
    else:
        proc = proc._replace(wait=wait)
    shown = f"p{pid} wake: {_entries(news) or 'nothing new'}"
    if proc.pc == "gapjoin":  # after a gap, or a binding refused: the re-check's join next
        proc = proc._replace(pc="recheck")
        shown += ", then join again (a gap)"
    return shown, _put(world, pid, proc), why


def _entries(entries: list[Entry]) -> str:
    return ", ".join(f"{e.t}@{e.id}" for e in entries)


def do_steps(m: Model, world: World, pid: int, proc: Proc) -> Iterator[Step]:
    pc = proc.pc
    t = m.t
    if pc == "join" and proc.mode == "always" and proc.due == 0:
        # Lost (a refused renewal, a fenced write): _resolve's loop checks the deadline first
        nxt = _done(m, world, pid, proc, TIMEOUT, [])
        label = f"p{pid} lost its flight past its wait bound: FlightTimeout"
        yield label, (pid, "join"), _put(world, pid, nxt), ()
    elif pc in ("join", "sleep"):  # sleep: after rank x 30 ms, join in mode always
        mode = proc.mode if pc == "join" else "always"
        label = f"p{pid} join {mode}" if pc == "join" else f"p{pid} rejoin"
        joined = _join(m, world, pid, proc, mode, proc.since, label)
        if joined:
            yield joined[0], (pid, "join"), joined[1], tuple(joined[2])
    elif pc == "gapjoin":  # woken to join: the news taken (_wake's end), then the join
        label, w, why = _wake(m, world, pid, proc)
        yield label, (pid, "wake"), w, tuple(why)
        if proc.due == 0:  # follower.py checks the deadline before it takes the news
            nxt = _done(m, world, pid, proc, TIMEOUT, [])
            label = f"p{pid} wait bound passes: FlightTimeout"
            yield label, (pid, "deadline"), _put(world, pid, nxt), ()
    elif pc == "follow":
        if proc.mail or proc.gap:
            label, w, why = _wake(m, world, pid, proc)
            yield label, (pid, "wake"), w, tuple(why)
        # follower.py waits min(recheck_at, deadline); past the deadline, FlightTimeout.
        # Mutant no-deadline-wait: it waits for recheck_at and sees the deadline only then.
        flight_due = bool(proc.watch) and proc.ftimer == 0 and m.mutant != "watch-no-flight-peek"
        if proc.due == 0 and (proc.timer == 0 or flight_due or m.mutant != "no-deadline-wait"):
            nxt = _done(m, world, pid, proc, TIMEOUT, [])
            label = f"p{pid} wait bound passes: FlightTimeout"
            yield label, (pid, "deadline"), _put(world, pid, nxt), ()
        elif m.mutant == "no-recheck":
            pass
        elif flight_due:  # a bound follower's flight timer: peek_flight (both timers)
            yield _peek(m, world, pid, proc)
        elif proc.timer == 0 and proc.watch:  # its session timer: peek_sessions
            yield _peek_session(m, world, pid, proc)
        elif proc.timer == 0:  # the wait ran out: re-check
            if m.peek:
                yield _peek(m, world, pid, proc)
            else:
                yield from _recheck(m, world, pid, proc)
    elif pc == "recheck":  # the peek found the claim gone: join_flight in mode first
        yield from _recheck(m, world, pid, proc)
    elif pc == "incr":  # INCR owner-seq: the token; the loader starts at once
        nxt = proc._replace(
            pc="run", token=proc.claim, timer=t.renew, confirming=True, ltimer=m.bounds[pid][1]
        )
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


def _follow_timers(
    m: Model, proc: Proc, left: int, se: int = 0, owner: int = 0, ttl: int = 0
) -> Proc:
    """A follower's re-check timers from a join's follow reply or a peek_flight: the lease
    left + margin; when followers watch sessions (``Model.watch``) and the flight is bound,
    that is the session's timer, and the flight's own is meta's TTL + margin.

    It binds (watches the session) only if its wake channel had no gap since the join it
    follows was sent (``Proc.gapped``; rechecks.py ``_bind``): else its node may be missing
    from the flight's waiters list (a restart or failover lost its join) or it may have
    missed the end (a message lost in the gap, the stream lapsed by its read), and the
    session's liveness would tell of neither. It is woken to join again instead (pc
    'gapjoin': its news taken, then the re-check's join, whose answer binds). Mutant
    ``watch-binds-across-gap``: it binds regardless."""
    if m.watch and se:
        if proc.gapped and m.mutant != "watch-binds-across-gap":
            return proc._replace(pc="gapjoin", timer=0, ftimer=0, watch=())
        return proc._replace(timer=left + m.t.margin, ftimer=ttl + m.t.margin, watch=(owner, se))
    return proc._replace(timer=left + m.t.margin, ftimer=0, watch=())


def _peek(m: Model, world: World, pid: int, proc: Proc) -> Step:
    """peek_flight.lua: while meta still holds the claim the follower follows, the lease
    it has left (wait again; a bound flight watched: both timers, the binding learnt);
    else a join in mode first (pc 'recheck', the next step)."""
    left, se, owner, ttl = scripts.peek_flight(world.server, proc.gen)
    if left >= 0:
        nxt = _follow_timers(m, proc, left, se, owner, ttl)
        shown = f"claim {proc.gen} holds, lease {left}"
        if nxt.watch or (se and m.watch):
            shown += f" (p{owner}'s session {se}), meta's TTL {ttl}" + _refused(nxt)
    else:
        nxt = proc._replace(pc="recheck", watch=(), ftimer=0)
        shown = "-1"
    return f"p{pid} peek_flight -> {shown}", (pid, "recheck"), _put(world, pid, nxt), ()


def _peek_session(m: Model, world: World, pid: int, proc: Proc) -> Step:
    """peek_sessions.lua (designed): a bound follower's session timer ran out: while the
    owner's session key holds the epoch, wait its TTL left + margin; else (-1) a join in
    mode first (pc 'recheck'), as after a -1 from peek_flight."""
    assert len(proc.watch) == 2
    owner, epoch = proc.watch
    left = scripts.peek_sessions(world.server, owner, epoch, m.mutant)
    if left >= 0:
        nxt = proc._replace(timer=left + m.t.margin)
        shown = f"p{owner}'s session {epoch} holds, TTL {left}"
    else:
        nxt = proc._replace(pc="recheck", watch=(), ftimer=0)
        shown = f"p{owner}'s session {epoch}: -1"
    return f"p{pid} peek_sessions -> {shown}", (pid, "recheck"), _put(world, pid, nxt), ()


def _recheck(m: Model, world: World, pid: int, proc: Proc) -> Iterator[Step]:
    """The re-check's join_flight in mode first, with the cursor as position (the gaps it
    must not have missed count from its send: ``Rechecks.joining``)."""
    why: list[str] = []
    proc = proc._replace(gapped=False)
    server, reply, wake = scripts.join_flight(
        world.server, pid, "first", proc.cursor, *_join_args(m, proc)
    )
    ghost = _claims(m, world, reply)
    if ghost is None:
        return
    shown = _show(reply)
    if proc.due == 0:  # a pause between the peek and the join: past the wait bound
        nxt = _done(m, world, pid, proc, TIMEOUT, why)
        shown += ", past the wait bound: FlightTimeout"
    elif reply[0] == "follow":  # the binding re-read from the reply
        from_id = reply[4]
        if m.op(pid, proc) == "stream":  # job.on_follow
            proc = streams.new_generation(m, proc, from_id)
        nxt = proc._replace(
            pc="follow",
            gen=from_id,
            cursor=max(proc.cursor, from_id),
            wait=_sent(m, proc) if m.scope.near else 0,
        )
        nxt = _follow_timers(m, nxt, *reply[2:3], *reply[5:])
    else:
        nxt, _ = _on_join(m, world, pid, proc._replace(since=proc.cursor), reply, why)
        nxt, ghost = _start_session(m, nxt, reply, ghost)
    w = _put(world, pid, nxt, server, ghost, wake)
    yield f"p{pid} re-check -> {shown}{_refused(nxt)}", (pid, "recheck-join"), w, tuple(why)


def _run_steps(m: Model, world: World, pid: int, proc: Proc) -> Iterator[Step]:
    # With a timeout: the loader ends by itself before it, or is cancelled at it and ends
    # with FlightTimeout then or, if it ignores the cancellation, a grace later.
    running = proc.ltimer < 0 or proc.ltimer > m.grace
    if running and m.op(pid, proc) == "stream" and proc.sent < m.scope.chunks:
        yield _append(m, world, pid, proc)
    if 0 <= proc.ltimer <= m.grace:
        why = []
        if proc.refused:
            why.append(f"stale_owner_stops: p{pid}'s loader ran on after its renewal was refused")
        nxt = proc._replace(pc="write", outcome=ERROR, timer=0, ltimer=-1)
        at_once = proc.ltimer == 0 and m.mutant != "no-loader-timeout"
        fair = (pid, "ltimeout") if at_once else (pid, "loader")  # at 0: at once
        w = _put(world, pid, nxt)
        yield f"p{pid} loader ends with FlightTimeout", fair, w, tuple(why)
    for outcome in m.scope.outcomes if running else ():
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
            nxt = proc._replace(
                pc="join", mode="always", since=proc.claim, timer=0, refused=False, ltimer=-1
            )
        else:
            nxt = proc._replace(pc="write", outcome=value, timer=0, ltimer=-1)
        shown = f"v{value}" if outcome == "ok" else "an error"
        w = _put(world, pid, nxt, ghost=g)
        yield f"p{pid} loader returns {shown}", (pid, "loader"), w, tuple(why)
    if proc.timer == 0 and not proc.refused and _binds(m, proc):
        yield _bind(m, world, pid, proc)
        if world.budget.late:
            yield _bind_heard_late(m, world, pid, proc)
    elif proc.timer == 0 and not proc.refused:
        t = m.t
        ttl, every = (t.backstop, t.backstop_renew) if proc.bound else (t.lease, t.renew)
        server, ok = scripts.renew_leases(world.server, proc.token, _claim(m, proc), ttl, m.mutant)
        nxt = proc._replace(timer=every) if ok else _give_up(m, proc)
        w = _put(world, pid, nxt, server)
        yield f"p{pid} renew -> {'ok' if ok else 'refused'}", (pid, "renew"), w, ()


def _binds(m: Model, proc: Proc) -> bool:
    """Whether the renewal due binds the flight (``Renewals._to_bind``): it is unbound and
    its node's session usable, its create answered and its proof more than an interval
    long (``Session.usable``)."""
    return m.scope.sessions and not proc.bound and proc.est and proc.sproof > m.t.renew


def _bind(m: Model, world: World, pid: int, proc: Proc) -> Step:
    """bind_leases, the renewal due of an unbound flight while its node's session is
    usable (docs/protocol.md, "Binding a flight after its claim"): 2 bound, the flight a
    bound one from then on (renewed every B/3, given up with its session); 1 renewed
    unbound, as renew_leases; 0 given up, as a refused renewal. The loader's proof is
    capped by the session's from the send: the same as from the answer, in one step."""
    t = m.t
    server, code = scripts.bind_leases(
        world.server, proc.token, _claim(m, proc), proc.epoch, t.lease, t.backstop, m.mutant
    )
    if code == 2:
        late = m.mutant == "bind-not-given-up"
        nxt = proc._replace(timer=t.backstop_renew, bound=True, late=late)
    elif code == 1:
        nxt = proc._replace(timer=t.renew)
    else:
        nxt = _give_up(m, proc)
    why = []
    if code and not (server.meta and scripts.live(server, server.meta[0])):
        why.append(  # checked at the answer, on the server that gave it: across faults too
            f"owner_view_within_servers: p{pid}'s bind_leases answered {code} (it holds flight "
            f"{proc.claim}), and left meta not live on the server"
        )
    shown = {2: "bound", 1: "renewed, unbound", 0: "refused"}[code]
    label = f"p{pid} bind_leases session {proc.epoch} -> {code} ({shown})"
    return label, (pid, "renew"), _put(world, pid, nxt, server), tuple(why)


def _bind_heard_late(m: Model, world: World, pid: int, proc: Proc) -> Step:
    """bind_leases runs, but its answer comes after the flight's proof ran out: the lease is
    given up (the loader cancelled) and the flight given back, fenced by its token
    (``Owner._lost``), then joined again. Without the give-back a bound flight would stay
    live while the node's session does, and every join would follow it until its backstop.
    (A refused renewal, the flight's or its session's, sends no give-back: it would be
    fenced, a no-op. ``_give_up`` leaves it out, as the code does.)"""
    t = m.t
    server, _code = scripts.bind_leases(
        world.server, proc.token, _claim(m, proc), proc.epoch, t.lease, t.backstop, m.mutant
    )
    wake: scripts.Wake = ()
    shown = "given up"
    if m.mutant != "no-give-back":
        server, given, wake = scripts.fail_flight(
            server, proc.token, _claim(m, proc), "reset", m.mutant
        )
        shown += ", given back" if given else ", its give-back fenced"
    w = _put(world, pid, _give_up(m, proc), server, wake=wake)
    w = w._replace(budget=w.budget._replace(late=w.budget.late - 1))
    label = f"p{pid} bind_leases session {proc.epoch}, answered too late: {shown}"
    return label, (pid, "renew"), w, ()


def _give_up(m: Model, proc: Proc) -> Proc:
    """heartbeat.py give_up: the loader is cancelled, Lost: join again from the claim
    entry. Mutant no-cancel: the loader runs on (its renewals stop)."""
    if m.mutant == "no-cancel":
        return proc._replace(refused=True, timer=0)
    return proc._replace(pc="join", mode="always", since=proc.claim, timer=0, ltimer=-1)


def session_steps(m: Model, world: World, pid: int, proc: Proc) -> Iterator[Step]:
    """The node's session on the server (docs/protocol.md, "Sessions"): the create a claim
    started, a renewal every lease/3 (proven from when it was sent), and, when a renewal
    is refused or its proof runs out, the flight bound to it given up and the epoch retired
    (the next claim starts a new one). A crashed or paused node takes none of these."""
    if not proc.epoch:
        return
    t = m.t
    if not proc.est:  # renew_session create: the key is set whatever it held
        server, _ok = scripts.renew_session(world.server, pid, proc.epoch, True, t.lease, m.mutant)
        nxt = proc._replace(est=True, sproof=t.lease, sbeat=t.renew)
        w = _put(world, pid, nxt, server)
        yield f"p{pid} renew_session create {proc.epoch} -> 1", (pid, "session"), w, ()
        return
    if proc.sbeat == 0:
        server, ok = scripts.renew_session(world.server, pid, proc.epoch, False, t.lease, m.mutant)
        nxt = proc._replace(sproof=t.lease, sbeat=t.renew) if ok else _session_lost(m, proc)
        w = _put(world, pid, nxt, server)
        shown = f"p{pid} renew_session {proc.epoch} -> {ok:d}"
        if not ok:
            shown += _lost_shown(proc)
        yield shown, (pid, "session"), w, ()
    if proc.sproof == 0:  # it may have lapsed on the server: given up without asking
        w = _put(world, pid, _session_lost(m, proc))
        label = f"p{pid}'s session {proc.epoch} is past its proof{_lost_shown(proc)}"
        yield label, (pid, "session-lapse"), w, ()


def _session_lost(m: Model, proc: Proc) -> Proc:
    if proc.late and proc.pc == "run":  # mutant bind-not-given-up: its loader runs on
        proc = proc._replace(refused=True, timer=0)
    elif proc.bound and proc.pc == "run":  # the loader of the flight bound to it is cancelled
        proc = _give_up(m, proc)
    return proc._replace(epoch=0, est=False, sproof=0, sbeat=0, bound=False, late=False)


def owner_views(world: World) -> tuple[str, ...]:
    """owner_view_within_servers: an owner whose loader runs on a bound flight believes it
    holds the flight while its session's proof holds (its loader's ``lease_left``: the
    earlier of the flight's proof and the session's); the server must agree then: meta is
    live and holds its token (not across a server restart or failover). Its step form,
    checked across faults too (``_bind``): a bind that answers the owner holds its flight
    (1 or 2) leaves meta live on the server that answered."""
    s = world.server
    if world.ghost.server_fault:
        return ()
    for pid, p in enumerate(world.procs):
        if not (p.alive and p.pc == "run" and p.bound and p.sproof):
            continue
        if not s.meta or s.meta[0].token != p.token or not scripts.live(s, s.meta[0]):
            return (
                f"owner_view_within_servers: p{pid}'s loader holds flight {p.claim} by its "
                f"session {p.epoch}'s proof ({p.sproof} ticks left), which the server no "
                "longer gives it",
            )
    return ()


def unnoticed(m: Model, world: World) -> list[str]:
    """follower_notices_within_lease, checked when time passes: a running follower with no
    word of its flight pending (no message queued, no re-read flagged) whose flight is no
    longer live under the claim it follows (meta gone, another claim, its session dead)
    has a re-check due within lease + margin that would find it (answer -1), as with the
    one timer of peek_flight. (Not after a lost message that carried an end: the caller
    checks ``Ghost.lost_end``; a follower that watches sessions finds it then by B.)"""
    s = world.server
    bound = m.t.lease + m.t.margin
    why = []
    for pid, p in enumerate(world.procs):
        if not p.alive or p.paused or p.pc != "follow" or p.mail or p.gap:
            continue
        if s.meta and s.meta[0].claim == p.gen and scripts.live(s, s.meta[0]):
            continue
        if p.watch:  # the session check finds it if the key is gone by then (no renewal)
            left = scripts.peek_sessions(s, *p.watch, m.mutant)
            q = world.procs[p.watch[0]]
            lapses = left < p.timer and (not q.alive or q.paused)
            due = [p.timer] if left < 0 or lapses else []
            if m.mutant != "watch-no-flight-peek":
                due.append(p.ftimer)
        else:
            due = [] if m.mutant == "no-recheck" else [p.timer]
        if not due or min(due) > bound:
            when = f"in {min(due)} ticks" if due else "never"
            why.append(
                f"follower_notices_within_lease: p{pid} follows flight {p.gen}, which is no "
                f"longer live on the server, and re-checks it {when} (more than lease + "
                f"margin, {bound} ticks)"
            )
    return why


def _lost_shown(proc: Proc) -> str:
    held = proc.bound and proc.pc == "run"
    if held and proc.late:
        return ": the epoch retired, its flight bound by bind_leases kept running (mutant)"
    return ": its flight given up, the epoch retired" if held else ": the epoch retired"


def _append(m: Model, world: World, pid: int, proc: Proc) -> Step:
    """The producer yields chunk ``sent``: it is shown to this process's readers at once,
    then appended (fenced); a fenced append ends the run (Lost: join again and follow)."""
    why: list[str] = []
    if proc.refused:
        why.append(f"stale_owner_stops: p{pid}'s producer ran on after its renewal was refused")
    seq = proc.sent
    held = proc._replace(chunks=(*proc.chunks, (proc.claim, seq)), sent=seq + 1)
    streams.check(pid, held, why)
    server, ok, wake = scripts.append_chunks(
        world.server, proc.token, _claim(m, proc), seq, m.mutant
    )
    if ok:
        nxt = held
    else:
        nxt = held._replace(
            pc="join", mode="always", since=proc.claim, timer=0, refused=False, ltimer=-1
        )
    w = _put(world, pid, nxt, server, wake=wake)
    shown = "appended" if ok else "fenced"
    return (
        f"p{pid} producer yields chunk {seq}: append_chunks -> {shown}",
        (pid, "append"),
        w,
        tuple(why),
    )


def _claim(m: Model, proc: Proc) -> int:
    """The claim id an owner's fenced writes carry: only where the join took no token."""
    return 0 if m.scope.token_in_join else proc.claim


def _write(m: Model, world: World, pid: int, proc: Proc) -> Step:
    why: list[str] = []
    g = world.ghost
    server0 = world.server
    if proc.outcome == ERROR:
        server, code, wake = scripts.fail_flight(
            server0, proc.token, _claim(m, proc), "error", m.mutant
        )
        if code:
            nxt = _done(m, world, pid, proc, ERROR, why)
        else:
            nxt = proc._replace(pc="join", mode="always", since=proc.claim)
        w = _put(world, pid, nxt, server, wake=wake)
        return f"p{pid} fail_flight -> {'published' if code else 'fenced'}", (pid, "write"), w, ()
    value = proc.outcome
    store = m.op(pid, proc) != "nostore"
    server, code, wake = scripts.complete_flight(
        server0, proc.token, _claim(m, proc), value, m.mutant, store, proc.sent
    )
    if code == 1 and not store:
        why.append(
            f"nostore_never_stored: p{pid}'s store=False flight {proc.claim} stored v{value}"
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
    op = m.op(pid, proc)
    why: list[str] = []
    if op in ("do", "get") and proc.near:  # a near-cache hit: no round trip
        value = _serve_near(m, world, pid, proc, why)
        nxt = _done(m, world, pid, proc, value, why)
        yield f"p{pid} {op}: near cache v{value}", (pid, "start"), _put(world, pid, nxt), tuple(why)
        return
    fresh = proc._replace(
        heard=False, mail=(), gap=not proc.sub, gen=0, since=0, cursor=0, gapped=False
    )
    if op in DO_OPS:  # the call's first read is the join itself; its wait bound starts
        fresh = fresh._replace(due=m.bounds[pid][0], chunks=(), restarted=False)
        joined = _join(m, world, pid, fresh, "always", 0, f"p{pid} {op}: join always")
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
        from .invals import replace

        yield replace(m, world, pid, fresh, op)
