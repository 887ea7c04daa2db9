"""The ``flightcache`` commands that run a server: ``mock-upstream`` (the test double of an
OpenAI-compatible API) and ``serve`` (the gateway). Both need the gateway extra, imported
inside their handlers."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from .options import (
    DEFAULT_URL_ENV,
    PROG,
    non_negative_float,
    positive_float,
)

# -- mock-upstream ------------------------------------------------------------------------


def add_mock_upstream(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
        type=positive_float,
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


def add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
        "--ttl", type=positive_float, default=3600.0, help="seconds answers are stored (3600)"
    )
    p.add_argument(
        "--lease",
        type=positive_float,
        default=3.0,
        help="seconds an owner's lease lasts: a dead owner is replaced after this (3)",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=600.0,
        help="seconds one whole upstream answer may take (600)",
    )
    p.add_argument(
        "--upstream-timeout",
        type=positive_float,
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
    for name in ("aiohttp", "httpx", "httpcore"):  # they may log URLs (a key in a query)
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
    # What exists now (the modules, the app) lives as long as the process: frozen, the
    # cyclic GC's full collections no longer walk it. In the 1,000-stream bench phase this
    # took about 6 % off the replicas' CPU (docs/gateway.md, limits).
    gc.freeze()
    return _listen(args, serve, app, banner, log_level=args.log_level)
