"""The scopes the checker runs: small ones for the test suite, larger ones for
``make model``, and where each mutant is caught."""

from __future__ import annotations

from .model import Scope
from .state import Budget

QUARTER = 0.25  # the tick of scopes with read leases: skew_margin, in which every
# lease-related duration is a whole number of ticks (lease 12, near_lease 20, node_ttl 24)

SMALL = (
    Scope(
        "flights-2",
        (("do",), ("do",)),
        budget=Budget(crash=1, pause=1, lose=1),
        doc="two callers of one key: a crash, a pause and a lost wake message",
    ),
    Scope(
        "cluster-2",
        (("do",), ("do",)),
        token_in_join=False,
        budget=Budget(crash=1, pause=1, lose=1),
        doc="the same on a Cluster: claims take the token with INCR and confirm_claim",
    ),
    Scope(
        "leases-drift",
        (("get", "get"), ("invalidate",)),
        tick_s=QUARTER,
        near=True,
        initial=True,
        drift=1,
        budget=Budget(lose=1),
        doc="a holder reads twice while another node invalidates; each clock may measure "
        "its lease or its wait one skew margin long or short; a lost invalidation message",
    ),
    Scope(
        "leases-pause",
        (("get", "get"), ("invalidate",)),
        tick_s=QUARTER,
        near=True,
        initial=True,
        budget=Budget(pause=1),
        doc="a holder that pauses past its liveness lease, then reads while another node "
        "invalidates",
    ),
    Scope(
        "leases-3",
        (("get", "get"), ("invalidate",), ("invalidate",)),
        tick_s=QUARTER,
        near=True,
        initial=True,
        liveness=False,
        budget=Budget(lose=1),
        doc="two invalidations of one key under way at once, a holder that misses one "
        "(no pause or crash: every node stays live)",
    ),
)

SMALL += (
    Scope(
        "bound-2",
        (("do",), ("do",)),
        timeouts=(0, 1),
        budget=Budget(pause=1, lose=1),
        symmetry=False,  # none to reduce (the timeouts differ): liveness is checked too
        doc="a caller with timeout=1 s (a 9 s wait bound) and one whose loader may run past "
        "it: the caller returns by its deadline, or its loader's timeout when it owns; a "
        "pause and a lost message (bound-2-close adds a crash and a close)",
    ),
    Scope(
        "streams-2",
        (("stream",), ("stream",)),
        chunks=1,
        budget=Budget(pause=1, lose=1),
        doc="two readers of one stream (one chunk a run): chunks fenced by token, a "
        "takeover after a pause restarting it, a lost wake message",
    ),
    Scope(
        "nostore-2",
        (("nostore",), ("do",)),
        budget=Budget(crash=1, pause=1, lose=1),
        symmetry=False,  # none to reduce (the operations differ): liveness is checked too
        doc="a store=False call and a plain one coalescing: whose flight stores is its "
        "owner's call",
    ),
    Scope(
        "sessions-2",
        (("do",), ("do",)),
        sessions=True,
        budget=Budget(crash=1, pause=1, lose=1),
        symmetry=False,  # liveness is checked too: a dead session's flight is taken over
        doc="session leases (docs/protocol.md, Sessions): flights bound to "
        "their owner's session, a crash, a pause past the session's lease, a lost message",
    ),
    Scope(
        "sessions-failover-notice-2",
        (("do",), ("do",)),
        sessions=True,
        flights=2,
        budget=Budget(failover=1),
        notice_across_faults=True,
        doc="a failover to a replica that missed the last write (a follower's join among "
        "them), no pause: a follower of a bound flight notices its end within a lease "
        "across the failover too (follower_notices_within_lease)",
    ),
    Scope(
        "sessions-restart-notice-2",
        (("do",), ("do",)),
        sessions=True,
        established=False,
        flights=2,
        budget=Budget(restart=1),
        notice_across_faults=True,
        doc="fresh nodes (a first claim is unbound: its session's create not yet answered) "
        "through a server restart, no pause: a follower that learns of a bound takeover "
        "after the restart notices its end within a lease too",
    ),
    Scope(
        "sessions-bind-late-2",
        (("do",), ("do",)),
        sessions=True,
        established=False,
        backstop=False,
        flights=3,  # (a flight given back is claimed again: one more)
        budget=Budget(late=1),
        symmetry=False,  # liveness is checked too: the flight given up is claimed again
        doc="fresh nodes whose bind may be answered after the flight's proof ran out (it "
        "ran on the server): the flight, given up, is given back, or it stays bound to a "
        "session that lives on (the backstop B unbounded: nothing else would end it)",
    ),
)

