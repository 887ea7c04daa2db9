"""What the ``flightcache`` commands share: the program's name, the Redis options, and the
argparse number types."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TypeVar

PROG = "flightcache"
DEFAULT_URL_ENV = "FLIGHTCACHE_REDIS_URL"
DEFAULT_URL = "redis://127.0.0.1:6379/0"

Handler = Callable[[argparse.Namespace], int]
_N = TypeVar("_N", int, float)


def add_redis_options(parser: argparse.ArgumentParser) -> None:
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


def number(
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


positive_float = number(float, "a number", lambda v: v > 0, "greater than 0")
positive_int = number(int, "an integer", lambda v: v >= 1, "at least 1")
non_negative_float = number(float, "a number", lambda v: 0 <= v < float("inf"), "0 or more")
