"""``FlightContext``: the flight's fencing token in the loader's hands.

A token protects only the stores that check it (docs/protocol.md, "The fencing token in the
loader's hands"). flightcache's own keys check it in every owner write; a loader that
declares one parameter gets a :class:`FlightContext` with the token, so it can hand it to
its own database or API and have a stale owner's writes refused there too. Whether a loader
wants one is read from its signature once per call site (its code object), not per call.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, cast

SIGNATURE_MEMO = 1_000  # loader code objects whose answer is remembered


class Proven(Protocol):
    """An owned flight's lease in the renewer (``heartbeat.Lease``)."""

    on_give_up: Callable[[], None] | None

    @property
    def proven_until(self) -> float:
        """Monotonic: the lease holds at least until then."""


class FlightContext:
    """What an owner's loader may know about its flight.

    ``token`` is the fencing token of this run (the one in the flight's meta; every write
    the owner makes carries it), ``attempt`` is 1 for the flight's first run and one more
    for each takeover, ``key`` is the caller's key and ``digest`` its digest. ``lease_left``
    is how long the lease is proven to hold from now (seconds, by this process's monotonic
    clock, from the last renewal the server confirmed; ``math.inf`` on ``memory://``,
    where nobody can take the flight over). ``cancelled`` turns true (and ``cancel_event``
    is set) when the run is called off: its lease was lost to another owner or could not be
    renewed, it ran past its ``timeout``, or the cache is closing. A loader that works in a
    thread, where cancellation cannot reach it, should check ``cancelled`` before it
    commits anything, and pass ``token`` to the store it writes (``fc.set(key, value,
    if_token=token)`` does exactly that for flightcache's own result).
    """

    __slots__ = ("_cancelled", "_clock", "_event", "_lease", "attempt", "digest", "key", "token")

    def __init__(
        self,
        key: Any,
        digest: str,
        token: int,
        attempt: int,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.key = key
        self.digest = digest
        self.token = token
        self.attempt = attempt
        self._cancelled = False
        self._event: asyncio.Event | None = None  # made when a loader asks for it
        self._lease: Proven | None = None  # None: no lease (memory://)
        self._clock = clock

    def track(self, lease: Proven) -> None:
        """Internal: the run's lease, as the renewer proves it; losing it cancels the run."""
        self._lease = lease
        lease.on_give_up = self.cancel

    @property
    def lease_left(self) -> float:
        """Seconds the lease is proven to hold from now (0 once it may have lapsed)."""
        if self._lease is None:
            return math.inf
        return max(0.0, self._lease.proven_until - self._clock())

    @property
    def cancel_event(self) -> asyncio.Event:
        """Set when the run is called off (``await ctx.cancel_event.wait()``)."""
        if self._event is None:
            self._event = asyncio.Event()
            if self._cancelled:
                self._event.set()
        return self._event

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Internal: the run is called off (idempotent)."""
        self._cancelled = True
        if self._event is not None:
            self._event.set()

    def __repr__(self) -> str:
        left = self.lease_left
        return (
            f"FlightContext(digest={self.digest!r}, token={self.token}, attempt={self.attempt}, "
            f"lease_left={left if math.isinf(left) else round(left, 3)}, "
            f"cancelled={self.cancelled})"
        )


_wants: dict[Any, bool] = {}


def wants_context(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` declares exactly one required positional parameter (it is handed a
    ``FlightContext``); a parameter with a default (``lambda v=v: ...``) does not count.

    Asked once per call site: functions and bound methods are remembered by their code
    object (a closure made anew for each call shares it), ``functools.partial`` objects by
    their function's code and what they bind; other callables are read each time.
    """
    memo: Any = None
    if isinstance(fn, functools.partial):
        code = getattr(fn.func, "__code__", None)
        if code is not None and getattr(fn.func, "__wrapped__", None) is None:
            memo = (code, len(fn.args), tuple(sorted(fn.keywords)))
    elif getattr(fn, "__wrapped__", None) is None:  # a decorator's wrapper hides the real one
        memo = getattr(fn, "__code__", None)
        if memo is None:
            func = getattr(fn, "__func__", None)  # a bound method: its self is bound
            code = getattr(func, "__code__", None)
            memo = (code, "bound") if code is not None else None
    if memo is not None:
        known = _wants.get(memo)
        if known is not None:
            return known
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called as before
        answer = False
    else:
        required = [
            p
            for p in params
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        ]
        answer = len(required) == 1
    if memo is not None:
        if len(_wants) >= SIGNATURE_MEMO:
            _wants.clear()
        _wants[memo] = answer
    return answer


def invoke(loader: Callable[..., Awaitable[Any]], context: FlightContext | None) -> Awaitable[Any]:
    """``loader(context)``, or ``loader()`` when ``context`` is None (it wants none)."""
    if context is None:
        return cast("Callable[[], Awaitable[Any]]", loader)()
    return cast("Callable[[FlightContext], Awaitable[Any]]", loader)(context)
