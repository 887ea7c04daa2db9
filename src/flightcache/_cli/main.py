"""The ``flightcache`` command line: a thin layer over the library (docs/operations.md).

Every command is one subparser, added by one ``add`` function listed in ``COMMANDS``; its
handler takes the parsed arguments and returns the exit status. The commands that run a
server (``mock-upstream``, ``serve``) live in ``serve.py``, what all commands share in
``options.py``. To add a command, write its ``add`` function, import heavy dependencies
inside the handler, and append it to ``COMMANDS``.

Exit status: 0 success, 1 the command ran but its check failed (``demo``), 2 an error
(a :class:`FlightError`, printed as one line on stderr without any password), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from .._config import safe_url
from .._errors import FlightError
from .options import (
    PROG,
    Handler,
    add_redis_options,
    positive_float,
    positive_int,
)
from .serve import add_mock_upstream, add_serve

# -- demo ---------------------------------------------------------------------------------


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="many processes ask the same slow question; the owner is killed mid-flight",
        description=(
            "Start a private server and several worker processes that all ask one slow fake "
            "LLM the same question at once; kill the owner mid-flight (SIGKILL) and show that "
            "the loader ran once more, by one taker-over, and every caller got one value."
        ),
    )
    p.add_argument("--workers", type=positive_int, default=4, help="worker processes (default 4)")
    p.add_argument(
        "--callers",
        type=positive_int,
        default=50,
        help="concurrent callers per worker (default 50)",
    )
    p.add_argument(
        "--loader-seconds",
        type=positive_float,
        default=2.0,
        help="how long the fake LLM takes (default 2.0)",
    )
    p.add_argument(
        "--lease", type=positive_float, default=1.5, help="owner lease in seconds (default 1.5)"
    )
    p.add_argument(
        "--no-kill", dest="kill", action="store_false", help="let the first owner finish"
    )
    p.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from .demo import DemoConfig, run_demo

    if args.kill and args.workers < 2:
        print(
            f"{PROG} demo: error: killing the owner needs --workers 2 or more (or --no-kill)",
            file=sys.stderr,
        )
        return 2
    # Every field of DemoConfig is an option of ``demo``, under the same name.
    config = DemoConfig(**{f.name: getattr(args, f.name) for f in fields(DemoConfig)})
    return run_demo(config)


# -- inspect ------------------------------------------------------------------------------


def _add_inspect(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "inspect",
        help="show the state of one key",
        description="Show the state of one key (a string key).",
    )
    p.add_argument("key", metavar="KEY", help="the key, as the string given to fc.do()")
    add_redis_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    import orjson

    from .._cache import FlightCache

    async def go() -> dict[str, Any]:
        fc = FlightCache(args.redis, namespace=args.namespace, fail_open=False, near_cache=False)
        try:
            info = await fc.inspect(args.key)
        finally:
            await fc.aclose()
        return info.as_dict()

    fields = asyncio.run(go())
    if args.json:
        print(orjson.dumps(fields).decode())
    else:
        _print_fields(fields)
    return 0


# -- status -------------------------------------------------------------------------------


def _add_status(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status",
        help="ping the server; show its version and the token counter",
        description="Ping the server; show its version, round-trip time and the "
        "namespace's owner-seq (the last fencing token handed out).",
    )
    add_redis_options(p)
    p.add_argument("--pings", type=positive_int, default=5, help="round trips to time (default 5)")
    p.set_defaults(handler=_run_status)


def _run_status(args: argparse.Namespace) -> int:
    from .._backends.redis import RedisConnection
    from .._keys import KeySpace
    from .._leases.nodes import live_nodes
    from .._types import Stats

    keyspace = KeySpace(args.namespace)  # validates the namespace before connecting

    async def go() -> dict[str, Any]:
        conn = RedisConnection(args.redis, stats=Stats(), socket_timeout=5.0)
        client = conn.client
        try:
            info = await conn.run(lambda: client.info("server"))
            rtts = []
            for _ in range(args.pings):
                start = time.perf_counter()
                await conn.run(lambda: client.ping())
                rtts.append((time.perf_counter() - start) * 1000)
            seq = await conn.run(lambda: client.get(keyspace.owner_seq))
            nodes = await live_nodes(conn, keyspace)
        finally:
            await conn.aclose()
        if "valkey_version" in info:
            version = f"valkey {info['valkey_version']}"
        else:
            version = f"redis {info.get('redis_version', '?')}"
        return {
            "server": safe_url(args.redis),
            "version": version,
            "ping_ms": f"{statistics.median(rtts):.3f} (median of {len(rtts)}, "
            f"min {min(rtts):.3f})",
            "namespace": args.namespace,
            "owner_seq": int(seq) if seq is not None else 0,
            "live nodes": len(nodes),
            "_nodes": nodes,
        }

    fields = asyncio.run(go())
    nodes = fields.pop("_nodes")
    _print_fields(fields)
    if nodes:
        print()
        header = ("node", "age", "owns", "near entries", "near hit rate", "lease")
        rows = [
            (
                n.node_id,
                f"{n.age_s:.0f} s",
                str(n.owned),
                str(n.near_entries),
                "-" if n.near_hit_rate is None else f"{n.near_hit_rate:.0%}",
                f"{n.lease_ms / 1000:g} s" if n.lease_ms else "no near cache",
            )
            for n in nodes
        ]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        for row in (header, *rows):
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    return 0


COMMANDS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    _add_demo,
    _add_inspect,
    add_mock_upstream,
    add_serve,
    _add_status,
]


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run an expensive call once across many processes, share the result, cache it.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def _print_fields(fields: dict[str, Any]) -> None:
    width = max(len(k) for k in fields)
    for name, value in fields.items():
        print(f"{name.replace('_', ' '):<{width}}  {'-' if value is None else value}")


def _one_line(exc: BaseException, urls: Sequence[str]) -> str:
    """The error as one line, with any password of the given URLs masked (belt and braces)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    for url in urls:
        try:
            password = urlsplit(url).password
        except ValueError:
            continue
        if password:
            text = text.replace(password, "***")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except FlightError as exc:
        urls = [u for u in (getattr(args, "redis", None), getattr(args, "upstream", None)) if u]
        message = f"{PROG} {args.command}: {type(exc).__name__}: {_one_line(exc, urls)}"
        print(message, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
