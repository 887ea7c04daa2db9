"""The model's state: one key's server-side keys, the processes, and ghost bookkeeping.

Everything is a tuple of small ints and short strings, so a state hashes and compares as a
whole (the checker keeps a set of them). Values are abstracted to ids: a loader's value is
the id of the claim that ran it (its generation), a value given to ``set()`` is
``SET_BASE + n``, and ``INITIAL`` is a value stored before the run began. Tokens are claim
entry ids too: unique per claim (the code's 20 random low bits, assumed not to collide), and
the scripts only ever compare them for equality. Stream entry ids count up with time and
never go back, not even across a restart or a failover (they are the server's clock).
"""

from __future__ import annotations

from typing import NamedTuple

INITIAL = 999  # a value some owner stored before the run began
SET_BASE = 1000  # values given to set() are SET_BASE + 1, + 2, ...
ERROR = -1  # what a caller returns when the flight's loader failed
TIMEOUT = -2  # what a caller returns when its wait bound passed (FlightTimeout)
MISSING = 0  # no value (get() of an empty key)


class Entry(NamedTuple):
    """One stream entry. ``tok`` is the writer's token (the claim's own id for 'claimed');
    ``v`` the value a 'done' carries (always inline: the model's values are small), or a
    'chunk''s sequence number; ``stored`` whether a 'done' stored it (the event's ``x``);
    ``n`` how many chunks a stream flight's 'done' says it appended."""

    id: int
    t: str  # 'claimed', 'chunk', 'done', 'error' or 'reset'
    tok: int
    v: int = 0
    stored: bool = False
    n: int = 0


class Meta(NamedTuple):
    token: int  # 0 while CLAIMING (a Cluster claim not yet confirmed)
    claim: int  # the claim id: its claimed entry's id (claimEntry)
    ttl: int  # ticks left on the server's clock
    invalidated: bool
    owner: int  # pid (its session key's node; for symmetry renaming and traces)
    se: int = 0  # the session epoch the flight is bound to (0: unbound; scopes with sessions)


class Server(NamedTuple):
    result: int  # value id, or MISSING
    meta: tuple[Meta, ...]  # () or (meta,)
    stream: tuple[Entry, ...]
    waiters: tuple[int, ...]  # pids, in join order
    marker: tuple[int, int] | tuple[()]  # (invalidation id, ticks left) or ()
    nodes: tuple[int, ...]  # per pid: ticks left on its liveness key (0: absent)
    acks: tuple[tuple[int, int], ...]  # (invalidation id, pid) pushed to ack lists, sorted
    next_id: int  # the next stream entry id (the server's time, never reset)
    # per pid: its session key (epoch, ticks left), (0, 0) when absent; () without sessions
    sessions: tuple[tuple[int, int], ...] = ()
    # ticks before the stream's newest end (done, error, reset) may lapse (the linger): -1
    # while it was written in this tick, then the linger less one, down to 0 (env.tick)
    fresh: int = 0


