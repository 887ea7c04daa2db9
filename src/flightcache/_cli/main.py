"""The ``flightcache`` command line: a thin layer over the library (docs/operations.md).

Every command is one subparser, added by one ``_add_<command>`` function listed in
``COMMANDS``; its handler takes the parsed arguments and returns the exit status. To add a
command (``serve``, ``mock-upstream``, ``bench``), write its ``_add_`` function, import
heavy dependencies inside the handler, and append it to ``COMMANDS``.

Exit status: 0 success, 1 the command ran but its check failed (``demo``), 2 an error
(a :class:`FlightError`, printed as one line on stderr without any password), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

from .._config import safe_url
from .._errors import FlightError

PROG = "flightcache"
DEFAULT_URL_ENV = "FLIGHTCACHE_REDIS_URL"
DEFAULT_URL = "redis://127.0.0.1:6379/0"

Handler = Callable[[argparse.Namespace], int]
_N = TypeVar("_N", int, float)


# -- shared options ----------------------------------------------------------------------


def _add_redis_options(parser: argparse.ArgumentParser) -> None:
    default = os.environ.get(DEFAULT_URL_ENV, DEFAULT_URL)
    parser.add_argument(
        "--redis",
        metavar="URL",
        default=default,
        help=f"server URL (default: ${DEFAULT_URL_ENV} or {DEFAULT_URL})",
    )
    parser.add_argument(
        "--namespace",
        metavar="NS",
        default="flightcache",
        help="key namespace (default: flightcache)",
    )


def _number(
    convert: Callable[[str], _N], kind: str, ok: Callable[[_N], bool], rule: str
) -> Callable[[str], _N]:
    """An argparse type: ``convert(text)`` (else "not <kind>"), which must be ``ok`` (else
    "must be <rule>")."""

    def parse(text: str) -> _N:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {kind}: {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}: {text!r}")
        return value

    return parse


_positive_float = _number(float, "a number", lambda v: v > 0, "greater than 0")
_positive_int = _number(int, "an integer", lambda v: v >= 1, "at least 1")
non_negative_float = _number(float, "a number", lambda v: 0 <= v < float("inf"), "0 or more")


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
    p.add_argument("--workers", type=_positive_int, default=4, help="worker processes (default 4)")
    p.add_argument(
        "--callers",
        type=_positive_int,
        default=50,
        help="concurrent callers per worker (default 50)",
    )
    p.add_argument(
        "--loader-seconds",
        type=_positive_float,
        default=2.0,
        help="how long the fake LLM takes (default 2.0)",
    )
    p.add_argument(
        "--lease", type=_positive_float, default=1.5, help="owner lease in seconds (default 1.5)"
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
    _add_redis_options(p)
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
    _add_redis_options(p)
    p.add_argument("--pings", type=_positive_int, default=5, help="round trips to time (default 5)")
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


# -- mock-upstream ------------------------------------------------------------------------


def _add_mock_upstream(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "mock-upstream",
        help="a test double of an OpenAI-compatible API (not a model), for tests and demos",
        description=(
            "Serve a TEST DOUBLE of an OpenAI-compatible API: it is not a model. It answers "
            "/v1/chat/completions, /v1/completions and /v1/embeddings (stream and non-stream) "
            "with deterministic made-up words (the same request always gets the same text) "
            "after a configurable latency and token rate, wants any 'Authorization: Bearer' "
            'key and never logs it. GET /stats counts the calls ({"calls": N, ...}); POST '
            '/control with {"mode": "normal|fail|hang|rate_limit|cut", ...} switches '
            "behaviours, POST /control/reset restores them. Stops cleanly on SIGTERM. "
            "Needs the gateway extra: pip install 'flightcache[gateway]'."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--port",
        type=int,
        default=9000,
        help="port to listen on; 0 picks a free one (default 9000)",
    )
    p.add_argument(
        "--latency-ms",
        type=non_negative_float,
        default=200.0,
        help="time to the first token in milliseconds (default 200)",
    )
    p.add_argument(
        "--tokens-per-s",
        type=_positive_float,
        default=50.0,
        help="tokens (words) per second after the first (default 50)",
    )
    p.set_defaults(handler=_run_mock_upstream)


def _run_mock_upstream(args: argparse.Namespace) -> int:
    try:
        from ..gateway._mock import make_mock_app
        from ..gateway._mock_parts import BANNER
        from ..gateway._serve_util import serve
    except ImportError as exc:
        return _no_gateway_extra(args, exc)
    app = make_mock_app(latency_ms=args.latency_ms, tokens_per_s=args.tokens_per_s)
    return _listen(args, serve, app, BANNER)


def _no_gateway_extra(args: argparse.Namespace, exc: ImportError) -> int:
    print(
        f"{PROG} {args.command}: error: {exc}; install the gateway extra: "
        "pip install 'flightcache[gateway]'",
        file=sys.stderr,
    )
    return 2


def _listen(
    args: argparse.Namespace, serve: Callable[..., int], app: Any, banner: str, **options: Any
) -> int:
    """``serve`` (the gateway extra's, which the caller imported) runs ``app`` on ``--host``
    and ``--port``; its exit status, or 2 if it cannot listen there."""
    try:
        return serve(app, host=args.host, port=args.port, banner=banner, **options)
    except (OSError, OverflowError) as exc:  # OverflowError: a port outside 0-65535
        print(f"{PROG} {args.command}: error: {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2


# -- serve --------------------------------------------------------------------------------

UPSTREAM_ENV = "FLIGHTCACHE_UPSTREAM"


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible gateway: identical requests become one upstream call",
        description=(
            "Serve an OpenAI-compatible gateway in front of an upstream API. Identical "
            "requests to /v1/chat/completions, /v1/completions and /v1/embeddings (stream or "
            "not) across every gateway sharing one Redis become one upstream call; streams "
            "fan out live; answers are cached (X-Cache: HIT | MISS | COALESCED). Other paths "
            "are proxied untouched. GET /metrics (Prometheus), GET /healthz. The API key is "
            "whatever each client sends, passed through, never logged. Without --redis (or "
            f"${DEFAULT_URL_ENV}) it runs on a private embedded server that no other replica "
            "shares. Stops cleanly on SIGTERM. Needs: pip install 'flightcache[gateway]'. "
            "See docs/gateway.md."
        ),
    )
    p.add_argument(
        "--upstream",
        metavar="URL",
        default=os.environ.get(UPSTREAM_ENV) or None,
        help=f"the upstream API's base URL, e.g. https://api.openai.com/v1 (or ${UPSTREAM_ENV})",
    )
    p.add_argument(
        "--redis",
        metavar="URL",
        default=os.environ.get(DEFAULT_URL_ENV) or None,
        help=f"the shared Redis/Valkey URL (or ${DEFAULT_URL_ENV}; default: a private "
        "embedded server)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (default 8000)")
    p.add_argument(
        "--namespace", metavar="NS", default="gateway", help="key namespace (default: gateway)"
    )
    p.add_argument(
        "--share-across-keys",
        action="store_true",
        help="share answers between API keys (default: each key's digest is part of the key)",
    )
    p.add_argument(
        "--no-cache-sampled",
        dest="cache_sampled",
        action="store_false",
        help="do not store sampled answers (temperature > 0 or omitted, no seed); they are "
        "still coalesced while in flight",
    )
    p.add_argument(
        "--ttl", type=_positive_float, default=3600.0, help="seconds answers are stored (3600)"
    )
    p.add_argument(
        "--lease",
        type=_positive_float,
        default=3.0,
        help="seconds an owner's lease lasts: a dead owner is replaced after this (3)",
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=600.0,
        help="seconds one whole upstream answer may take (600)",
    )
    p.add_argument(
        "--upstream-timeout",
        type=_positive_float,
        default=300.0,
        help="seconds without a byte from the upstream before a call fails with 504 (300)",
    )
    p.add_argument(
        "--error-ttl",
        type=non_negative_float,
        default=2.0,
        help="seconds a 4xx answer is negative-cached; 429, 5xx, 401, 403 never are (2)",
    )
    p.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="log level (default: warning)",
    )
    p.set_defaults(handler=_run_serve)


def _shown_url(url: str) -> str:
    """A URL fit for the banner: never its user info or query, which may hold secrets."""
    try:
        parts = urlsplit(url)
        host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<unparsable url>"
    return f"{parts.scheme}://{host}{port}{parts.path}"


def _run_serve(args: argparse.Namespace) -> int:
    try:
        from ..gateway._app import make_app
        from ..gateway._serve_util import serve
    except ImportError as exc:
        return _no_gateway_extra(args, exc)
    if not args.upstream:
        print(
            f"{PROG} serve: error: --upstream URL (or ${UPSTREAM_ENV}) is required", file=sys.stderr
        )
        return 2
    import logging

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for name in ("httpx", "httpcore"):  # they log URLs, whose query may hold a key
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    app = make_app(
        upstream=args.upstream,
        redis_url=args.redis,
        namespace=args.namespace,
        share_across_keys=args.share_across_keys,
        cache_sampled=args.cache_sampled,
        ttl=args.ttl,
        lease=args.lease,
        timeout=args.timeout,
        upstream_timeout=args.upstream_timeout,
        error_ttl=args.error_ttl,
    )
    cache = (
        f"redis {_shown_url(args.redis)}"
        if args.redis
        else "a private embedded server (not shared with other replicas: pass --redis)"
    )
    banner = (
        f"flightcache gateway listening on {{url}} (upstream {_shown_url(args.upstream)}, "
        f"cache on {cache}, namespace {args.namespace})"
    )
    return _listen(args, serve, app, banner, log_level=args.log_level)


# -- the parser and main ------------------------------------------------------------------

COMMANDS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    _add_demo,
    _add_inspect,
    _add_mock_upstream,
    _add_serve,
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
