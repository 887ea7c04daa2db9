"""Each Lua script as one atomic step on a ``Server`` (src/flightcache/_protocol/lua,
src/flightcache/_leases/lua), with the mutants that remove one safeguard each.

A script returns the new server, its reply, and the wake messages it published: one per
distinct node in waiters, ``(pid, (prev, entries))`` as ``_wake.lua`` builds them.
"""

from __future__ import annotations

from .state import MISSING, Entry, Meta, Server

Wake = tuple[tuple[int, tuple[int, tuple[Entry, ...]]], ...]


def _wake(server: Server, waiters: tuple[int, ...], entries: tuple[Entry, ...]) -> Wake:
    """_wake.lua: prev is the newest entry before the first XADD (``server`` is the state
    before the append)."""
    prev = server.stream[-1].id if server.stream else 0
    return tuple((pid, (prev, entries)) for pid in dict.fromkeys(waiters))


def _append(
    server: Server, entry_t: str, tok: int, v: int = 0, stored: bool = False, n: int = 0
) -> Entry:
    return Entry(server.next_id, entry_t, tok, v, stored, n)


def _ended(server: Server) -> int:
    """``Server.fresh`` after an end is appended: -1 (written in this tick; the linger runs
    from the next) where the linger is modelled, with sessions; else 0 (it may lapse at once)."""
    return -1 if server.sessions else 0


def live(server: Server, meta: Meta) -> bool:
    """Whether meta's flight runs (docs/protocol.md, "Sessions"): it is unbound, or its
    owner node's session key holds the epoch it is bound to."""
    return not meta.se or server.sessions[meta.owner][0] == meta.se


def lease_left(server: Server, meta: Meta) -> int:
    """The lease left that join_flight and peek_flight answer: the session key's PTTL for a
    bound flight (0 when the key is gone), meta's own for an unbound one."""
    return server.sessions[meta.owner][1] if meta.se else meta.ttl


def join_flight(
    server: Server,
    pid: int,
    mode: str,
    since: int,
    lease: int,
    token_in_join: bool,
    mutant: str,
    epoch: int = 0,
    backstop: int = 0,
) -> tuple[Server, tuple, Wake]:
    """join_flight.lua (no refresh, no driver retries: a claim id is never sent twice).
    ``epoch``: the caller's session (0: the join carries none); a claim binds to it when
    the caller's session key holds it, with meta's TTL the ``backstop``."""
    if server.result != MISSING:
        return server, ("hit", server.result, bool(server.marker)), ()
    if since and mutant != "no-since":
        crossed = 0
        for e in server.stream:
            if e.id <= since:
                continue
            if e.t == "claimed":
                crossed = e.id
            elif e.t in ("done", "error"):
                return server, ("ended", e.t, e.v, crossed, e.n), ()
    rank = server.waiters.index(pid) if pid in server.waiters else -1
    if server.meta and (live(server, server.meta[0]) or mutant == "join-keeps-dead-meta"):
        meta = server.meta[0]
        waiters = server.waiters
        if rank < 0:
            rank = len(waiters)
            waiters = (*waiters, pid)
        # the follow reply also tells, for a bound flight, its owner and epoch and meta's
        # own TTL (followers that watch sessions keep a timer for each)
        left = lease_left(server, meta)
        reply = ("follow", meta.token, left, rank, meta.claim, meta.se, meta.owner, meta.ttl)
        return server._replace(waiters=waiters), reply, ()
    if server.meta:  # present but not live: deleted, then the vacant path, as if it lapsed
        server = server._replace(meta=())
    if mode == "first" and rank != 0:
        return server, ("vacant", rank), ()
    entry = _append(server, "claimed", server.next_id)
    waiters = tuple(w for w in server.waiters if w != pid)
    wake = _wake(server, waiters, (entry,))
    token = entry.id if token_in_join else 0
    se = epoch if epoch and server.sessions[pid][0] == epoch else 0
    meta = Meta(token, entry.id, backstop if se else lease, False, pid, se)
    server = server._replace(
        meta=(meta,),
        waiters=waiters,
        stream=(*server.stream, entry),
        next_id=server.next_id + 1,
    )
    return server, ("claimed", entry.id, token, se), wake


