"""Plain threads (a WSGI server's workers, a Celery pool, a script): FlightCacheSync.

50 request threads ask for the same slow, blocking computation at once: it runs once, in a
worker thread whose lease the cache renews while it blocks, and every thread gets its value.
The pre-forking part shows a cache made before os.fork() working in a child process.

Run: python examples/threads.py [REDIS_URL]   (default: a private embedded server)
"""

import os
import sys
import threading
import time

from flightcache import FlightCacheSync


def main(url: str) -> None:
    with FlightCacheSync(url, namespace="threads", lease=0.5) as fcs:
        runs = []

        @fcs.flight(ttl=60)
        def summarize(doc_id: int) -> str:  # a blocking call: a database, an HTTP API
            runs.append(doc_id)
            time.sleep(1.5)  # three leases long: the cache renews the lease meanwhile
            return f"summary of document {doc_id}"

        answers = []
        threads = [threading.Thread(target=lambda: answers.append(summarize(7))) for _ in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(f"{len(answers)} answers, {len(set(answers))} distinct, loader runs: {len(runs)}")
        print("cached:", summarize(doc_id=7))

        if hasattr(os, "fork"):  # a pre-forking server: the child makes its own connections
            pid = os.fork()
            if pid == 0:
                try:  # a hit: the result the parent stored, read on the child's own connections
                    print(f"forked child: {summarize(7)}, loader runs: {len(runs)}", flush=True)
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "embedded://")
