"""The wake channel: followers of any number of flights wait on one subscription per server.

The scripts that append to a flight's stream publish what they appended to every node
queued in the flight's waiters list (``_protocol/lua/_wake.lua``). The :class:`WakeHub` of a
process hears its node's channel and hands each message to the :class:`Waiter` of its
digest; a follower waits on its waiter with no connection held. docs/protocol.md ("The
wake channel") gives the argument why no wake-up is lost: in short, a waiter exists before
its join is sent, a message out of step or a reconnect makes the follower re-read its
stream from its cursor, and an owner that publishes nothing is found by the lease-bounded
re-check.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from .._backends.listener import Listener

log = logging.getLogger("flightcache.follow")

Entry = tuple[bytes, dict[bytes, bytes]]


# A chunk entry's field count and first three fields as ``add_chunks`` writes them
# (``_chunks.lua``): such an entry is read as four netstrings (id, token, number, value), not
# ten. A message is parsed for every few chunks a follower gets.
_CHUNK_HEAD = b"1:81:t5:chunk3:tok"
_T, _CHUNK, _TOK, _S, _V = b"t", b"chunk", b"tok", b"s", b"v"


def parse_message(data: bytes) -> tuple[str, bytes, list[Entry]]:
    """``digest, prev, entries`` of one wake message (netstrings; see ``_wake.lua``);
    ValueError when it is not one."""
    find, end = data.index, len(data)

    def take(pos: int) -> tuple[bytes, int]:
        colon = find(b":", pos)
        size = int(data[pos:colon])
        stop = colon + 1 + size
        if size < 0 or stop > end:
            raise ValueError("a netstring runs past the end of the message")
        return data[colon + 1 : stop], stop

    digest, pos = take(0)
    prev, pos = take(pos)
    entries: list[Entry] = []
    while pos < end:
        entry_id, pos = take(pos)
        if data.startswith(_CHUNK_HEAD, pos):
            token, at = take(pos + len(_CHUNK_HEAD))
            if data.startswith(b"1:s", at):
                seq, at = take(at + 3)
                if data.startswith(b"1:v", at):
                    value, pos = take(at + 3)
                    entries.append((entry_id, {_T: _CHUNK, _TOK: token, _S: seq, _V: value}))
                    continue
        count, pos = take(pos)  # any other entry: its field count, then names and values
        flat = []
        for _ in range(int(count)):
            item, pos = take(pos)
            flat.append(item)
        entries.append((entry_id, dict(zip(flat[::2], flat[1::2], strict=True))))
    return digest.decode(), prev, entries


def entry_key(entry_id: bytes) -> tuple[int, int]:
    """A stream entry id as a comparable pair (``ms-seq``)."""
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)


class Waiter:
    """One follower's mailbox for one digest: messages in arrival order, whether the
    follower must re-read its stream (a message may have been missed), and whether it must
    join again (``due``: its lease re-check found the claim gone, or its wait bound ran
    out; ``rechecks.py``)."""

    __slots__ = ("_future", "digest", "due", "gap", "hub", "mark", "messages")

    def __init__(self, hub: WakeHub, digest: str, gap: bool) -> None:
        self.hub = hub
        self.digest = digest
        # the hub's gaps when the join whose answer is followed now was sent (at the latest:
        # first the waiter's making, before its first join; see ``Rechecks``)
        self.mark = hub.gaps
        self.messages: list[tuple[bytes, list[Entry]]] = []
        self.gap = gap
        self.due = False
        self._future: asyncio.Future[None] | None = None  # while someone waits (hits never)

    def _wake(self) -> None:
        future = self._future
        if future is not None and not future.done():
            future.set_result(None)

    def push(self, prev: bytes, entries: list[Entry]) -> None:
        self.messages.append((prev, entries))
        self._wake()

    def lost(self) -> None:
        self.gap = True
        self._wake()

    def recheck(self) -> None:
        self.due = True
        self._wake()

    @property
    def news(self) -> bool:
        return self.gap or bool(self.messages)

    async def wait(self) -> None:
        """Until there is news or a re-check is due. A future and nothing else (no timer: the
        bound is kept by ``Rechecks``; no task, no ``wait_for``): a wake-up is one step of
        the loop for the follower, which counts when ten thousand of them come at once."""
        if self.due or self.gap or self.messages:
            return
        future = self._future = asyncio.get_running_loop().create_future()
        try:
            await future
        finally:
            self._future = None

    def take(self) -> tuple[bool, list[tuple[bytes, list[Entry]]]]:
        gap, messages = self.gap, self.messages
        self.gap, self.messages = False, []
        return gap, messages

    def take_due(self) -> bool:
        due, self.due = self.due, False
        return due


class WakeHub:
    """This node's wake channel on one server, and the waiters of this process on it."""

    def __init__(self, listener: Listener, channel: str) -> None:
        self.listener = listener
        self.channel = channel
        self._waiters: dict[str, list[Waiter]] = {}
        self.heard = 0
        self.gaps = 0  # gaps so far (a reconnect, a new subscription)
        # called on every gap after the waiters were flagged (bound flights are joined again)
        self.gap_hooks: list[Callable[[], None]] = []
        listener.add(channel, self._on_message, self._on_gap)

    def watch(self, digest: str) -> Waiter:
        """A waiter for ``digest``; made before the join whose events it must not miss."""
        waiter = Waiter(self, digest, gap=not self.listener.subscribed)
        self._waiters.setdefault(digest, []).append(waiter)
        return waiter

    def unwatch(self, waiter: Waiter) -> None:
        waiters = self._waiters.get(waiter.digest)
        if waiters is not None and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiters[waiter.digest]

    def __len__(self) -> int:
        return sum(len(w) for w in self._waiters.values())

    def _on_message(self, data: bytes) -> None:
        try:
            digest, prev, entries = parse_message(data)
        except (ValueError, IndexError, UnicodeDecodeError):
            log.warning("wake channel %s: malformed message ignored", self.channel)
            return
        self.heard += 1
        for waiter in self._waiters.get(digest, ()):
            waiter.push(prev, entries)

    def _on_gap(self) -> None:
        self.gaps += 1
        for waiters in self._waiters.values():
            for waiter in waiters:
                waiter.lost()
        for hook in self.gap_hooks:
            hook()
