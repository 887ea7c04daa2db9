"""``python -m soak``: a fault soak of flightcache, then a check of every record.

Exits 0 when the checker finds no violation, 1 when it finds any, 2 when the run itself
could not be made (a server or worker did not start). See docs/faults.md, "The fault soak".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import traceback
from pathlib import Path

from . import checker
from .mutants import MUTANTS
from .nemesis import PROFILES
from .run import Options, run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m soak", description=__doc__)
    p.add_argument("--seconds", type=float, default=150.0, help="length of the run (150)")
    p.add_argument("--seed", type=int, default=None, help="the nemesis's seed (random)")
    p.add_argument("--cluster", action="store_true", help="a 3+3 Cluster, not one server")
    p.add_argument("--workers", type=int, default=4, help="worker processes (4)")
    p.add_argument("--nemesis", choices=sorted(PROFILES), default="mixed")
    p.add_argument("--mutant", choices=sorted(MUTANTS), help="a broken build (for tests)")
    p.add_argument("--dir", help="keep the records here (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the records even if all is well")
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON here")
    p.add_argument("--check", metavar="DIR", help="only check the records of an earlier run")
    p.add_argument("--show", type=int, default=5, help="violations shown per check (5)")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.workers < 2:
        p.error("need --seconds > 0 and at least 2 workers")
    return args


def table(report: checker.Report) -> str:
    lines = []
    kinds = sorted(report.ops, key=lambda k: -sum(report.ops[k].values()))
    lines.append(f"{'operation':<12}{'count':>8}{'ok':>8}  errors")
    for kind in kinds:
        c = report.ops[kind]
        errors = ", ".join(f"{t} {n}" for t, n in c.most_common() if t != "ok") or "-"
        lines.append(f"{kind:<12}{sum(c.values()):>8}{c['ok']:>8}  {errors}")
    lines.append("")
    lines.append(f"{'fault':<24}{'injected':>9}")
    names = {
        "kill": "SIGKILL worker",
        "stop": "SIGSTOP worker",
        "stop-owner": "SIGSTOP owner mid-loader",
        "server-down": "server restart",
        "failover": "Cluster failover",
        "cut": "link cut",
        "slow": "link latency",
    }
    for kind, name in names.items():
        if report.faults.get(kind) or kind in ("kill", "stop"):
            lines.append(f"{name:<24}{report.faults.get(kind, 0):>9}")
    lines.append("")
    lines.append(f"{'check':<64}{'violations':>11}")
    for name, what in checker.CHECKS.items():
        lines.append(f"{name + ': ' + what:<64}{len(report.violations[name]):>11}")
    for why, n in report.excused.items():
        lines.append(f"  excused, {why}: {n}")
    f = report.figures
    hit = ", ".join(f"{k} {n}" for k, n in f["owner_faults_by_kind"].items())
    lines.append("")
    lines.append(
        f"loader runs {f['loader_runs']}, flights {f['flights']}, runs hit by a fault "
        f"{f['owner_faults']} ({hit}), runs whose value a caller got {f['runs_received']}; "
        f"invalidations {f['invalidations']}; wait p50 {f['wait_p50_s']} s, "
        f"max {f['wait_max_s']} s (bound {f['bound_s']:g} s)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check:
        folder, report = Path(args.check), checker.check(Path(args.check))
    else:
        seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(3), "big")
        opts = Options(
            seconds=args.seconds,
            seed=seed,
            cluster=args.cluster,
            workers=args.workers,
            nemesis=args.nemesis,
            mutant=args.mutant,
            directory=args.dir,
        )
        try:
            folder, report = run(opts)
        except Exception:  # the run could not be made: no verdict on the library
            traceback.print_exc()
            print("soak: the run could not be made", file=sys.stderr)
            return 2
    print(table(report))
    for name in checker.CHECKS:
        for v in report.violations[name][: args.show]:
            print(v)
    if args.json:
        Path(args.json).write_text(json.dumps(report.summary(), indent=1))
    if report.ok and not (args.keep or args.dir or args.check):
        shutil.rmtree(folder, ignore_errors=True)
    else:
        print(f"records: {folder}")
    print("soak: OK" if report.ok else "soak: VIOLATIONS")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
