"""The near cache: this process's copy of results, each trusted only while its lease holds.

A lease is granted with every value read from the server. The holder trusts it until
``sent + lease - skew_margin`` on its monotonic clock, where ``sent`` is when it sent the
request that returned the value (so the lease starts no later than the server's view of
it); an invalidation waits ``lease + skew_margin`` before it stops counting on
acknowledgements. A lease is never longer than the value's own time left on the server.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import NamedTuple

from .._codec import ERROR_TAG

# What an entry costs beside its value, measured with tracemalloc on CPython 3.11 (the
# bytes object's header, the digest string, the tuple and float, the dict's share).
ENTRY_OVERHEAD = 256


class NearCache:
    """An LRU of encoded results with lease deadlines, bounded by entries and bytes."""

    def __init__(
        self,
        *,
        max_entries: int,
        max_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.clock = clock
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        # Tagged copies only: their tags, and each tag's copies (invalidate_tags drops them).
        self._tags_of: dict[str, tuple[str, ...]] = {}
        self._by_tag: dict[str, set[str]] = {}
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: str) -> bytes | None:
        entry = self._entries.get(digest)
        if entry is None:
            self.misses += 1
            return None
        if self.clock() >= entry[0]:  # the lease ended: the copy may be stale
            self._remove(digest)
            self.misses += 1
            return None
        self._entries.move_to_end(digest)
        self.hits += 1
        return entry[1]

    def put(self, digest: str, data: bytes, lease_end: float, tags: tuple[str, ...] = ()) -> None:
        if len(data) + ENTRY_OVERHEAD > self.max_bytes or lease_end <= self.clock():
            return
        self._remove(digest)
        self._entries[digest] = (lease_end, data)
        self.bytes += len(data) + ENTRY_OVERHEAD
        if tags:
            self._tags_of[digest] = tags
            for tag in tags:
                self._by_tag.setdefault(tag, set()).add(digest)
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            self._remove(oldest)

    def drop(self, digest: str) -> None:
        self._remove(digest)

    def drop_tags(self, tags: Iterable[str]) -> int:
        """Drop every copy carrying one of ``tags``; how many were dropped."""
        dropped = 0
        for tag in tags:
            for digest in list(self._by_tag.get(tag, ())):
                self._remove(digest)
                dropped += 1
        return dropped

    def clear(self) -> None:
        self._entries.clear()
        self._tags_of.clear()
        self._by_tag.clear()
        self.bytes = 0

    def _remove(self, digest: str) -> None:
        entry = self._entries.pop(digest, None)
        if entry is not None:
            self.bytes -= len(entry[1]) + ENTRY_OVERHEAD
        if self._tags_of:  # untagged caches never look further
            for tag in self._tags_of.pop(digest, ()):
                copies = self._by_tag.get(tag)
                if copies is not None:
                    copies.discard(digest)
                    if not copies:
                        del self._by_tag[tag]


class Heard(NamedTuple):
    """What a node knew when it sent a read: invalidations heard (a counter), and until when
    the server surely listed it as live. A lease is granted on the reply by both as of the
    send: a renewal that lands while the read is on the wire does not lengthen it (an
    invalidation may have read the live set without this node before that renewal)."""

    seq: int
    live_until: float


class Leaser:
    """Grants near-cache leases on values read from the server."""

    def __init__(
        self,
        near: NearCache,
        *,
        lease_s: float,
        skew_margin_s: float,
        heard: Callable[[], int],
        live_until: Callable[[], float],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.near = near
        self.lease_s = lease_s
        self.skew_margin_s = skew_margin_s
        self._seq = heard  # invalidations heard so far (a counter)
        self.live_until = live_until  # until when the live set surely lists this node
        self.clock = clock

    def heard(self) -> Heard:
        """Taken when a read is sent, handed back to :meth:`grant` with its reply."""
        return Heard(self._seq(), self.live_until())

    def grant(
        self,
        digest: str,
        data: bytes,
        sent: float,
        ttl_left_ms: int,
        heard: Heard,
        tags: tuple[str, ...] = (),
    ) -> None:
        """Keep ``data``, read by a request sent at ``sent`` when ``heard`` invalidations had
        been heard, for its lease: never past the value's own time left on the server, and
        not at all if an invalidation was heard since (it may be about this very value).
        A copy with ``tags`` is dropped by an invalidation of any of them."""
        if self._seq() != heard.seq or data[:1] == ERROR_TAG or ttl_left_ms <= 0:
            return
        lease = min(self.lease_s, ttl_left_ms / 1000)
        # Never past this node's liveness as it was when the read was sent: an invalidation
        # waits only for the nodes its read of the live set listed.
        end = min(sent + lease, heard.live_until) - self.skew_margin_s
        self.near.put(digest, data, end, tags)