LIVENESS = (
    Scope(
        "live-2",
        (("do",), ("do",)),
        budget=Budget(crash=1, pause=1, lose=1),
        symmetry=False,
        doc="every call returns, and a dead owner's flight is taken over, under fairness",
    ),
)

LARGE = (
    Scope(
        "flights-3",
        (("do",), ("do",), ("do",)),
        budget=Budget(crash=1, pause=1, lose=1, close=1),
        doc="three callers: a crash, a pause, a lost message and a closed owner",
    ),
    Scope(
        "flights-2-server",
        (("do",), ("do",)),
        flights=2,
        budget=Budget(pause=1, drop=1, restart=1, failover=1),
        doc="two callers through a server restart, a failover that loses the last write, a "
        "lost listener connection and a pause",
    ),
    Scope(
        "cluster-3",
        (("do",), ("do",), ("do",)),
        token_in_join=False,
        budget=Budget(crash=1, pause=1, lose=1),
        doc="three callers on a Cluster",
    ),
    Scope(
        "live-cluster-2",
        (("do",), ("do",)),
        token_in_join=False,
        budget=Budget(crash=1, pause=1, lose=1),
        symmetry=False,
        doc="liveness on a Cluster: every call returns, a dead owner's flight is taken over",
    ),
    Scope(
        "leases-flight",
        (("do", "do"), ("set",)),
        tick_s=QUARTER,
        near=True,
        drift=1,
        flights=2,
        liveness=False,
        budget=Budget(lose=1, drop=1),
        doc="a caller whose flights run while another node sets the key (the mark, the "
        "owner's and followers' leases); drifting clocks, a lost message, a lost listener",
    ),
    Scope(
        "leases-set-3",
        (("get", "get"), ("invalidate",), ("set",)),
        tick_s=QUARTER,
        near=True,
        initial=True,
        liveness=False,
        budget=Budget(lose=1),
        doc="a holder, an invalidation and a set of one key at once, a lost message",
    ),
    Scope(
        "news-drop-4",
        (("do",), ("do",), ("do",), ("do",)),
        outcomes=("ok",),
        budget=Budget(lose=1, close=2),
        doc="a follower that takes several wake messages at once, one between them lost",
    ),
)

