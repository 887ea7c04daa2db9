"""``memory://``: the same semantics for one process, with no server.

Local single-flight happens in FlightCache itself; this backend only runs the owner's loader
under its timeout and keeps results (and negative-cached errors) in a dict with monotonic
expiry, encoded exactly as on Redis so size limits and codec errors behave the same.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from .._codec import NOT_FOUND_TAG, Envelope
from .._errors import FlightError, FlightTimeout, LeaseLost, SerializationError, ValueTooLarge
from .._keys import FlightKeys
from .._types import CallOptions, FlightInfo, Invalidation, Stats
from .base import Opening
from .context import FlightContext
from .jobs import Job
from .loader import (
    WorkCancelled,
    cancelled_loader_error,
    error_ttl_ms,
    start_work,
    wait_bounded,
)


class MemoryFlights:
    def __init__(
        self,
        envelope: Envelope,
        stats: Stats,
        *,
        ttl_jitter: float = 0.1,
        max_ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.envelope = envelope
        self.stats = stats
        self.ttl_jitter = ttl_jitter
        self.max_ttl_ms = int(max_ttl_s * 1000) if max_ttl_s is not None else None
        self.clock = clock
        self._store: dict[str, tuple[float, bytes]] = {}
        self._running: dict[str, int] = {}  # digest -> the running flight's token
        self._tokens = itertools.count(1)  # one process: a counter is a fencing token
        # Running flights whose key was replaced or deleted meanwhile: their result is
        # delivered to their callers, not stored (as the invalidated mark does on a server).
        self._marked: set[int] = set()

    async def lookup(self, fk: FlightKeys) -> bytes | None:
        item = self._store.get(fk.digest)
        if item is None:
            return None
        expires, data = item
        if self.clock() >= expires:
            del self._store[fk.digest]
            return None
        return data

    async def lookup_full(self, fk: FlightKeys) -> tuple[bytes | None, int, bool, int]:
        """The stored result and its time left; one process, so nothing to lease, and the
        cost of a value is not kept."""
        data = await self.lookup(fk)
        return data, self.ttl_left_ms(fk) if data is not None else 0, False, 0

    def ttl_left_ms(self, fk: FlightKeys) -> int:
        item = self._store.get(fk.digest)
        return int((item[0] - self.clock()) * 1000) if item is not None else -2

    def _put(self, fk: FlightKeys, data: bytes, ttl_ms: int) -> None:
        if self.max_ttl_ms is not None:
            ttl_ms = min(ttl_ms, self.max_ttl_ms)
        self._store[fk.digest] = (self.clock() + ttl_ms / 1000, data)

    def prepare(self, fk: FlightKeys) -> None:
        return None

    async def begin(self, fk: FlightKeys, opts: CallOptions, handle: Any) -> Opening:
        data = None if opts.refresh else await self.lookup(fk)
        return Opening(data, self.ttl_left_ms(fk) if data is not None else 0)

    async def begin_many(
        self, fks: Sequence[FlightKeys], opts: Sequence[CallOptions], handles: Sequence[Any]
    ) -> list[Opening | FlightError]:
        return [await self.begin(fk, o, None) for fk, o in zip(fks, opts, strict=True)]

    async def abandon(self, fk: FlightKeys, opts: CallOptions, handle: Any) -> None:
        return None

    def release(self, handle: Any) -> None:
        return None

    async def resolve(
        self, fk: FlightKeys, job: Job, opts: CallOptions, handle: Any = None
    ) -> bytes:
        hit = None if opts.refresh else await self.lookup(fk)
        if hit is not None:
            self.stats.hits += 1
            return hit
        self.stats.misses += 1
        self.stats.loader_runs += 1
        token = self._running[fk.digest] = next(self._tokens)
        ran_from = self.clock()
        context = FlightContext(job.key, fk.digest, token, 1, clock=self.clock)
        started = start_work(job.run(None, context))
        try:
            data = await wait_bounded(started, opts.timeout_s, fk.digest, context.cancel)
        except FlightTimeout:
            self.stats.timeouts += 1
            raise
        except WorkCancelled:
            raise cancelled_loader_error(fk.digest) from None
        except (ValueTooLarge, SerializationError):
            raise
        except Exception as exc:
            self.stats.loader_errors += 1
            ttl_ms = error_ttl_ms(exc, opts) if opts.store else 0
            if ttl_ms > 0:
                self._put(fk, self.envelope.encode_error(exc), ttl_ms)
            raise
        finally:
            if self._running.get(fk.digest) == token:
                del self._running[fk.digest]
            marked = token in self._marked
            self._marked.discard(token)
        if marked:
            return data
        ttl_ms = opts.not_found_ttl_ms if data == NOT_FOUND_TAG else opts.ttl_ms
        if opts.store and ttl_ms > 0:
            jitter = random.uniform(-self.ttl_jitter, self.ttl_jitter)
            stored_at = self.clock()
            job.cost_ms = int((stored_at - ran_from) * 1000)
            self._put(fk, data, max(1, int(ttl_ms * (1 + jitter))))
            job.lease = (stored_at, self.ttl_left_ms(fk))
        return data

    async def replace(
        self, fk: FlightKeys, data: bytes | None, ttl_ms: int, if_token: int | None = None
    ) -> Invalidation:
        """Delete (``data`` None) or replace a stored result; one process, nothing to wait
        for. With ``if_token``, only while that token's flight runs (else ``LeaseLost``)."""
        if if_token is not None and self._running.get(fk.digest) != if_token:
            raise LeaseLost(
                f"token {if_token} is not the owner's of this key", key=fk.digest, token=if_token
            )
        running = self._running.get(fk.digest)
        if running is not None:
            self._marked.add(running)
        existed = self._store.pop(fk.digest, None) is not None
        if data is not None:
            self._put(fk, data, ttl_ms)
        elif not existed:
            return Invalidation("absent", 0, 0, 0.0)
        return Invalidation("acked", 0, 0, 0.0)

    async def inspect(self, fk: FlightKeys) -> FlightInfo:
        data = await self.lookup(fk)
        if data is not None:
            left = int((self._store[fk.digest][0] - self.clock()) * 1000)
            state = "error-cached" if self.envelope.is_error(data) else "cached"
            return FlightInfo(key=None, digest=fk.digest, state=state, result_ttl_ms=left)
        token = self._running.get(fk.digest)
        state = "running" if token is not None else "vacant"
        return FlightInfo(key=None, digest=fk.digest, state=state, token=token)

    async def aclose(self) -> None:
        self._store.clear()
