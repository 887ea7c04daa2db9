"""Fencing tokens for claims a join made without one.

Where ``owner-seq`` lives in another slot than the flight (a Cluster, or a shard of a list
other than the first), the join cannot take the token itself: the claim is made with a
claim id, then the token is ``INCR owner-seq`` and the claim is confirmed with it
(``confirm_claim``), sent beside the loader. docs/protocol.md (``confirm_claim``) says why
a claim that lapsed meanwhile is never confirmed, so its owner writes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

from .._backends.redis import RedisConnection
from .._keys import FlightKeys, KeySpace
from .._types import CallOptions
from .state import LUA, TOKEN_RANDOM_BITS, State

log = logging.getLogger("flightcache.claim")


class Tokens:
    """Takes tokens from ``owner-seq`` on ``seq_conn`` and confirms claims on ``conn``."""

    def __init__(self, conn: RedisConnection, seq_conn: RedisConnection, keyspace: KeySpace):
        self.conn = conn
        self.seq_conn = seq_conn
        self.keyspace = keyspace
        # confirm_claim, sent beside loaders, by token (kept here until it is answered)
        self._confirming: dict[int, asyncio.Task[Any]] = {}

    async def take(self, fk: FlightKeys, opts: CallOptions, state: State) -> tuple[int, float]:
        """A fencing token for a claim the join made without one (INCR owner-seq, in another
        slot): the token, and when the lease began (the join's send time, or earlier for a
        claim found again). The loader starts at once: the claim is confirmed by
        ``confirm_claim``, sent beside it, or by the owner's first fenced write, which
        carries the claim id (``_fence.lua``), whichever the server sees first; if the
        claim lapsed meanwhile, both are refused and the owner loses the flight."""
        seq = self.seq_conn
        counter = int(await seq.run(lambda: seq.client.incr(self.keyspace.owner_seq)))
        # The counter orders tokens; 20 random low bits keep them unique even if the counter
        # went backwards (a failover can lose recent INCRs: Redis replicates asynchronously).
        token = (counter << TOKEN_RANDOM_BITS) | secrets.randbits(TOKEN_RANDOM_BITS)
        granted = state.sent + state.lease_left_ms / 1000 - opts.lease_ms / 1000
        confirm = self.conn.script(
            LUA["confirm_claim"], fk, (fk.meta,), (state.claim_id, token, opts.lease_ms)
        )
        task = asyncio.ensure_future(confirm)
        self._confirming[token] = task
        task.add_done_callback(lambda t: self._confirmed(t, token))
        log.debug("flight %s: owner with token %d", fk.digest, token)
        return token, granted

    async def confirmed(self, token: int) -> None:
        """Once the ``confirm_claim`` of ``token``'s claim, if one is on its way, is
        answered: a write fenced by the token alone (``set(if_token=)``) then finds the
        token in meta if the claim still holds. Its failure is not this caller's: the write
        is refused by its own check then."""
        task = self._confirming.get(token)
        if task is not None:
            await asyncio.wait([task])  # (shielded: the confirmation is not ours to cancel)

    def _confirmed(self, task: asyncio.Task[Any], token: int) -> None:
        self._confirming.pop(token, None)
        if not task.cancelled() and task.exception() is not None:
            # The owner's fenced writes confirm the claim themselves (or are refused).
            log.info("confirm_claim failed: %r", task.exception())
