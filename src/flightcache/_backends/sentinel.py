"""Redis Sentinel URLs: what ``redis+sentinel://`` and ``rediss+sentinel://`` name.

    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/<service>[/<db>][?options]

The hosts are the sentinels (port 26379 where none is given), asked in turn for the master
of ``<service>``; ``<db>`` is the database on it (0 by default). The user and password are
the servers' (the master's and its replicas'), as in a ``redis://`` URL. Sentinels that
want a password of their own (``requirepass`` in sentinel.conf) take ``?sentinel_password=``
(and ``sentinel_username=``): a sentinel without one refuses an AUTH, so the servers'
password is not sent to them. ``rediss+sentinel://`` speaks TLS to the sentinels and to the
servers, with a ``rediss://`` URL's ``ssl_*`` options (``?ssl_ca_certs=...``) for both.
The other options are a ``redis://`` URL's (``socket_connect_timeout``, ``protocol``, ...);
an unknown one is a ConfigError when the cache is made, not an error at the first command.

``SentinelMaster`` is the async connection's side: the two pools that connect to the master
the sentinels name, and the task that asks them again whenever the listener reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from redis import exceptions as rexc
from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS, parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from .._config import safe_url
from .._errors import ConfigError
from .listener import Listener
from .pools import SentinelPool

log = logging.getLogger("flightcache.redis")

__all__ = ["SENTINEL_SCHEMES", "SentinelURL", "parse_sentinel_url"]

SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")
DEFAULT_PORT = 26379
FORM = "redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/<service>[/<db>]"

# Options for the sentinels themselves; everything else is for the servers.
SENTINEL_OPTIONS = {"sentinel_username", "sentinel_password"}
TLS_OPTIONS = {
    "ssl_keyfile",
    "ssl_certfile",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_ca_data",
    "ssl_ciphers",
    "ssl_password",
    "ssl_check_hostname",
    "ssl_min_version",
    "ssl_include_verify_flags",
    "ssl_exclude_verify_flags",
}
# What a redis:// URL's query may say about its connections (redis-py's parse_url), less
# ``db`` (the path says it) and ``timeout`` (an option of another pool class).
SERVER_OPTIONS = (set(URL_QUERY_ARGUMENT_PARSERS) - {"db", "timeout"}) | {
    "username",
    "password",
    "client_name",
    *TLS_OPTIONS,
}


@dataclass(frozen=True, slots=True)
class SentinelURL:
    """One sentinel URL, parsed: where the sentinels are, and how to talk to the servers."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int
    tls: bool
    # Connection arguments for the master (redis-py's names): auth, db, TLS, query options.
    server: dict[str, Any] = field(repr=False)
    # Connection arguments for the sentinels: their own auth, and TLS like the servers'.
    sentinel: dict[str, Any] = field(repr=False)
    _userinfo: str = field(repr=False, default="")  # as written, still %-encoded
    _query: str = field(repr=False, default="")  # the servers' options, encoded

    def server_url(self, host: str, port: int) -> str:
        """A plain ``redis://`` (``rediss://``) URL of one server of the service, with the
        URL's password, db and options (for connections made from a URL: the listener)."""
        netloc = f"[{host}]" if ":" in host else host
        auth = f"{self._userinfo}@" if self._userinfo else ""
        url = f"{'rediss' if self.tls else 'redis'}://{auth}{netloc}:{port}/{self.db}"
        return url + (f"?{self._query}" if self._query else "")


def parse_sentinel_url(url: str) -> SentinelURL:
    """``url`` parsed, or ConfigError (which shows the URL with its passwords masked)."""
    shown = safe_url(url)

    def bad(why: str) -> ConfigError:
        return ConfigError(f"bad Redis Sentinel URL {shown}: {why} (the form is {FORM})")

    if not url.startswith(SENTINEL_SCHEMES):
        raise bad(f"the scheme must be {' or '.join(SENTINEL_SCHEMES)}")
    tls = url.startswith("rediss+")
    try:
        parts = urlsplit(url)
        options = parse_qsl(parts.query, keep_blank_values=True)
    except ValueError as exc:
        raise bad(str(exc)) from exc
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if not hosts:
        raise bad("no sentinel addresses")
    sentinels = tuple(_host_port(item, bad) for item in hosts.split(","))
    segments = parts.path[1:].split("/") if parts.path.startswith("/") else [""]
    if len(segments) > 1 and segments[-1] == "":
        segments.pop()  # a trailing slash
    service = unquote(segments[0])
    if not service:
        raise bad("no service name (the name the sentinels monitor)")
    if len(segments) > 2:
        raise bad("the path is /<service> or /<service>/<db>")
    db = 0
    if len(segments) == 2:
        if not segments[1].isdigit():
            raise bad(f"the db must be a number, not {segments[1]!r}")
        db = int(segments[1])
    if parts.fragment:
        raise bad("a URL fragment (#...) means nothing here")
    sentinel_kwargs: dict[str, Any] = {}
    server_options = []
    for name, value in options:
        if name in SENTINEL_OPTIONS:
            sentinel_kwargs[name.removeprefix("sentinel_")] = value
        elif name == "db":
            raise bad("give the db in the path: /<service>/<db>")
        elif name not in SERVER_OPTIONS:
            raise bad(f"unknown option {name!r}")
        elif name in TLS_OPTIONS and not tls:
            raise bad(f"{name} is a TLS option: use rediss+sentinel://")
        else:
            server_options.append((name, value))
    query = urlencode(server_options)
    try:  # redis-py reads the auth and the options, as for a redis:// URL
        server: dict[str, Any] = dict(
            parse_url(f"redis://{userinfo + '@' if userinfo else ''}sentinel/{db}?{query}")
        )
    except ValueError as exc:
        raise bad(str(exc)) from exc
    server.pop("host", None)
    if tls:
        server["ssl"] = True
        sentinel_kwargs["ssl"] = True
        sentinel_kwargs.update((k, v) for k, v in server.items() if k in TLS_OPTIONS)
    return SentinelURL(sentinels, service, db, tls, server, sentinel_kwargs, userinfo, query)


