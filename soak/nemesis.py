"""The nemesis: seeded faults against the workers, their links and the server, each logged
with its time in ``nemesis.jsonl``.

Faults (each with its own undo, scheduled when it is injected):

- ``kill``: SIGKILL a worker; a new process takes its place 0.2-1 s later;
- ``stop``: SIGSTOP a worker, SIGCONT it later (often past a lease, so that its flights are
  taken over while it sleeps);
- ``stop-owner``: the same, aimed at a worker whose loader is running (the nemesis follows
  the runs' records as they are written), for longer than a lease: a stale owner that
  wakes with its loader done, the case fencing is for;
- ``restart``: SIGKILL the one server and start it again on the same port, empty;
- ``failover``: SIGKILL a Cluster master; once its replica serves its slots, the node is
  started again in place and rejoins as a replica; one failover at a time;
- ``cut``: drop every connection of a worker's link and refuse new ones, then heal;
- ``slow``: delay every reply on a worker's link, then back to none.
"""

from __future__ import annotations

import heapq
import itertools
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from flightcache import EmbeddedServer

from . import servers
from .proxy import Links
from .records import Journal

ROOT = Path(__file__).resolve().parent.parent

# Relative weights of each fault; a profile's faults that do not apply (cut and slow on a
# Cluster, which clients reach directly) are dropped, restart becomes failover there.
PROFILES: dict[str, dict[str, float]] = {
    "mixed": {"kill": 2, "stop": 2, "stop-owner": 2, "restart": 1, "cut": 2, "slow": 2},
    "stops": {"stop": 1, "stop-owner": 6, "kill": 1},
    "none": {},
}
# Seconds between two faults, per profile.
GAPS: dict[str, tuple[float, float]] = {
    "mixed": (0.4, 1.6),
    "stops": (0.4, 1.2),
    "none": (1.0, 1.0),
}


