"""Deliberately broken builds, for showing that the checker catches what it claims.

A mutant edits the text of the library's Lua scripts in the worker process before the
``FlightCache`` is created (the scripts are ``Script`` objects whose ``.text`` is what gets
loaded and registered, and whose ``.sha``, where there is one, is what EVALSHA names); no
source file changes. Only the soak's workers apply them, and
only when asked with ``--mutant``.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

# The fence every owner write starts with: refuse unless the caller's token is meta's.
FENCE = re.compile(
    r"if not owns\(KEYS\[2\], ARGV\[1\], ARGV\[11\] or ''\) then\s*return 0\s*end\s*"
)
# renew_leases checks the token of each flight in its loop instead.
RENEW_FENCE = "if owns(meta, ARGV[4 * i - 3], ARGV[4 * i]) then"

MUTANTS = {
    "skip-fence": "complete_flight writes without checking the owner's token",
    "skip-fences": "complete_flight and renew_leases ignore the owner's token",
}


def _retext(script: Any, text: str) -> None:
    """Give a ``Script`` new text, and the SHA1 that EVALSHA names it by, if it keeps one."""
    script.text = text
    if hasattr(script, "sha"):
        digest = hashlib.sha1(text.encode()).hexdigest()
        script.sha = digest.encode() if isinstance(script.sha, bytes) else digest


def apply(name: str) -> None:
    """Patch the scripts of mutant ``name``; raises if a script no longer has the text the
    mutant removes (the library changed: the mutant must be brought up to date)."""
    from flightcache._protocol import flight

    if name not in MUTANTS:
        raise ValueError(f"unknown mutant {name!r}; known: {', '.join(MUTANTS)}")
    complete = flight.LUA["complete_flight"]
    text, found = FENCE.subn("", complete.text, count=1)
    if not found:
        raise RuntimeError("mutant skip-fence: complete_flight has no token check to remove")
    _retext(complete, text)
    if name == "skip-fences":
        renew = flight.LUA["renew_leases"]
        if RENEW_FENCE not in renew.text:
            raise RuntimeError("mutant skip-fences: renew_leases has no token check to remove")
        # Renew whatever meta exists (or nothing): a stale owner keeps its lease "alive".
        _retext(renew, renew.text.replace(RENEW_FENCE, "if true then"))