class Proc(NamedTuple):
    """One process: a FlightCache node running its list of operations one at a time."""

    pc: str = "idle"  # the phase of its current operation
    op: int = 0  # index of the current operation in its list
    alive: bool = True
    paused: bool = False
    # -- a do() call --
    mode: str = "always"  # the mode of its next join_flight
    since: int = 0  # the position its next join sends (0: none)
    cursor: int = 0  # a follower's last applied entry
    gen: int = 0  # ghost: the flight (claim id) it took part in last; 0 none
    token: int = 0  # an owner's token
    claim: int = 0  # an owner's claim entry
    confirming: bool = False  # a Cluster owner's confirm_claim is on the wire
    timer: int = 0  # owner: next renewal due; follower: re-check; invalidator: deadline
    outcome: int = 0  # owner: the loader's value (ERROR for an error)
    refused: bool = False  # ghost: a renewal of its lease was refused
    mail: tuple[tuple[int, tuple[Entry, ...]], ...] = ()  # wake messages (prev, entries)
    gap: bool = False  # the waiter must re-read the stream (a message may be lost)
    # -- near cache and node --
    near: tuple[int, int] | tuple[()] = ()  # (value, lease ticks left)
    live: int = 0  # ticks until its liveness lease may lapse, by its own clock
    beat: int = 0  # ticks until its next liveness renewal
    sub: bool = True  # its listener is subscribed
    inbox: tuple[tuple[int, int], ...] = ()  # invalidation messages (id, sender pid)
    acks: tuple[int, ...] = ()  # acknowledgements to push (invalidation ids)
    heard: bool = False  # an invalidation was heard since its current call began
    reply: tuple[int, int, bool] | tuple[()] = ()  # a read in flight: (value, ticks, leasable)
    wait: int = 0  # a follower: lease ticks since its current wait began (a done's lease)
    drift: int = 0  # how far its clock is off real time, in ticks
    # -- the wait bound (scopes that give the process's calls a timeout) --
    due: int = -1  # ticks left in the call's wait bound (0: passed; -1: not modelled)
    ltimer: int = -1  # an owner: ticks until its loader is abandoned (timeout + grace)
    # -- a stream() call --
    chunks: tuple[tuple[int, int], ...] = ()  # chunks its readers were shown: (claim, seq)
    sent: int = 0  # an owner: chunks its producer yielded this run
    restarted: bool = False  # ghost: a reader was told StreamRestarted
    # -- its session on the server (scopes with sessions, docs/protocol.md, "Sessions") --
    epoch: int = 0  # its session's epoch (0: none); a retired epoch is never used again
    est: bool = False  # the epoch's create was answered: claims may bind to it
    sproof: int = 0  # ticks until the session may have lapsed, by its own clock (its proof)
    sbeat: int = 0  # ticks until its session's next renewal
    bound: bool = False  # an owner: its flight is bound to its session's epoch
    late: bool = False  # mutant bind-not-given-up only: its flight was bound by bind_leases
    # a follower of a bound flight, when followers watch sessions (Model.watch): the owner's
    # (pid, epoch) it watches, () in unbound mode (one timer); ``timer`` is then the
    # session's timer and ``ftimer`` the flight's own (meta's TTL left + margin, up to B)
    watch: tuple[int, int] | tuple[()] = ()
    ftimer: int = 0
    # the wake channel had a gap since the join this follower follows was sent (the code's
    # ``Waiter.mark != WakeHub.gaps``): set when its listener subscribes again during a call,
    # cleared when the call's waiter is made (before its first join) and at each re-check's
    # join (``Rechecks.joining``); while set, a bound answer is not watched: it joins again
    gapped: bool = False
    # -- an invalidate()/set() --
    inv: tuple = ()  # (id, holders, trusted, superseded values, superseded below gen)


class Ghost(NamedTuple):
    """What the invariants need beyond the protocol's own state."""

    produced: frozenset[int] = frozenset({INITIAL})  # values some owner or set() made
    stored_gens: frozenset[int] = frozenset()  # flights that stored a result
    ever_stored: frozenset[int] = frozenset({INITIAL})  # values the result key ever held
    dead: frozenset[int] = frozenset()  # values an invalidation that returned replaced
    dead_below: int = 0  # flights claimed before a returned invalidation: values stale
    replaced_below: int = 0  # flights claimed before any replace_result so far
    sets: int = 0  # set() calls so far
    claims: int = 0  # flights claimed so far (the scope bounds them)
    server_fault: bool = False  # a restart or failover happened (lease guarantees end)
    epochs: int = 0  # session epochs made so far: an epoch's id is its number, never reused
    lost_end: bool = False  # a lost wake message carried a flight's end (done, error, reset)


class Budget(NamedTuple):
    crash: int = 0
    pause: int = 0
    lose: int = 0  # wake or invalidation messages lost without notice
    drop: int = 0  # a listener's connection lost (noticed)
    restart: int = 0  # the server restarts empty
    failover: int = 0  # a replica that missed the last write takes over
    close: int = 0  # an owner's cache is closed: it gives the flight back
    late: int = 0  # a bind answered after the flight's proof ran out (it ran on the server)


class World(NamedTuple):
    server: Server
    procs: tuple[Proc, ...]
    ghost: Ghost
    budget: Budget
    undo: tuple[Server, ...]  # the replica: the server before its last write ((): in step)