def confirm_claim(server: Server, claim: int, lease: int) -> tuple[Server, bool]:
    """confirm_claim.lua, sent beside the loader after INCR owner-seq (the token is unique:
    the claim's own id)."""
    if not server.meta or server.meta[0].claim != claim or server.meta[0].token:
        return server, False
    meta = server.meta[0]._replace(token=claim, ttl=lease)
    return server._replace(meta=(meta,)), True


def owns(server: Server, token: int, claim: int, mutant: str = "") -> tuple[Server, bool]:
    """_fence.lua: whether ``token`` holds the flight. A claim made without a token (a
    Cluster) is confirmed by the owner's first fenced write, which carries its claim id
    (``claim``; 0 where the join took the token), if confirm_claim has not done it. With
    sessions, false unless the flight is live (mutant fence-ignores-session: the token
    only)."""
    if not server.meta:
        return server, False
    meta = server.meta[0]
    if not live(server, meta) and mutant != "fence-ignores-session":
        return server, False
    if meta.token:
        return server, meta.token == token
    if claim and meta.claim == claim:
        return server._replace(meta=(meta._replace(token=token),)), True
    return server, False


def renew_leases(
    server: Server, token: int, claim: int, lease: int, mutant: str = ""
) -> tuple[Server, bool]:
    """``lease``: meta's new TTL (the backstop for a flight bound to a session)."""
    server, ok = owns(server, token, claim, mutant)
    if not ok:
        return server, False
    return server._replace(meta=(server.meta[0]._replace(ttl=lease),)), True


def bind_leases(
    server: Server,
    token: int,
    claim: int,
    epoch: int,
    lease: int,
    backstop: int,
    mutant: str = "",
) -> tuple[Server, int]:
    """bind_leases.lua, one flight: 0 when the token no longer holds it (the fence);
    else, while the owner node's session key holds ``epoch``, bound to it (``se``, meta's
    TTL the ``backstop``): 2; else renewed unbound (meta's TTL the ``lease``): 1. Mutant
    bind-ignores-epoch: bound to the epoch sent whatever the key holds."""
    server, ok = owns(server, token, claim, mutant)
    if not ok:
        return server, 0
    meta = server.meta[0]
    if server.sessions[meta.owner][0] == epoch or mutant == "bind-ignores-epoch":
        return server._replace(meta=(meta._replace(se=epoch, ttl=backstop),)), 2
    return server._replace(meta=(meta._replace(ttl=lease),)), 1


def peek_flight(server: Server, claim: int) -> tuple[int, int, int, int]:
    """peek_flight.lua: while meta is live and holds ``claim``, the lease left (the
    session's TTL for a bound flight) and, for a bound flight, its epoch, owner and meta's
    own TTL (followers that watch sessions keep a timer for each); else -1."""
    if server.meta and server.meta[0].claim == claim and live(server, server.meta[0]):
        meta = server.meta[0]
        return lease_left(server, meta), meta.se, meta.owner, meta.ttl
    return -1, 0, 0, 0


def peek_sessions(server: Server, owner: int, epoch: int, mutant: str = "") -> int:
    """peek_sessions.lua (designed): the TTL left of the owner's session key while it holds
    ``epoch``, else -1. Mutant watch-trusts-stale-epoch: any epoch there will do."""
    held, left = server.sessions[owner]
    if held == epoch or (mutant == "watch-trusts-stale-epoch" and left):
        return left
    return -1