LARGE += (
    Scope(
        "bound-2-close",
        (("do",), ("do",)),
        timeouts=(0, 1),
        budget=Budget(crash=1, pause=1, lose=1, close=1),
        doc="bound-2 with a closed owner too (its reset: a follower's join in mode first, "
        "which may claim as its deadline passes)",
    ),
    Scope(
        "live-streams-2",
        (("stream",), ("stream",)),
        chunks=1,
        budget=Budget(crash=1, pause=1, lose=1),
        symmetry=False,
        doc="liveness of stream flights: every reader returns, a dead owner's stream is "
        "taken over, under fairness",
    ),
    Scope(
        "bound-3",
        (("do",), ("do",), ("do",)),
        timeouts=(1, 1, 1),
        budget=Budget(crash=1, close=1),
        doc="three callers with timeout=1 s (loaders bounded too): takeovers in a chain, a "
        "crash and a closed owner (bound-2 and bound-2-close lose messages)",
    ),
    Scope(
        "sessions-unbacked-2",
        (("do",), ("do",)),
        sessions=True,
        backstop=False,
        budget=Budget(crash=1, pause=1, lose=1),
        symmetry=False,
        doc="sessions-2 with the backstop B unbounded: a dead owner's flight is taken over by "
        "its session's lapse alone, never by its meta lapsing",
    ),
    Scope(
        "sessions-close-2",
        (("do",), ("do",)),
        sessions=True,
        budget=Budget(crash=1, pause=1, lose=1, close=1),
        symmetry=False,
        doc="sessions-2 with a closed owner too (its reset deletes a bound meta)",
    ),
    Scope(
        "sessions-restart-2",
        (("do",), ("do",)),
        sessions=True,
        flights=2,
        budget=Budget(pause=1, restart=1),
        doc="sessions through a server restart (every session key gone, each node's belief "
        "in its own left to its next renewal) and a pause",
    ),
    Scope(
        "sessions-failover-2",
        (("do",), ("do",)),
        sessions=True,
        flights=2,
        budget=Budget(pause=1, failover=1),
        doc="sessions through a failover to a replica that missed the last write (a create, "
        "a renewal after a pause, a claim, a DEL of a dead meta) and a pause",
    ),
    Scope(
        "streams-2-chunks",
        (("stream",), ("stream",)),
        chunks=2,
        budget=Budget(crash=1, pause=1),
        doc="two readers of one stream of two chunks a run: a crash and a pause",
    ),
    Scope(
        "streams-3",
        (("stream",), ("stream",), ("stream",)),
        chunks=1,
        flights=2,
        budget=Budget(crash=1, lose=1),
        doc="three readers of one stream: a follower reads a takeover's 'claimed' and the new "
        "run's chunks (StreamRestarted); a crash and a lost message",
    ),
    Scope(
        "nostore-3",
        (("nostore",), ("do",), ("do",)),
        flights=2,
        budget=Budget(crash=1, pause=1),
        doc="store=False and plain calls of one key through takeovers",
    ),
)

# Where each mutant is caught (the unmodified model passes the same scope).
MUTANT_SCOPES = {
    "no-token-check": "flights-2",
    "no-cancel": "flights-2",
    "no-since": "flights-2",
    "no-skew": "leases-drift",
    "no-marker": "leases-3",
    "no-recheck": "live-2",
    "no-deadline-wait": "bound-2",
    "no-loader-timeout": "bound-2",
    "no-restart": "streams-2",
    "no-chunk-fence": "streams-2",
    "nostore-stores": "nostore-2",
    "session-renew-creates": "sessions-2",
    "fence-ignores-session": "sessions-2",
    # With the design's backstop B a join that follows a dead meta only delays the takeover
    # until B lapses (every property checked here holds in sessions-2): caught where B is
    # unbounded, so that only the session's liveness can end a dead owner's flight.
    "join-keeps-dead-meta": "sessions-unbacked-2",
    # A failover to a replica that missed a completion leaves a bound meta whose owner's
    # session lives on and nobody runs: only the flight's own peek finds it lapse (also
    # caught in sessions-2, by liveness after a lost done, in 30 times the time).
    "watch-no-flight-peek": "sessions-failover-notice-2",
    # A failover that loses a follower's join (its place in waiters) is noticed only by the
    # join after the gap; the lease guarantees are not claimed across a failover elsewhere.
    "watch-ignores-gap": "sessions-failover-notice-2",
    "watch-trusts-stale-epoch": "sessions-unbacked-2",
    # A follower of an unbound flight whose place in waiters a restart lost learns of a
    # bound takeover (its stream, then a peek): only a join after the gap puts it back.
    "watch-binds-across-gap": "sessions-restart-notice-2",
    # Only a failover to a replica that missed the create of a new epoch leaves a node's
    # session usable by its own proof while its key does not hold the epoch (a restart
    # loses the flight too): the bind must renew the flight unbound then, not bind it dead.
    "bind-ignores-epoch": "sessions-failover-2",
    # A flight bound by a renewal whose session is refused (the restart lost its key) has
    # a loader that runs on: the session's refusal is its renewal's.
    "bind-not-given-up": "sessions-restart-notice-2",
    # A flight given up for a late answer and not given back stays bound to its owner's
    # live session: with B unbounded every join follows it for ever (liveness).
    "no-give-back": "sessions-bind-late-2",
}

KNOWN_ISSUE_SCOPES = {"news-drop": "news-drop-4", "late-liveness": "leases-pause"}

ALL = {s.name: s for s in (*SMALL, *LIVENESS, *LARGE)}
