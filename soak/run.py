"""One soak run: start the server (or Cluster), the links and the workers; let the nemesis
loose until the end; undo its faults; let the workers finish; check the records."""

from __future__ import annotations

import contextlib
import json
import random
import secrets
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flightcache import EmbeddedServer
from flightcache._backends.embedded import EmbeddedCluster, free_port

from . import checker
from .nemesis import Fleet, Nemesis
from .proxy import Links
from .records import Journal

# FlightCache settings of every worker: short leases and timeouts, so that takeovers,
# expiries and waits happen many times in a short run.
CACHE = {
    "lease": 2.0,
    "timeout": 3.0,
    "socket_timeout": 2.0,
    "near_lease": 2.0,
    "node_ttl": 3.0,
    "max_connections": 32,
}
WORKLOAD: dict[str, Any] = {
    "clients": 4,
    "do_keys": ["d0", "d1", "d2", "d3"],
    "stream_keys": ["s0", "s1"],
    "weights": {"do": 5, "get": 2, "stream": 2, "invalidate": 1.5, "set": 1},
    # A loader is one timer, under a third of the lease (see worker.Worker.loader).
    "loader_s": [0.1, 0.5],
    "chunks": [2, 4],
    "chunk_s": [0.03, 0.12],
    "ttl_s": [2.5, 6.0],
    "think_s": [0.0, 0.2],
}


@dataclass
class Options:
    seconds: float = 150.0
    seed: int = 0
    cluster: bool = False
    workers: int = 4
    nemesis: str = "mixed"
    mutant: str | None = None
    directory: str | None = None
    slack_s: float = 5.0  # beyond the documented wait bound, for a loaded machine
    cache: dict[str, float] = field(default_factory=lambda: dict(CACHE))


def drain_s(cache: dict[str, float]) -> float:
    """How long an operation under way at the end may still take: its wait bound."""
    return 2 * (cache["timeout"] + cache["lease"]) + 1.0 + 2.0


def run(opts: Options, say: Any = print) -> tuple[Path, checker.Report]:
    folder = Path(opts.directory or tempfile.mkdtemp(prefix="flightcache-soak-"))
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(opts.seed)
    namespace = f"soak-{opts.seed}-{secrets.token_hex(3)}"
    log = Journal(folder / "nemesis.jsonl")
    with contextlib.ExitStack() as stack:
        links: Links | None = None
        server: EmbeddedServer | None = None
        cluster: EmbeddedCluster | None = None
        if opts.cluster:
            cluster = EmbeddedCluster(masters=3, replicas=1).start()
            stack.callback(cluster.stop)
            urls = [cluster.url] * opts.workers
        else:
            server = EmbeddedServer(port=free_port()).start()
            stack.callback(server.stop)
            links = Links(server.host, server.port)
            stack.callback(links.close)
            urls = [f"redis://127.0.0.1:{links.add(f'w{i}')}/0" for i in range(opts.workers)]
        base = dict(
            WORKLOAD,
            namespace=namespace,
            dir=str(folder),
            seed=opts.seed,
            cache=opts.cache,
            mutant=opts.mutant,
            drain_s=drain_s(opts.cache),
        )
        fleet = Fleet(folder, [dict(base, url=urls[i], worker=i) for i in range(opts.workers)])
        stack.callback(fleet.wait_all, 0.0)  # whatever happens, no worker outlives the run
        pids = [fleet.start(i) for i in range(opts.workers)]
        deadline = time.monotonic() + 60
        while not all((folder / f"ready-w{i}-{p}").exists() for i, p in enumerate(pids)):
            if time.monotonic() > deadline or not all(map(fleet.alive, range(opts.workers))):
                raise RuntimeError(f"workers did not start; see {folder}/worker-*.log")
            time.sleep(0.05)
        t_start = time.monotonic()
        t_end = t_start + opts.seconds
        config = asdict(opts) | {
            "t_start": t_start,
            "t_end": t_end,
            "mode": "cluster" if opts.cluster else "server",
            "namespace": namespace,
            "workload": WORKLOAD,
        }
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        (folder / "go.json").write_text(json.dumps({"t_end": t_end}))
        say(
            f"soak: {config['mode']}, {opts.workers} workers, {opts.seconds:g} s, "
            f"seed {opts.seed}, nemesis {opts.nemesis}, mutant {opts.mutant or 'none'}; "
            f"records in {folder}"
        )
        nemesis = Nemesis(
            rng=rng,
            log=log,
            fleet=fleet,
            profile=opts.nemesis,
            links=links,
            server=server,
            cluster=cluster.servers if cluster is not None else None,
        )
        nemesis.run_until(t_end)
        nemesis.finish()
        for i in fleet.wait_all(t_end + drain_s(opts.cache) + 10):
            log.write(t=time.monotonic(), kind="straggler-kill", w=i, pid=fleet.pid(i))
    log.close()
    return folder, checker.check(folder)