def _host_port(item: str, bad: Any) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port``."""
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise bad(f"cannot read the sentinel address {item!r}")
        port_text = rest[1:]
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise bad(f"a sentinel address without a host: {item!r}")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise bad(f"the port of sentinel {host!r} must be 1-65535, not {port_text!r}")
    return host, int(port_text)


class SentinelMaster:
    """The master the sentinels of one ``redis+sentinel://`` URL name, for one async
    connection: its two pools connect to it (each new connection asks the sentinels), and
    the listener is pointed at the master they named last, asked again on each of its
    reconnects (a failover moved it, say)."""

    def __init__(self, parsed: SentinelURL, shown_url: str, connect_timeout: float) -> None:
        self.url = parsed
        self.shown_url = shown_url
        self.sentinels = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
            parsed.sentinels,
            sentinel_kwargs=dict(
                # A sentinel answers at once or is skipped for the next one; no retries
                # (redis-py's default retries a refused connection ten times).
                socket_connect_timeout=connect_timeout,
                socket_timeout=connect_timeout,
                socket_keepalive=True,
                retry=Retry(NoBackoff(), 0),
                **parsed.sentinel,
            ),
        )
        self.address: tuple[str, int] | None = None  # the master the sentinels named last
        self._ask = asyncio.Event()  # the listener wants a fresh master address
        self._tracker: asyncio.Task[None] | None = None

    def pools(
        self, common: dict[str, Any], socket_timeout: float, lane: int
    ) -> tuple[SentinelPool, SentinelPool]:
        """The two pools of the plain case (short commands with ``lane`` reserved
        connections, and blocking reads), their connections made to the master named."""
        options = {**common, **self.url.server}  # the URL's options win, as in from_url
        name = self.url.service
        return (
            SentinelPool(
                name,
                self.sentinels,
                heard=self.heard,
                op_timeout=socket_timeout,
                lane=lane,
                **{"socket_timeout": None, **options},
            ),
            SentinelPool(
                name,
                self.sentinels,
                heard=self.heard,
                **{"socket_timeout": socket_timeout, **options},
            ),
        )

    def heard(self, named: tuple[str, int]) -> None:
        """The sentinels named ``named`` as the master (for a new connection, or asked)."""
        address = (str(named[0]), int(named[1]))
        if self.address is not None and self.address != address:
            log.warning(
                "Redis Sentinel %s: the master moved from %s:%s to %s:%s",
                self.shown_url,
                *self.address,
                *address,
            )
        self.address = address

    def track(self, listener: Listener) -> None:
        """Start asking for the master whenever the listener wants it; the listener starts
        with the first master named."""
        if self._tracker is None:
            self._tracker = asyncio.get_running_loop().create_task(self._track(listener))

    def listen_url(self) -> str:
        """The plain URL of the master named last, for the listener's next connection; the
        sentinels are asked again meanwhile, so that a later attempt goes where they say
        the master is then."""
        self._ask.set()
        assert self.address is not None  # the listener starts once one was named
        return self.url.server_url(*self.address)

    async def _track(self, listener: Listener) -> None:
        """Ask the sentinels whenever the listener wants it (on each of its reconnects),
        retrying until they name one. (Short commands ask on their own: each new pooled
        connection.)"""
        backoff = 0.1
        self._ask.set()
        while True:
            await self._ask.wait()
            try:
                address = await self.sentinels.discover_master(self.url.service)
            except (rexc.RedisError, OSError) as exc:
                (log.info if isinstance(exc, rexc.ConnectionError) else log.warning)(
                    "Redis Sentinel %s names no master now: %s", self.shown_url, str(exc)[:200]
                )
                await asyncio.sleep(backoff)  # sentinel retry backoff
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.1
            self._ask.clear()
            self.heard(address)
            listener.start()  # once; later rounds only refresh the address

    async def stop_tracking(self) -> None:
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tracker

    async def aclose(self) -> None:
        """The sentinels' connections closed (after the pools that asked them)."""
        await self.stop_tracking()
        await self.sentinels.aclose()