def renew_session(
    server: Server, pid: int, epoch: int, create: bool, lease: int, mutant: str
) -> tuple[Server, bool]:
    """renew_session.lua (designed): a create sets the node's key to ``epoch`` for a lease,
    unconditionally; a renewal extends it only while it holds ``epoch``. A renewal never
    creates the key (mutant session-renew-creates: it recreates a missing one)."""
    held, left = server.sessions[pid]
    recreate = mutant == "session-renew-creates" and not left
    if not (create or held == epoch or recreate):
        return server, False
    sessions = list(server.sessions)
    sessions[pid] = (epoch, lease)
    return server._replace(sessions=tuple(sessions)), True


def append_chunks(
    server: Server, token: int, claim: int, seq: int, mutant: str
) -> tuple[Server, int, Wake]:
    """append_chunks.lua, one chunk (the code batches what was queued meanwhile: the same
    entries, in the same order): 1 appended, 0 fenced."""
    if mutant != "no-chunk-fence":
        server, ok = owns(server, token, claim, mutant)
        if not ok:
            return server, 0, ()
    entry = _append(server, "chunk", token, seq)
    wake = _wake(server, server.waiters, (entry,))
    return server._replace(stream=(*server.stream, entry), next_id=server.next_id + 1), 1, wake


def complete_flight(
    server: Server,
    token: int,
    claim: int,
    value: int,
    mutant: str,
    store: bool = True,
    n: int = 0,
) -> tuple[Server, int, Wake]:
    """1 stored, 2 delivered but not stored (TTL 0: ``store=False``; or an invalidation
    marked the flight), 0 fenced. ``n``: a stream flight's chunk count."""
    if mutant != "no-token-check":
        server, ok = owns(server, token, claim, mutant)
        if not ok:
            return server, 0, ()
    marked = bool(server.meta) and server.meta[0].invalidated
    stored = (store or mutant == "nostore-stores") and not marked
    entry = _append(server, "done", token, value, stored, n)
    wake = _wake(server, server.waiters, (entry,))
    server = server._replace(
        result=value if stored else server.result,
        stream=(*server.stream, entry),
        next_id=server.next_id + 1,
        meta=(),
        waiters=(),
        fresh=_ended(server),
    )
    return server, (1 if stored else 2), wake


def fail_flight(
    server: Server, token: int, claim: int, kind: str, mutant: str = ""
) -> tuple[Server, int, Wake]:
    """An error (not negative-cached: the loader timed out, or its error TTL is 0) or a
    reset (the owner gives the flight back); waiters stay after a reset."""
    server, ok = owns(server, token, claim, mutant)
    if not ok:
        return server, 0, ()
    entry = _append(server, kind, token)
    wake = _wake(server, server.waiters, (entry,))
    server = server._replace(
        stream=(*server.stream, entry),
        next_id=server.next_id + 1,
        meta=(),
        waiters=() if kind == "error" else server.waiters,
        fresh=_ended(server),
    )
    return server, 1, wake


def read_result(server: Server) -> tuple[int, bool]:
    return server.result, bool(server.marker)


def replace_result(
    server: Server, inval: int, value: int, marker_ttl: int, mutant: str
) -> tuple[Server, bool]:
    """replace_result.lua: value MISSING deletes (invalidate), else sets (set)."""
    busy = bool(server.marker)
    marker = server.marker if mutant == "no-marker" else (inval, marker_ttl)
    meta = server.meta
    if meta:
        meta = (meta[0]._replace(invalidated=True),)
    existed = server.result != MISSING or busy
    return server._replace(marker=marker, meta=meta, result=value), existed


def end_replace(server: Server, inval: int) -> Server:
    if server.marker and server.marker[0] == inval:
        return server._replace(marker=())
    return server


def live_nodes(server: Server) -> frozenset[int]:
    """live_nodes.lua: the nodes whose liveness key exists (the node set and its SADDs are
    abstracted into the keys themselves: a renewing node is listed, see docs)."""
    return frozenset(pid for pid, left in enumerate(server.nodes) if left > 0)
