"""A process of threads using FlightCacheSync: one JSON report on stdout.

Argument: a JSON config with ``url``, ``namespace``, ``threads``, ``loader_s`` and ``calls``:
a list of ``{"key": ..., "at": <time.monotonic() instant>}``. At each instant, ``threads``
threads call ``fcs.do(key, loader)`` at once; the loader (a blocking ``time.sleep``) returns
this process's pid and the key. The report has every value, the loader's runs and stats.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from flightcache import FlightCacheSync


def main() -> None:
    config = json.loads(sys.argv[1])
    runs: list[str] = []
    values: dict[str, list[Any]] = {}
    errors: list[str] = []
    lock = threading.Lock()
    with FlightCacheSync(config["url"], namespace=config["namespace"]) as fcs:
        fcs.ping()  # connected before the first instant

        def call(key: str, at: float) -> None:
            def loader() -> dict[str, Any]:
                with lock:
                    runs.append(key)
                time.sleep(config["loader_s"])
                return {"pid": os.getpid(), "key": key}

            time.sleep(max(0.0, at - time.monotonic()))
            try:
                value = fcs.do(key, loader)
            except Exception as exc:
                with lock:
                    errors.append(repr(exc))
                return
            with lock:
                values.setdefault(key, []).append(value)

        threads = [
            threading.Thread(target=call, args=(c["key"], c["at"]))
            for c in config["calls"]
            for _ in range(config["threads"])
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stats = fcs.stats
    print(
        json.dumps(
            {"pid": os.getpid(), "runs": runs, "values": values, "errors": errors, "stats": stats}
        )
    )


if __name__ == "__main__":
    main()
