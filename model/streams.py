"""Stream flights (``fc.stream``, ``_protocol/streaming.py``, ``jobs.py`` ``StreamJob``): the
owner's fenced ``append_chunks``, the chunks a process's readers were shown, and the new
generation (``StreamRestarted``) a takeover starts.

A chunk is ``(claim, seq)``: the claim (flight attempt) whose run produced it, and its
sequence number. A process keeps the chunks its readers were shown, as its ``LocalStream``
does; the checks here are the invariant ``stream_chunks_one_attempt``: they are all of one
attempt, in order from 0, and the list a reader ends with is that of the flight whose end it
took (or the reader was told ``StreamRestarted``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .state import Entry, Proc

if TYPE_CHECKING:
    from .model import Model


def _one_attempt(chunks: tuple[tuple[int, int], ...]) -> bool:
    return all(c == (chunks[0][0], i) for i, c in enumerate(chunks))


def check(pid: int, proc: Proc, why: list[str]) -> None:
    if not _one_attempt(proc.chunks):
        shown = ", ".join(f"{s}/flight {c}" for c, s in proc.chunks)
        why.append(
            f"stream_chunks_one_attempt: p{pid}'s readers were shown chunks of more than one "
            f"flight attempt, or out of order: {shown}"
        )


def new_generation(m: Model, proc: Proc, claim: int) -> Proc:
    """``LocalStream`` starts a new generation for flight ``claim`` (a takeover's 'claimed'
    read, a join that answers another claim, this process claiming): the chunks of another
    attempt are dropped, and a reader that was shown some is told ``StreamRestarted``.
    Mutant ``no-restart`` keeps them."""
    if not proc.chunks or proc.chunks[0][0] == claim or m.mutant == "no-restart":
        return proc
    return proc._replace(chunks=(), restarted=True)


def apply_chunk(pid: int, proc: Proc, e: Entry, why: list[str]) -> Proc:
    """A chunk entry: added when its sequence number is the count held, else skipped (one
    already held, or one past a gap that the stored list fills at the end)."""
    if e.v != len(proc.chunks):
        return proc
    proc = proc._replace(chunks=(*proc.chunks, (e.tok, e.v)))
    check(pid, proc, why)
    return proc


def end(m: Model, pid: int, proc: Proc, claim: int, n: int, why: list[str]) -> Proc:
    """The flight ``claim`` ended with ``n`` chunks: a process that holds ``n`` is finished
    with what it holds; otherwise it takes the list itself (``v`` or a ``GET``), a new
    generation if what its readers were shown is not where that list begins."""
    if len(proc.chunks) == n:
        if any(c != claim for c, _s in proc.chunks):
            why.append(
                f"stream_chunks_one_attempt: p{pid} ends flight {claim}'s stream with the "
                f"chunks of flight {proc.chunks[0][0]}"
            )
        return proc
    proc = new_generation(m, proc, claim)
    return proc._replace(chunks=tuple((claim, s) for s in range(n)))
