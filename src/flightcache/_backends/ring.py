"""A ketama consistent-hash ring: which of several standalone servers holds a key.

The ring agrees with libketama, twemproxy (``distribution: ketama``, ``hash: md5``) and
libmemcached/pylibmc's weighted ketama, so a flightcache process and those clients place a
key on the same server when they are given the same server names:

- Each server gets ``points_per_server`` points (160 by default), scaled by its weight:
  ``floor(weight / total * points_per_server / 4 * servers) * 4``, computed in 32-bit floats
  as the C clients do. For ``i`` in ``0 .. points/4 - 1`` the MD5 digest of the ASCII string
  ``"<name>-<i>"`` gives four points, its 16 bytes read as four little-endian uint32s.
- A key's point is the first 4 bytes of the MD5 digest of the key, little-endian; its server
  is the owner of the first ring point ``>=`` it, wrapping to the lowest point past the top.

The string hashed for a server is the node name exactly as given: use ``"host:port"``
(``"10.0.0.1:6379"``), the address libketama reads from its server file and the name
twemproxy uses when a server line has no alias. libmemcached drops ``":port"`` when the port
is 11211, so name memcached-default servers ``"host"`` to agree with it. Two servers that put
a point at the same value (about one pair in ten million) leave it to the one later in
``nodes``, as Couchbase's ketama test data and dictionary-based rings do; the C clients leave
that tie to their unstable ``qsort``.

We keep these ~100 lines rather than depend on ``uhashring`` (ketama-compatible, about as
fast: 1.0 us a lookup against 0.9 us here): it sends a key that hashes exactly onto a point
to the next point (libketama keeps that point), it hashes ``str(key)``, so a bytes key
``b"k"`` is hashed as the text ``"b'k'"``, and its ring is mutated in place where ours is
an immutable value that concurrent tasks can share.
"""

from __future__ import annotations

import hashlib
import math
import struct
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence

from .._errors import ConfigError

__all__ = ["HashRing", "ketama_hash"]

DEFAULT_POINTS = 160
_F32 = struct.Struct("<f")
_FOUR_U32 = struct.Struct("<4I")


def ketama_hash(key: bytes | str) -> int:
    """The ring position of a key: MD5, first four bytes as a little-endian uint32."""
    data = key.encode("utf-8") if isinstance(key, str) else key
    return int.from_bytes(hashlib.md5(data, usedforsecurity=False).digest()[:4], "little")


def _f32(x: float) -> float:
    """``x`` rounded to a C ``float``, as the C clients' arithmetic rounds each step."""
    return float(_F32.unpack(_F32.pack(x))[0])


def _hashes_per_server(weight: int, total: int, servers: int, points: int) -> int:
    """How many MD5 digests (4 points each) a server gets: twemproxy/libmemcached's formula.

    ``floorf((float)(pct * points / 4 * (float)servers + 1e-10))`` with ``pct`` a float; for
    equal weights this is ``points / 4``. libketama computes ``floorf(pct * 40.0 * servers)``
    in doubles; the two agree but for weights whose share lands within a float's rounding of
    a whole number of digests (its own ketama.servers test file gives the same counts).
    """
    pct = _f32(_f32(float(weight)) / _f32(float(total)))
    scaled = _f32(_f32(_f32(pct * points) / 4) * _f32(float(servers)))
    return math.floor(_f32(scaled + 0.0000000001))


def _server_points(name: str, hashes: int) -> Iterable[int]:
    for i in range(hashes):
        digest = hashlib.md5(f"{name}-{i}".encode(), usedforsecurity=False).digest()
        yield from _FOUR_U32.unpack(digest)


class HashRing:
    """An immutable ketama ring over named servers; :meth:`node_for` maps a key to one.

    ``with_node`` and ``without_node`` return a new ring; only the keys whose arc changed
    owner move (about ``1 / (N + 1)`` of them when one server joins N).
    """

    __slots__ = ("_owners", "_points", "nodes", "points_per_server", "weights")

    def __init__(
        self,
        nodes: Sequence[str],
        *,
        weights: Mapping[str, int] | None = None,
        points_per_server: int = DEFAULT_POINTS,
    ) -> None:
        names = tuple(nodes) if not isinstance(nodes, str) else (nodes,)
        if not names:
            raise ConfigError("a hash ring needs at least one node")
        for name in names:
            if not isinstance(name, str) or not name:
                raise ConfigError(f"node names must be non-empty strings: {name!r}")
        if len(set(names)) != len(names):
            raise ConfigError(f"node names must be unique: {list(names)}")
        if (
            isinstance(points_per_server, bool)
            or not isinstance(points_per_server, int)
            or points_per_server < 4
            or points_per_server % 4
        ):
            raise ConfigError(
                f"points_per_server must be a positive multiple of 4: {points_per_server!r}"
            )
        given = dict(weights or {})
        unknown = set(given) - set(names)
        if unknown:
            raise ConfigError(f"weights name nodes not in the ring: {sorted(unknown)}")
        for name, weight in given.items():
            if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
                raise ConfigError(f"weight of {name!r} must be an int >= 1: {weight!r}")
        self.nodes: tuple[str, ...] = names
        self.weights: dict[str, int] = {name: given.get(name, 1) for name in names}
        self.points_per_server = points_per_server

        total = sum(self.weights.values())
        ring: dict[int, str] = {}
        for name in names:  # a later node takes a shared point (see the module docstring)
            hashes = _hashes_per_server(self.weights[name], total, len(names), points_per_server)
            if hashes < 1:
                raise ConfigError(f"the weight of {name!r} is too small to give it any point")
            for point in _server_points(name, hashes):
                ring[point] = name
        self._points: list[int] = sorted(ring)
        self._owners: list[str] = [ring[p] for p in self._points]

    def node_for(self, key: bytes | str) -> str:
        """The server that holds ``key`` (a str is hashed as its UTF-8 bytes)."""
        data = key.encode("utf-8") if isinstance(key, str) else key
        h = int.from_bytes(hashlib.md5(data, usedforsecurity=False).digest()[:4], "little")
        i = bisect_left(self._points, h)
        return self._owners[i if i < len(self._points) else 0]

    def node_at(self, point: int) -> str:
        """The owner of the first ring point ``>= point`` (wrapping): routing by a known hash."""
        i = bisect_left(self._points, point)
        return self._owners[i if i < len(self._points) else 0]

    @property
    def continuum(self) -> tuple[tuple[int, str], ...]:
        """The sorted ``(point, node)`` pairs of the ring, for inspection and comparisons."""
        return tuple(zip(self._points, self._owners, strict=True))

    def with_node(self, name: str, weight: int = 1) -> HashRing:
        """A new ring with one more server."""
        if name in self.weights:
            raise ConfigError(f"node {name!r} is already in the ring")
        return HashRing(
            (*self.nodes, name),
            weights={**self.weights, name: weight},
            points_per_server=self.points_per_server,
        )

    def without_node(self, name: str) -> HashRing:
        """A new ring without ``name``; its keys spread over the others."""
        if name not in self.weights:
            raise ConfigError(f"node {name!r} is not in the ring")
        rest = tuple(n for n in self.nodes if n != name)
        return HashRing(
            rest,
            weights={n: self.weights[n] for n in rest},
            points_per_server=self.points_per_server,
        )

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"HashRing({list(self.nodes)!r}, points={len(self._points)})"
