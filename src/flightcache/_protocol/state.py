"""What the flight protocol's parts share: the scripts, the answers of ``join_flight``, a
call's handle, and the signal that an owner lost its flight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._backends.scripts import scripts
from .wakeup import Waiter

LUA = scripts(
    __package__,
    "join_flight",
    "confirm_claim",
    "renew_leases",
    "bind_leases",
    "renew_session",
    "append_chunks",
    "complete_flight",
    "fail_flight",
    "read_result",
    "peek_flight",
    "peek_sessions",
)

HIT, FOLLOW, CLAIMED, VACANT, ENDED = 1, 2, 3, 0, 4
TOKEN_RANDOM_BITS = 20


@dataclass(frozen=True, slots=True)
class State:
    kind: int
    value: bytes | None = None
    token: int = 0
    lease_left_ms: int = 0
    rank: int = -1
    last_id: bytes = b"0-0"
    claim_id: str = ""
    since: bytes = b""  # the stream position of the flight this caller last took part in
    ended: bytes = b""  # ENDED: b"done" or b"error"
    count: int | None = None  # ENDED: a stream's chunk count
    sent: float = 0.0  # when the join that answered this was sent (local monotonic clock)
    bound: bytes = b""  # CLAIMED, FOLLOW: the epoch of the owner's session the flight is bound to
    owner_node: bytes = b""  # FOLLOW of a bound flight: the node whose session that is
    own_left_ms: int = 0  # FOLLOW of a bound flight: meta's own TTL (its keys' backstop)
    ttl_left_ms: int = 0  # HIT: the result's time left
    leasable: bool = False  # HIT: no invalidation marks it (a near cache may lease it)
    cost_ms: int = 0  # HIT: how long the result took to compute (0: unknown)
    attempts: int = 0  # CLAIMED: 1 for a flight's first claim, one more per takeover
    newest: bytes | None = None  # FOLLOW: the stream's newest entry at the join (None: unknown)


def state_of(reply: list[Any], claim_id: str, sent: float) -> State:
    kind = int(reply[0])
    if kind == CLAIMED:  # last_id: the claim's own stream entry; token: '' until confirmed
        token = int(reply[3]) if reply[3] else 0
        return State(
            CLAIMED,
            claim_id=claim_id,
            last_id=reply[2],
            token=token,
            sent=sent,
            lease_left_ms=max(int(reply[4]), 0),
            attempts=int(reply[1]),
            bound=reply[5] if len(reply) > 5 and reply[5] else b"",
        )
    if kind == HIT:
        return State(
            HIT,
            value=reply[1],
            ttl_left_ms=int(reply[2]),
            leasable=not int(reply[3]),
            cost_ms=int(reply[4]),
            sent=sent,
        )
    if kind == ENDED:
        ended, value, count, crossed = reply[1], reply[2], reply[3], reply[4]
        return State(  # last_id: the takeover's claim entry crossed on the way, or b""
            ENDED,
            ended=ended,
            value=value or None,
            count=int(count) if count else None,
            last_id=crossed,
        )
    if kind == FOLLOW:
        return State(
            FOLLOW,
            token=int(reply[1]),
            lease_left_ms=max(int(reply[2]), 0),
            rank=int(reply[3]),
            last_id=reply[4],
            newest=reply[5] if len(reply) > 5 else None,
            bound=reply[6] if len(reply) > 8 and reply[6] else b"",
            owner_node=reply[7] if len(reply) > 8 and reply[6] else b"",
            own_left_ms=max(int(reply[8]), 0) if len(reply) > 8 and reply[6] else 0,
        )
    return State(VACANT, rank=int(reply[1]))


class Handle:
    """One call's part in a flight, from its first join on: the claim id that join sends
    (sent again, it answers the same claim), its answer, and the call's waiter."""

    __slots__ = ("claim_id", "digest", "gaps", "state", "waiter")

    def __init__(self, digest: str, claim_id: str) -> None:
        self.digest = digest
        self.claim_id = claim_id
        self.state: State | None = None
        self.waiter: Waiter | None = None
        self.gaps = -1  # a join answered before its waiter existed: the hub's gaps at its send


class Lost(Exception):
    """Internal: this process's ownership ended without a result; go back to join."""