class Fleet:
    """The worker processes, by index; a killed one is replaced by a new process."""

    def __init__(self, folder: Path, configs: list[dict[str, Any]]) -> None:
        self.folder = folder
        self.configs = configs
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * len(configs)
        self.incarnations = [0] * len(configs)

    def start(self, i: int) -> int:
        cfg = dict(self.configs[i], incarnation=self.incarnations[i])
        self.incarnations[i] += 1
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        log = (self.folder / f"worker-w{i}-{self.incarnations[i]}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "soak.worker", orjson.dumps(cfg).decode()],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
        log.close()
        self.procs[i] = proc
        return proc.pid

    def alive(self, i: int) -> bool:
        proc = self.procs[i]
        return proc is not None and proc.poll() is None

    def pid(self, i: int) -> int:
        proc = self.procs[i]
        assert proc is not None
        return proc.pid

    def signal(self, i: int, sig: int) -> None:
        if self.alive(i):
            os.kill(self.pid(i), sig)

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def wait_all(self, deadline: float) -> list[int]:
        """Wait for every worker to exit by ``deadline``; returns the indexes killed then."""
        killed = []
        for i, proc in enumerate(self.procs):
            if proc is None:
                continue
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait(5)
                killed.append(i)
        return killed


class OpenRuns:
    """The loader runs under way now, from the workers' runs files as they grow."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._offsets: dict[Path, int] = {}
        self.open: dict[str, dict[str, Any]] = {}  # run id -> its start record

    def scan(self) -> dict[str, dict[str, Any]]:
        for path in self.folder.glob("runs-*.jsonl"):
            with path.open("rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            whole = data[: data.rfind(b"\n") + 1]
            self._offsets[path] = self._offsets.get(path, 0) + len(whole)
            for line in whole.splitlines():
                r = orjson.loads(line)
                if r["ev"] == "start" and r["kind"] == "do":
                    self.open[r["run"]] = r
                elif r["ev"] in ("end", "cancelled"):
                    self.open.pop(r["run"], None)
        return self.open


@dataclass(order=True)
class _Action:
    at: float
    seq: int
    fn: Callable[[], None] = field(compare=False)
    restore: bool = field(compare=False, default=False)  # run it at the end, whatever the time


class Nemesis:
    def __init__(
        self,
        *,
        rng: random.Random,
        log: Journal,
        fleet: Fleet,
        profile: str,
        links: Links | None = None,
        server: EmbeddedServer | None = None,
        cluster: list[EmbeddedServer] | None = None,
    ) -> None:
        self.rng = rng
        self.log = log
        self.fleet = fleet
        self.links = links
        self.server = server
        self.cluster = cluster
        weights = dict(PROFILES[profile])
        if cluster is not None:
            if "restart" in weights:
                weights["failover"] = weights.pop("restart")
            weights.pop("cut", None)
            weights.pop("slow", None)
        self.weights = weights
        self.gap = GAPS[profile]
        self._queue: list[_Action] = []
        self._seq = itertools.count()
        self.stopped: dict[int, int] = {}  # worker index -> the pid stopped
        self.cut: set[int] = set()
        self.slowed: set[int] = set()
        self.restarting: set[int] = set()
        self.server_down = False
        self.cluster_busy = False
        self.counts: dict[str, int] = {}
        self.runs = OpenRuns(fleet.folder)
        self._retry: str | None = None  # a fault drawn that found no target yet
        self._tries = 0

    # -- scheduling -----------------------------------------------------------------------

    def later(self, delay: float, fn: Callable[[], None], restore: bool = False) -> None:
        heapq.heappush(self._queue, _Action(time.monotonic() + delay, next(self._seq), fn, restore))

    def note(self, kind: str, **fields: Any) -> None:
        self.log.write(t=time.monotonic(), kind=kind, **fields)

    def run_until(self, t_end: float) -> None:
        next_fault = time.monotonic() + self.rng.uniform(*self.gap)
        while True:
            now = time.monotonic()
            if now >= t_end:
                return
            while self._queue and self._queue[0].at <= now:
                heapq.heappop(self._queue).fn()
            if self.weights and now >= next_fault:
                # (no target for the fault drawn, e.g. no loader running: try again soon)
                injected = self.inject()
                next_fault = now + (self.rng.uniform(*self.gap) if injected else 0.05)
            wake = min([t_end, next_fault] + ([self._queue[0].at] if self._queue else []))
            time.sleep(max(0.005, wake - time.monotonic()))

    def finish(self) -> None:
        """Undo every fault still in force (workers go on, the server is up), drop the rest."""
        queue, self._queue = sorted(self._queue), []
        for action in queue:
            if action.restore:
                action.fn()
        self._queue = []  # (what those scheduled in turn: polls)
        for i in range(len(self.fleet.procs)):
            self.fleet.signal(i, signal.SIGCONT)  # (harmless to a running process)
        for node in self.cluster or []:
            if not servers.alive(node):
                servers.restart(node)
                self.note("node-up", port=node.port)
        self.note("end")

    # -- faults ---------------------------------------------------------------------------

    def inject(self) -> bool:
        kind = self._retry
        if kind is None:
            kinds = list(self.weights)
            kind = self.rng.choices(kinds, [self.weights[k] for k in kinds])[0]
            self._retry, self._tries = kind, 0
        self._tries += 1
        if self._tries >= 20:  # (a fault with no target for 1 s: draw another)
            self._retry = None
        injected = bool(getattr(self, "_" + kind.replace("-", "_"))())
        if injected:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self._retry = None
        return injected

    def _pick(self, exclude: set[int]) -> int | None:
        choices = [
            i
            for i in range(len(self.fleet.procs))
            if self.fleet.alive(i) and i not in exclude and i not in self.restarting
        ]
        return self.rng.choice(choices) if choices else None

    def _kill(self) -> bool:
        i = self._pick(set())
        if i is None:
            return False
        pid = self.fleet.pid(i)
        self.fleet.kill(i)
        self.stopped.pop(i, None)
        self.restarting.add(i)
        self.note("kill", w=i, pid=pid)

        def restart() -> None:
            self.restarting.discard(i)
            self.note("restart-worker", w=i, pid=self.fleet.start(i))

        self.later(self.rng.uniform(0.2, 1.0), restart)
        return True

    def _stop_owner(self) -> bool:
        """SIGSTOP a worker in the middle of one of its loaders, for longer than a lease."""
        now = time.monotonic()
        live = {
            i: self.fleet.pid(i)
            for i in range(len(self.fleet.procs))
            if self.fleet.alive(i) and i not in self.stopped and i not in self.restarting
        }
        owners = [
            (r["run"], i)
            for r in self.runs.scan().values()
            for i, pid in live.items()
            if r["run"].startswith(f"w{i}.{pid}.") and now - r["t"] < 0.3
        ]
        if not owners:
            return False
        run, i = self.rng.choice(sorted(owners))
        return self._stop(i, run, self.rng.uniform(3.0, 5.0))

    def _stop(self, i: int | None = None, run: str | None = None, pause: float = 0.0) -> bool:
        if i is None:
            i = self._pick(set(self.stopped))
        if i is None:
            return False
        pid = self.fleet.pid(i)
        self.fleet.signal(i, signal.SIGSTOP)
        self.stopped[i] = pid
        self.note("stop", w=i, pid=pid, **({"run": run} if run else {}))

        def cont() -> None:
            if self.stopped.get(i) != pid:
                return  # killed meanwhile (a new process may be stopped by now: not ours)
            del self.stopped[i]
            if self.fleet.alive(i) and self.fleet.pid(i) == pid:
                self.fleet.signal(i, signal.SIGCONT)
                self.note("cont", w=i, pid=pid)

        self.later(pause or self.rng.uniform(0.3, 4.0), cont, restore=True)
        return True

    def _restart(self) -> bool:
        if self.server is None or self.server_down:
            return False
        servers.kill(self.server)
        self.server_down = True
        self.note("server-down", port=self.server.port)

        def up() -> None:
            servers.restart(self.server)  # type: ignore[arg-type]
            self.server_down = False
            self.note("server-up")

        self.later(self.rng.uniform(0.2, 1.5), up, restore=True)
        return True

    def _failover(self) -> bool:
        if self.cluster is None or self.cluster_busy:
            return False
        candidates = servers.masters(self.cluster)
        if not candidates:
            return False
        victim = self.rng.choice(candidates)
        servers.kill(victim)
        self.cluster_busy = True
        self.note("failover", port=victim.port)
        self._poll_serving(victim, len(candidates), time.monotonic())
        return True

    def _poll_serving(self, victim: EmbeddedServer, shards: int, since: float) -> None:
        """Once a replica serves the victim's slots, start the victim again (it rejoins as
        a replica), and wait for the cluster to settle before the next failover."""
        assert self.cluster is not None
        if servers.taken_over(self.cluster, victim, shards) or time.monotonic() - since > 30:
            self.note("cluster-serving")

            def back() -> None:
                if not servers.alive(victim):
                    servers.restart(victim)
                    self.note("node-up", port=victim.port)
                self._poll_settled(time.monotonic())

            self.later(0.3, back, restore=True)
            return
        self.later(0.2, lambda: self._poll_serving(victim, shards, since), restore=True)

    def _poll_settled(self, since: float) -> None:
        assert self.cluster is not None
        if servers.settled(self.cluster) or time.monotonic() - since > 30:
            self.cluster_busy = False
            self.note("cluster-settled")
            return
        self.later(0.25, lambda: self._poll_settled(since))

    def _cut(self) -> bool:
        if self.links is None:
            return False
        i = self._pick(self.cut)
        if i is None:
            return False
        self.links.cut(f"w{i}")
        self.cut.add(i)
        self.note("cut", w=i)

        def heal() -> None:
            assert self.links is not None
            self.links.heal(f"w{i}")
            self.cut.discard(i)
            self.note("heal", w=i)

        self.later(self.rng.uniform(0.2, 3.0), heal, restore=True)
        return True

    def _slow(self) -> bool:
        if self.links is None:
            return False
        i = self._pick(self.slowed)
        if i is None:
            return False
        delay = round(self.rng.uniform(0.02, 0.3), 3)
        self.links.slow(f"w{i}", delay)
        self.slowed.add(i)
        self.note("slow", w=i, s=delay)

        def fast() -> None:
            assert self.links is not None
            self.links.slow(f"w{i}", 0.0)
            self.slowed.discard(i)
            self.note("fast", w=i)

        self.later(self.rng.uniform(1.0, 4.0), fast, restore=True)
        return True
