"""Settings: a cache's arguments, checked once, and the one registry of URL schemes.

``Settings.from_args`` takes ``FlightCache(...)``'s arguments, refuses a bad one with a
``ConfigError`` that names it, and returns them normalised in a frozen dataclass, so every
front door (the async ``FlightCache``, the sync ``FlightCacheSync``) checks the same way. Nothing
here touches the network or asyncio.

``SCHEMES`` maps each URL scheme to what it names (cashews' ``register_backend``): a new
way to reach a server is one entry here plus its connection in ``_backends/``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ._codec import Codec, make_codec
from ._errors import ConfigError
from ._keys import check_namespace, describe_canonical
from ._types import CallOptions

__all__ = [
    "SCHEMES",
    "Scheme",
    "Settings",
    "Tuning",
    "check_call",
    "safe_url",
    "scheme_of",
    "seconds",
]


@dataclass(frozen=True, slots=True)
class Tuning:
    """Protocol constants of one cache; the defaults suit loopback and LAN latencies."""

    inline_max_bytes: int = 64 * 1024  # values up to this size ride inside the done event
    stream_linger_ms: int = 10_000  # how long the stream outlives its flight
    block_margin_ms: int = 50  # a follower blocks for the lease left plus this
    takeover_step_s: float = 0.03  # delay per place in the waiters queue on takeover
    takeover_max_rank: int = 16
    reset_timeout_s: float = 1.0
    ttl_jitter: float = 0.1  # results live ttl * (1 +/- this), so keys set together expire apart
    # How long a flight keeps retrying when the server stops answering mid-flight: long
    # enough for a cluster failover (Valkey/Redis cluster-node-timeout plus an election).
    failover_s: float = 10.0
    renew_batch: int = 200  # flights per renew_leases script call
    # A flight claimed on one server binds to its owner's session there, and its own keys
    # live this long, renewed every half of it (docs/protocol.md, "Sessions"); 0: no sessions,
    # every flight renews its own lease every lease/3.
    session_backstop_ms: int = 30_000
    fetch_count: int = 1000  # stream entries per XRANGE when a follower re-reads its stream


@dataclass(frozen=True, slots=True)
class Scheme:
    """What the URLs of one scheme name."""

    # "server": a Redis/Valkey server (or cluster) that other processes share; "memory": this
    # process only, no server; "embedded": a private server, started on first use.
    kind: Literal["server", "memory", "embedded"]
    shardable: bool = False  # may be one of a list of URLs (client-side sharding)


SCHEMES: dict[str, Scheme] = {
    "redis://": Scheme("server", shardable=True),
    "rediss://": Scheme("server", shardable=True),
    "unix://": Scheme("server", shardable=True),
    "redis+cluster://": Scheme("server"),  # Redis/Valkey Cluster, by any one of its nodes
    # The master that Redis Sentinel names, by the sentinels (_backends/sentinel.py)
    "redis+sentinel://": Scheme("server"),
    "rediss+sentinel://": Scheme("server"),
    "memory://": Scheme("memory"),
    "embedded://": Scheme("embedded"),
}


def scheme_of(url: str) -> Scheme | None:
    """The registered scheme of ``url``, or None."""
    for prefix, scheme in SCHEMES.items():
        if url.startswith(prefix):
            return scheme
    return None


def _either(prefixes: Iterable[str]) -> str:
    """``"a, b or c"``."""
    names = list(prefixes)
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


SECRET_PARAMS = {"password", "pass", "pwd", "secret", "token", "sentinel_password"}


def safe_url(url: str) -> str:
    """The URL with any password replaced, fit for logs and error messages.

    The password may sit before the ``@`` or in the query (``?password=``, the form redis-py
    documents for ``unix://``; ``?sentinel_password=``); all are masked. The hosts may be a
    list (``host:port,host:port``, a sentinel URL's). A URL that does not parse shows as such.
    """
    try:
        parts = urlsplit(url)
        userinfo, at, hosts = parts.netloc.rpartition("@")
        for host in hosts.split(","):
            urlsplit(f"//{host}").port  # noqa: B018 (raises ValueError for a bad port)
        query = parse_qsl(parts.query, keep_blank_values=True)
    except ValueError:
        return "<unparsable url>"
    netloc = parts.netloc
    if at and ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:***@{hosts}"
    masked = [(k, "***" if k.lower() in SECRET_PARAMS else v) for k, v in query]
    return urlunsplit((parts.scheme, netloc, parts.path, urlencode(masked, safe="*"), ""))


def seconds(name: str, value: Any, *, minimum: float = 0.0) -> float:
    """``value`` as a duration greater than ``minimum``, or ConfigError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > minimum:
        raise ConfigError(f"{name} must be a number of seconds greater than {minimum:g}: {value!r}")
    return float(value)


def check_call(ttl: float | None, lease: float | None, timeout: float | None) -> None:
    """A call's own durations (None: the cache's), checked as the cache's are."""
    if ttl is not None:
        seconds("ttl", ttl)
    if lease is not None:
        seconds("lease", lease, minimum=0.05)
    if timeout is not None:
        seconds("timeout", timeout)


def _seconds_or_zero(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{name} must be a number of seconds >= 0: {value!r}")
    return float(value)


def _count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}: {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Settings:
    """Every setting of one cache, checked and normalised (durations in seconds, floats).

    Made by :meth:`from_args`; the fields mean what ``FlightCache``'s arguments of the same
    names mean. ``url`` is the URL as the cache shows it (a Cluster's as
    ``redis+cluster://``, a shard list's joined with its passwords masked); ``servers`` are
    the URLs to connect to, the designated server first, none for ``memory://`` and
    ``embedded://``.
    """

    url: str = field(repr=False)  # may hold a password: safe_url() before showing it
    servers: tuple[str, ...] = field(repr=False)
    scheme: Scheme
    namespace: str
    ttl: float
    lease: float
    timeout: float
    error_ttl: float
    not_found_ttl: float
    max_value_bytes: int
    codec: Codec
    socket_timeout: float
    max_connections: int
    near_cache: bool
    near_lease: float
    near_max_entries: int
    near_max_bytes: int
    skew_margin: float
    node_ttl: float
    fail_open: bool
    tuning: Tuning | None

    @classmethod
    def from_args(
        cls,
        url: str | Sequence[str],
        *,
        namespace: str,
        ttl: float,
        lease: float,
        timeout: float,
        error_ttl: float,
        max_value_bytes: int,
        codec: str | Codec,
        socket_timeout: float,
        max_connections: int,
        near_cache: bool,
        near_lease: float,
        near_max_entries: int,
        near_max_bytes: int,
        skew_margin: float,
        node_ttl: float,
        cluster: bool,
        fail_open: bool,
        not_found_ttl: float,
        tuning: Tuning | None,
    ) -> Settings:
        """Check every argument (the defaults are the front door's) and normalise them."""
        shards: tuple[str, ...] = ()
        if isinstance(url, (list, tuple)):  # client-side sharding over standalone servers
            shards = tuple(str(u) for u in url)
            shardable = [prefix for prefix, s in SCHEMES.items() if s.shardable]
            if not shards or not all(u.startswith(tuple(shardable)) for u in shards):
                raise ConfigError(
                    "a list of URLs shards over standalone servers: give one or more "
                    f"{_either(shardable)} URLs"
                )
            url = ",".join(safe_url(u) for u in shards)
        if not isinstance(url, str):
            raise ConfigError(f"url must be a string, not {type(url).__name__}")
        if cluster:
            if not url.startswith(("redis://", "redis+cluster://")):
                raise ConfigError("cluster=True needs a redis:// URL of one cluster node")
            url = "redis+cluster://" + url.split("://", 1)[1]
        check_namespace(namespace)
        ttl = seconds("ttl", ttl)
        lease = seconds("lease", lease, minimum=0.05)
        timeout = seconds("timeout", timeout)
        error_ttl = _seconds_or_zero("error_ttl", error_ttl)
        not_found_ttl = seconds("not_found_ttl", not_found_ttl)
        max_value_bytes = _count("max_value_bytes", max_value_bytes, 2)
        made_codec = make_codec(codec)
        socket_timeout = seconds("socket_timeout", socket_timeout)
        max_connections = _count("max_connections", max_connections, 2)
        skew_margin = _seconds_or_zero("skew_margin", skew_margin)
        near_lease = seconds("near_lease", near_lease, minimum=skew_margin)
        node_ttl = seconds("node_ttl", node_ttl, minimum=0.05)
        near_max_entries = _count("near_max_entries", near_max_entries, 1)
        near_max_bytes = _count("near_max_bytes", near_max_bytes, 1)
        scheme = scheme_of(shards[0] if shards else url)
        if scheme is None:
            raise ConfigError(f"unsupported URL {safe_url(url)!r}: use {_either(SCHEMES)}")
        if not shards and scheme.kind == "server":
            shards = (url,)
        return cls(
            url=url,
            servers=shards,
            scheme=scheme,
            namespace=namespace,
            ttl=ttl,
            lease=lease,
            timeout=timeout,
            error_ttl=error_ttl,
            not_found_ttl=not_found_ttl,
            max_value_bytes=max_value_bytes,
            codec=made_codec,
            socket_timeout=socket_timeout,
            max_connections=max_connections,
            near_cache=near_cache,
            near_lease=near_lease,
            near_max_entries=near_max_entries,
            near_max_bytes=near_max_bytes,
            skew_margin=skew_margin,
            node_ttl=node_ttl,
            fail_open=fail_open,
            tuning=tuning,
        )

    def call_options(
        self,
        canon: bytes,
        ttl: float | None,
        lease: float | None,
        timeout: float | None,
        refresh: bool = False,
        store: bool = True,
    ) -> CallOptions:
        """One call's options: its own durations (checked by ``check_call``), else these."""
        return CallOptions(
            ttl_ms=int((self.ttl if ttl is None else ttl) * 1000) or 1,
            lease_ms=int((self.lease if lease is None else lease) * 1000),
            timeout_s=float(self.timeout if timeout is None else timeout),
            error_ttl_ms=int(self.error_ttl * 1000),
            not_found_ttl_ms=int(self.not_found_ttl * 1000),
            key_text=describe_canonical(canon),
            refresh=refresh,
            store=store,
        )
