"""``python -m model``: check the protocol model over its scopes.

Without arguments, the small scopes (the test suite's); ``--large`` adds the larger ones
(``make model``); ``--sessions`` runs only the scopes of session leases
(docs/protocol.md, "Sessions"). ``--mutant NAME`` checks one mutant in the
scope that catches it and prints its counterexample; ``--known-issue NAME`` models the code
where the model found a bug, before its fix (``late-liveness``: 28bd9ef; ``news-drop``:
ecab0e6), and prints that trace.
"""

from __future__ import annotations

import argparse
import sys

from .check import INVARIANTS, LIVENESS, SESSION_INVARIANTS, Result, check
from .model import KNOWN_ISSUES, MUTANTS, Model
from .scopes import ALL, KNOWN_ISSUE_SCOPES, LARGE, MUTANT_SCOPES, SMALL
from .scopes import LIVENESS as LIVE_SCOPES


def report(res: Result, *, verbose: bool = True) -> None:
    what = f"{res.scope}" + (f" [mutant {res.mutant}]" if res.mutant else "")
    limit = "" if res.complete else " (state limit reached: NOT exhaustive)"
    print(
        f"{what}: {res.states:,} states, {res.transitions:,} transitions, depth "
        f"{res.depth}, {res.seconds:.1f} s{limit}"
    )
    if res.violation:
        print(f"  VIOLATED {res.violation}")
        print(f"  shortest trace ({len(res.trace)} steps):")
        for i, step in _numbered(res.trace, res.tick_s):
            print(f"    {i:>5}. {step}")
    elif verbose:
        more = SESSION_INVARIANTS if ALL[res.scope].sessions else {}
        for name in (*INVARIANTS, *more):
            print(f"  holds  {name}")
    for name, verdict in res.liveness.items():
        print(f"  {'holds ' if verdict == 'holds' else 'FAILS '} {name} ({verdict})")
    if res.liveness and not res.ok and res.trace:
        print(f"  a shortest way there ({len(res.trace) - 1} steps):")
        for i, step in _numbered(res.trace, res.tick_s):
            print(f"    {i:>5}. {step}")
    sys.stdout.flush()


def _numbered(trace: list[str], tick_s: float) -> list[tuple[str, str]]:
    """The steps, numbered; a run of ticks is one line (``5-12. 8 ticks pass (2 s)``)."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(trace):
        j = i
        while j < len(trace) and trace[j] == "tick":
            j += 1
        if j - i > 1:
            out.append((f"{i + 1}-{j}", f"{j - i} ticks pass ({(j - i) * tick_s:g} s)"))
            i = j
        else:
            out.append((str(i + 1), trace[i]))
            i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model", description=__doc__)
    parser.add_argument("--mutant", choices=sorted(MUTANTS), help="remove one safeguard")
    parser.add_argument(
        "--known-issue", choices=sorted(KNOWN_ISSUES), help="the code with a bug the model found"
    )
    parser.add_argument("--scope", choices=sorted(ALL), action="append", help="run only these")
    parser.add_argument("--large", action="store_true", help="also the larger scopes")
    parser.add_argument(
        "--sessions",
        action="store_true",
        help="only the scopes of session leases (docs/protocol.md, Sessions), small and large",
    )
    parser.add_argument("--max-states", type=int, default=0, help="stop after this many")
    parser.add_argument(
        "--no-peek",
        action="store_true",
        help="a follower's re-check as before 0cfd53e: join_flight at once, no peek_flight",
    )
    parser.add_argument(
        "--no-watch",
        action="store_true",
        help="a follower of a bound flight keeps one timer (peek_flight answering the "
        "session's TTL), not the session's and the flight's (followers watch sessions)",
    )
    parser.add_argument(
        "--notice-across-faults",
        action="store_true",
        help="check follower_notices_within_lease across a server restart or failover too",
    )
    parser.add_argument("--list", action="store_true", help="list scopes and invariants")
    args = parser.parse_args(argv)
    if args.list:
        for scope in ALL.values():
            print(f"{scope.name}: {scope.doc}\n    {scope.describe()}")
        for name, text in {**INVARIANTS, **SESSION_INVARIANTS, **LIVENESS}.items():
            print(f"{name}: {text}")
        for name, text in MUTANTS.items():
            print(f"mutant {name} (scope {MUTANT_SCOPES[name]}): {text}")
        return 0
    if args.mutant or args.known_issue:
        name = args.mutant or args.known_issue
        scope_name = (args.scope or [(MUTANT_SCOPES | KNOWN_ISSUE_SCOPES)[name]])[0]
        known = frozenset({args.known_issue}) if args.known_issue else frozenset()
        scope = ALL[scope_name]
        res = check(
            Model(
                scope,
                args.mutant or "",
                known,
                peek=not args.no_peek,
                watch=not args.no_watch,
                notice_across_faults=args.notice_across_faults,
            ),
            max_states=args.max_states,
            liveness=not scope.symmetry,
        )
        report(res, verbose=False)
        if res.ok:
            print("  no counterexample found: the checker missed this mutant")
            return 1
        return 0
    if args.scope:
        scopes = [ALL[n] for n in args.scope]
    elif args.sessions:
        scopes = [s for s in ALL.values() if s.sessions]
    else:
        scopes = [*SMALL, *LIVE_SCOPES, *(LARGE if args.large else ())]
    failed = False
    for scope in scopes:
        res = check(
            Model(
                scope,
                peek=not args.no_peek,
                watch=not args.no_watch,
                notice_across_faults=args.notice_across_faults,
            ),
            max_states=args.max_states,
            liveness=not scope.symmetry,
        )
        report(res)
        failed |= not res.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
