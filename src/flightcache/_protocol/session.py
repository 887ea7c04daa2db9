"""This node's session on one server: the liveness of every flight it claimed there bound
to it (docs/protocol.md, "Sessions").

A flight's lease used to be renewed alone, every ``lease/3``: ten thousand owned flights
were ten thousand fenced renewals a second, each packed, sent, run and settled, and their
ticks were where the wake-ups of other flights waited. A bound flight lives while its
owner's session key holds the epoch it was bound to; one renewal a ``lease/3`` keeps all of
them, and each one's own keys need only a renewal every half of the backstop.

The rules that keep a stale owner from writing (the page says why each holds):

- a renewal never brings a lapsed session back (``renew_session`` creates only when told,
  and it is told only for an epoch no claim carries yet: claims bind only once ``ready``);
- when the session's proof runs out or a renewal is refused, every flight bound to it is
  given up at once and the epoch is never used again;
- a claim bound to an epoch that is no longer this node's live session is given back.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import Any

from .heartbeat import Lease, Renewer
from .renewer_thread import ThreadRenewer

log = logging.getLogger("flightcache.claim")

IDLE_LEASES = 3  # a session with no flight for this many leases ends (an idle node renews none)
START_AT_ONCE = 16  # owning this many flights at once starts a session without waiting


class Session:
    """One epoch of this node's session on a server, from its start to its end."""

    def __init__(self, key: str, lease_s: float, clock: Callable[[], float]) -> None:
        self.key = key
        self.lease_s = lease_s
        self.epoch = secrets.token_hex(8)
        self.ready = False  # its start was answered: claims may bind to it
        self.ended = False
        self.flights: set[Lease] = set()  # the leases of the flights bound to it
        self._clock = clock
        self.lease: Lease | None = None  # its own entry in the renewer's book

    @property
    def refused(self) -> bool:
        """Whether the server refused its renewal: the epoch then holds nothing there any
        more, and none of its flights, so their give-backs would be refused in turn (the
        same ``owns``) and none is sent."""
        return self.lease is not None and self.lease.refused

    def usable(self) -> bool:
        """Whether a claim sent now may bind to it: started, and proven for a while yet."""
        lease = self.lease
        return (
            self.ready
            and not self.ended
            and lease is not None
            and lease.proven_until - self._clock() > lease.interval_s
        )


class Sessions:
    """The session of one owner on one server: started with the first flight owned, renewed
    by the owner's renewer (one ``renew_session`` per tick), ended when lost or idle."""

    def __init__(
        self,
        key: str,
        lease_s: float,
        backstop_s: float,
        renewer: Renewer | ThreadRenewer,
        clock: Callable[[], float],
    ) -> None:
        self.key = key
        self.lease_s = lease_s
        self.backstop_s = backstop_s
        self._renewer = renewer
        self._clock = clock
        self.current: Session | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._starting: asyncio.TimerHandle | None = None
        self.owned = 0  # flights owned here now

    def binding(self, lease_ms: int) -> Session | None:
        """The session a claim sent now (with this lease) may bind to, if any."""
        session = self.current
        if session is None or int(session.lease_s * 1000) != lease_ms or not session.usable():
            return None
        return session

    def owning(self) -> None:
        """A flight is owned here. One still owned after a renewal interval starts the
        session (flights that end sooner never need one: a process of quick misses sends
        nothing more), and so does a burst of ``START_AT_ONCE`` owned at once; the claims
        made after it bind to it."""
        self.owned += 1
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self.current is not None and not self.current.ended:
            return
        if self.owned >= START_AT_ONCE:  # a burst: its later claims had better bind
            if self._starting is not None:
                self._starting.cancel()
                self._starting = None
            self._start()
        elif self._starting is None:
            loop = asyncio.get_running_loop()
            self._starting = loop.call_later(self.lease_s / 3, self._start_if_owning)

    def released(self) -> None:
        """A flight owned here ended: with none left for a while, the session ends."""
        self.owned -= 1
        if self.owned or self.current is None or self._idle is not None:
            return
        loop = asyncio.get_running_loop()
        self._idle = loop.call_later(self.lease_s * IDLE_LEASES, self._end_idle)

    def _start_if_owning(self) -> None:
        self._starting = None
        if self.owned and (self.current is None or self.current.ended):
            self._start()

    def _end_idle(self) -> None:
        self._idle = None
        session = self.current
        if session is not None and not session.flights and not self.owned:
            self.end(session, "idle")

    def _start(self) -> None:
        session = Session(self.key, self.lease_s, self._clock)
        work: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Due at once: its first renewal is its start (create).
        lease = self._renewer.add(
            work,
            lease_s=self.lease_s,
            digest=f"session {session.epoch}",
            granted_at=self._clock() - self.lease_s / 3,
            args=session,
            alone=True,
        )
        lease.on_give_up = lambda: self.end(session, lease.reason or "lost")
        session.lease = lease
        self.current = session

    def adopt(self, session: Session, lease: Lease) -> None:
        """On the loop: a flight a renewal bound to ``session`` after its claim
        (``renewals.py``) is one of its flights from now on, given up with it; at once if
        it ended meanwhile (the server may have let it lapse, and the flight with it)."""
        if lease._work.done():
            return  # it ended meanwhile (its writes were fenced by the session)
        if session.ended:
            lease.refused = session.refused
            lease.give_up("the session lapsed as the flight was bound to it")
            self._renewer.remove(lease)
            return
        session.flights.add(lease)

    def end(self, session: Session, reason: str) -> None:
        """The epoch ends for good: its flights are given up (their loaders cancelled) and
        no claim binds to it again."""
        if session.ended:
            return
        session.ended = True
        if self.current is session:
            self.current = None
        if session.lease is not None:
            self._renewer.remove(session.lease)
            work = session.lease._work
            if not work.done():
                work.cancel()
        flights, session.flights = session.flights, set()
        for lease in flights:
            lease.refused = session.refused
            lease.give_up(f"the session lapsed ({reason})")  # (its loader told first)
            self._renewer.remove(lease)
        if flights:
            log.warning(
                "session %s ended (%s): %d flights given up", session.epoch, reason, len(flights)
            )


class BoundProof:
    """An owned flight's proof as its loader sees it where a session may keep it: its own,
    and while it is bound (or being bound: ``renewals.Owned.session``) the earlier of its
    own and its session's."""

    __slots__ = ("_lease", "_owned")

    def __init__(self, lease: Lease, owned: Any) -> None:
        self._lease = lease
        self._owned = owned  # (a renewals.Owned: its session, read each time)

    @property
    def proven_until(self) -> float:
        own = self._lease.proven_until
        session: Session | None = self._owned.session
        if session is None:
            return own
        s = session.lease
        return min(own, s.proven_until) if s is not None and not session.ended else 0.0

    @property
    def on_give_up(self) -> Callable[[], None] | None:
        return self._lease.on_give_up

    @on_give_up.setter
    def on_give_up(self, value: Callable[[], None] | None) -> None:
        self._lease.on_give_up = value
