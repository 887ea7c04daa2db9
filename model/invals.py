"""An ``invalidate()`` or ``set()``, as ``_leases/nodes.py`` ``NodeAgent.replace`` takes it:
drop the own copy, ``replace_result``, the live set read after the delete, publish, wait for
every holder's acknowledgement or the deadline, ``end_replace``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from . import scripts
from .procs import Step, _done, _put
from .state import MISSING, SET_BASE, Proc, World

if TYPE_CHECKING:
    from .model import Model


def replace(m: Model, world: World, pid: int, proc: Proc, op: str) -> Step:
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
        g = returned(g, superseded, below)
        nxt = _done(m, world, pid, proc, MISSING, [])
        w = _put(world, pid, nxt, server, g)
        return f"p{pid} {op}: replace_result -> absent, returns", (pid, "start"), w, ()
    nxt = proc._replace(pc="list", timer=wait, inv=(inval, (), True, superseded, below))
    w = _put(world, pid, nxt, server, g)
    shown = f"v{value}" if value else "delete"
    return f"p{pid} {op}: replace_result {shown} (id {inval})", (pid, "start"), w, ()


def returned(g, superseded: tuple[int, ...], below: int):
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
            g = returned(world.ghost, superseded, below)
            nxt = _done(m, world, pid, proc._replace(inv=()), MISSING, [])
            w = _put(world, pid, nxt, server, g)
            yield f"p{pid} invalidation {inval} returns ({how})", (pid, "inval"), w, ()
