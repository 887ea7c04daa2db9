"""Canonical fingerprints of user keys and the names of every Redis key flightcache uses.

All keys of one flight share the hash tag ``{<digest>}`` so that one Lua script can touch
them on one Redis Cluster node; ``<ns>:owner-seq`` is deliberately untagged (its own slot).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import orjson

from ._errors import ConfigError, SerializationError

DIGEST_CHARS = 32
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def check_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
        raise ConfigError(
            f"namespace must be 1-64 characters of letters, digits, '_', '.', '-': {namespace!r}"
        )
    return namespace


MAX_TAG_CHARS = 256
MAX_TAGS = 64


def check_tags(tags: Any) -> tuple[str, ...]:
    """A call's tags, checked, without duplicates, sorted: an iterable of 1-256 character
    strings, at most 64. A bare string is refused (it is not a list of its characters)."""
    if isinstance(tags, (str, bytes)):
        raise ConfigError(f"tags must be a list of strings, not one string: {tags!r}")
    try:
        tags = list(tags)
    except TypeError:
        raise ConfigError(f"tags must be a list of strings, not {type(tags).__name__}") from None
    for name in tags:
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_TAG_CHARS:
            raise ConfigError(f"a tag is a string of 1-{MAX_TAG_CHARS} characters: {name!r}")
    names = tuple(sorted(set(tags)))
    if len(names) > MAX_TAGS:
        raise ConfigError(f"at most {MAX_TAGS} tags on one result, not {len(names)}")
    return names


def canonical(key: Any) -> bytes:
    """The canonical bytes of a key: a str stands for itself, anything else is canonical JSON.

    The two forms carry different prefixes, so the string ``"1"`` and the number ``1`` differ.
    """
    if isinstance(key, str):
        return b"s\x00" + key.encode("utf-8", "surrogatepass")
    try:
        return b"j\x00" + orjson.dumps(key, option=orjson.OPT_SORT_KEYS)
    except TypeError as exc:
        raise SerializationError(f"key is not JSON-serialisable: {exc}") from exc


def digest_of(canon: bytes) -> str:
    """SHA-256 of a canonical key, hex, truncated to 32 characters (128 bits)."""
    return hashlib.sha256(canon).hexdigest()[:DIGEST_CHARS]


def digest(key: Any) -> str:
    return digest_of(canonical(key))


def describe_canonical(canon: bytes, limit: int = 200) -> str:
    """A short printable form of a canonical key, stored in meta for ``inspect``."""
    text = canon[2:].decode("utf-8", "replace")
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True, slots=True)
class FlightKeys:
    """The Redis key names of one flight."""

    digest: str
    meta: str
    result: str
    stream: str
    waiters: str
    marker: str  # set while an invalidation or replacement of the key is under way
    cost: str  # how long the stored result took to compute (ms), for refresh-ahead


class KeySpace:
    """Builds every Redis key name of one namespace."""

    def __init__(self, namespace: str) -> None:
        self.namespace = check_namespace(namespace)
        self.owner_seq = f"{namespace}:owner-seq"
        # Node liveness: a set of node ids, and a lease key per node (its info, PX node TTL),
        # under one hash tag, so one script reads and prunes them together.
        self.nodes = f"{namespace}:nodeset:{{{namespace}}}"
        self.invalidations = f"{namespace}:invalidate"  # the pub/sub channel
        self.wake_prefix = f"{namespace}:wake:"  # + node id: a node's wake channel

    def session(self, node_id: str) -> str:
        """A node's session on a server (docs/protocol.md, "Sessions"): its epoch, expiring with
        its lease. Untagged: sessions exist only off a Cluster, and the scripts build this
        name from a meta key and its ``ownerNode``."""
        return f"{self.namespace}:session:{node_id}"

    def node(self, node_id: str) -> str:
        """A node's liveness lease: its info, expiring with the lease, by the server."""
        return f"{self.namespace}:node:{{{self.namespace}}}:{node_id}"

    def bloom(self, name: str) -> tuple[str, str]:
        """A Bloom filter's bitmap and parameter keys, under one hash tag of their own."""
        tag = f"{{{self.namespace}:bloom:{name}}}"
        return f"{self.namespace}:bloom:{tag}", f"{self.namespace}:bloom-params:{tag}"

    def tag(self, name: str) -> str:
        """A tag's version counter: its own hash tag, so its own slot on a Cluster."""
        return f"{self.namespace}:tag:{{{self.namespace}:tag:{name}}}"

    def tag_acks(self, invalidation: str) -> str:
        """The list where nodes acknowledge one ``invalidate_tags``, in a slot of its own."""
        return f"{self.namespace}:tagack:{{{self.namespace}:tagack:{invalidation}}}"

    def ack(self, digest: str, invalidation: str) -> str:
        """The list where nodes acknowledge one invalidation of one key."""
        return f"{self.namespace}:ack:{{{digest}}}:{invalidation}"

    def flight(self, key: Any) -> FlightKeys:
        return self.for_digest(digest(key))

    def for_digest(self, d: str) -> FlightKeys:
        ns = self.namespace
        return FlightKeys(
            digest=d,
            meta=f"{ns}:meta:{{{d}}}",
            result=f"{ns}:result:{{{d}}}",
            stream=f"{ns}:stream:{{{d}}}",
            waiters=f"{ns}:waiters:{{{d}}}",
            marker=f"{ns}:inval:{{{d}}}",
            cost=f"{ns}:cost:{{{d}}}",
        )
