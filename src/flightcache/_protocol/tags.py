"""Tags on stored results: a version counter per tag, recorded with the result, checked on read.

A result stored with tags carries the version of each tag as it was read before its loader
started: ``t`` + a JSON header ``[[tag, version], ...]`` + ``\\n`` + the stored value as it
would be without tags. ``invalidate_tags`` increments each tag's counter (one key per tag,
``<ns>:tag:{<ns>:tag:<name>}``, a slot of its own on a Cluster), so every result recorded
before is stale at once, however many there are: a read whose recorded versions differ
from the current ones is a miss (docs/protocol.md, "Tags"). Untagged results have no header
and their reads never look at a tag.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import orjson

from .._backends.redis import RedisConnection
from .._codec import TAGGED_TAG
from .._errors import BackendUnavailable, ConfigError, PoolExhausted, SerializationError
from .._keys import KeySpace

UNKNOWN = -1  # a version that could not be read: it matches nothing, so the result is stale

Versions = dict[str, int]


def tagged(versions: Versions, data: bytes) -> bytes:
    """``data`` (a stored value, or the not-found record) with its tags' versions."""
    header = orjson.dumps(sorted(versions.items()))
    return TAGGED_TAG + header + b"\n" + data


def untag(data: bytes) -> tuple[list[tuple[str, int]], bytes]:
    """The recorded ``(tag, version)`` pairs of a tagged result, and its value."""
    end = data.find(b"\n")
    if end < 0:
        raise SerializationError("a tagged result has no value")
    try:
        pairs = [(str(name), int(version)) for name, version in orjson.loads(data[1:end])]
    except (orjson.JSONDecodeError, TypeError, ValueError) as exc:
        raise SerializationError(f"a tagged result's header is malformed: {exc}") from exc
    return pairs, data[end + 1 :]


class TagGate(Protocol):
    """Reads tags' current versions (the designated server's counters, or this process's)."""

    fail_open: bool  # whether a read the server cannot answer counts as a miss

    async def read(self, names: Sequence[str]) -> Versions: ...

    async def bump(self, names: Sequence[str]) -> None:
        """Increment each tag's counter (``invalidate_tags``)."""
        ...


class RedisTags:
    """Tag counters on the designated server: one ``MGET`` a read (one pipeline of ``GET``s
    on a Cluster, one round trip per node), one pipeline of ``INCR``s a bump."""

    def __init__(self, conn: RedisConnection, keyspace: KeySpace, *, fail_open: bool) -> None:
        self.conn = conn
        self.keyspace = keyspace
        self.fail_open = fail_open

    async def read(self, names: Sequence[str]) -> Versions:
        keys = [self.keyspace.tag(name) for name in names]
        client = self.conn.client
        if self.conn.cluster is None:
            values: Any = await self.conn.run(lambda: client.mget(keys))
        else:

            async def each() -> list[Any]:
                pipe: Any = client.pipeline(transaction=False)
                for key in keys:
                    pipe.get(key)
                return list(await pipe.execute())

            values = await self.conn.run(each)
        try:
            return {name: int(v or 0) for name, v in zip(names, values, strict=True)}
        except ValueError as exc:
            raise ConfigError(
                f"a tag's counter holds something flightcache did not write: {exc}"
            ) from exc

    async def bump(self, names: Sequence[str]) -> None:
        client = self.conn.client
        keys = [self.keyspace.tag(name) for name in names]

        async def increment() -> None:
            pipe: Any = client.pipeline(transaction=False)
            for key in keys:
                pipe.incr(key)
            await pipe.execute()

        await self.conn.run(increment)


class MemoryTags:
    """Tag counters of this process (``memory://``)."""

    fail_open = False

    def __init__(self) -> None:
        self.versions: Versions = {}

    async def read(self, names: Sequence[str]) -> Versions:
        return {name: self.versions.get(name, 0) for name in names}

    async def bump(self, names: Sequence[str]) -> None:
        for name in names:
            self.versions[name] = self.versions.get(name, 0) + 1


async def current(gate: TagGate | None, data: bytes) -> tuple[bytes, tuple[str, ...]] | None:
    """The value of the tagged result ``data`` and its tags, if the versions it recorded are
    the current ones, read now; None if an invalidation overtook it (or, failing open, the
    server cannot say). Read after ``data`` was, so a result that passes was current then."""
    pairs, inner = untag(data)
    if gate is None:
        return None
    try:
        now = await gate.read([name for name, _ in pairs])
    except PoolExhausted:
        raise  # this process is busy: no answer, not a miss
    except BackendUnavailable:
        if gate.fail_open:
            return None  # a miss: the flight runs again, in this process if need be
        raise
    if any(now[name] != version for name, version in pairs):
        return None
    return inner, tuple(name for name, _ in pairs)
