"""A Bloom filter kept in a Redis bitmap: "certainly never added" in one round trip.

Sizing, for ``capacity`` n and target false-positive rate p::

    m = ceil(-n ln p / (ln 2)^2)     bits
    k = round(m / n * ln 2)          hash positions per key
    p ~ (1 - e^(-k n / m))^k         after n distinct adds (more adds, more false positives)

(n = 100 000 and p = 0.01 give m = 958 506 bits, 117 KiB, and k = 7.) A key's positions
come from double hashing a 128-bit BLAKE2b digest of its canonical bytes
(:func:`flightcache._keys.canonical`): with ``h1`` and ``h2`` its two little-endian 64-bit
halves, position ``i`` is ``(h1 + i * h2) mod m``.

Each call is one EVALSHA of ``bloom_add`` or ``bloom_check``, which SETBITs or GETBITs all
the positions passed in ARGV, so ``add_many``/``contains_many`` cost one round trip however
many keys they carry; the server runs ``k`` bit operations per key while it holds the
script, so keep one batch to some thousands of keys. (The first call of each script on a
server, or after a restart, also meets NOSCRIPT, and redis-py loads the script and retries.)
Both keys of a filter share one hash tag, so the scripts run on Redis Cluster too.

A second key beside the bitmap holds the parameters (``bloom1:<m>:<k>``): a process that
opens the same name with another capacity or error rate gets :class:`ConfigError` instead
of silently reading positions of a different size. Filters never expire and cannot forget
a key; :meth:`BloomFilter.clear` drops one. A bitmap that the server evicts turns every key
into "not added" (false negatives), so keep filters on a server whose ``maxmemory-policy``
is ``noeviction`` or one of the ``volatile-*`` policies (these keys have no TTL).

On ``memory://`` the bitmap is a ``bytearray`` of this process, shared by the filters of one
FlightCache with the same name, with the same API.
"""

from __future__ import annotations

import hashlib
import math
import re
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

from .._backends.redis import RedisConnection
from .._backends.scripts import scripts
from .._errors import BackendUnavailable, ConfigError, FlightError, PoolExhausted
from .._keys import KeySpace, canonical

LUA = scripts(__package__, "bloom_add", "bloom_check")

__all__ = ["BloomFilter", "admitted", "bloom_keys", "bloom_size"]


class Host(Protocol):
    """All a filter uses of the ``FlightCache`` it lives in."""

    @property
    def namespace(self) -> str: ...

    async def _designated(self) -> RedisConnection | None:
        """The designated server, once the cache is connected; None for ``memory://``."""
        ...


SCHEME = "bloom1"  # names the position scheme above; a filter of another scheme is refused
MAX_BITS = 512 * 1024 * 1024 * 8  # the largest Redis string, 512 MB
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")

# The bitmaps of memory:// caches.
_local: weakref.WeakKeyDictionary[Host, dict[str, tuple[str, bytearray]]] = (
    weakref.WeakKeyDictionary()
)


def bloom_keys(namespace: str, name: str) -> tuple[str, str]:
    """The bitmap and parameter keys of one filter (built in ``_keys`` with every other)."""
    return KeySpace(namespace).bloom(name)


def bloom_size(capacity: int, error_rate: float) -> tuple[int, int]:
    """``(m, k)``: bits and hash positions for ``capacity`` keys at ``error_rate``."""
    bits = math.ceil(-capacity * math.log(error_rate) / math.log(2) ** 2)
    return bits, max(1, round(bits / capacity * math.log(2)))


def _check_args(name: str, capacity: int, error_rate: float) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(
            f"a Bloom filter name is 1-128 letters, digits, '_', '.', ':', '-': {name!r}"
        )
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise ConfigError(f"capacity must be an int > 0: {capacity!r}")
    if (
        isinstance(error_rate, bool)
        or not isinstance(error_rate, (int, float))
        or not 0 < error_rate < 1
    ):
        raise ConfigError(f"error_rate must be a number between 0 and 1: {error_rate!r}")


class BloomFilter:
    """A Bloom filter named ``name`` in the namespace of ``fc`` (see the module docstring).

    ``contains`` answers False only for keys never added; it answers True for keys added
    and, at about ``error_rate`` while at most ``capacity`` keys were added, for others.
    """

    def __init__(self, fc: Host, name: str, capacity: int, error_rate: float) -> None:
        _check_args(name, capacity, error_rate)
        self.name = name
        self.capacity = capacity
        self.error_rate = float(error_rate)
        self.bits, self.hashes = bloom_size(capacity, self.error_rate)
        if self.bits > MAX_BITS:
            raise ConfigError(
                f"a Bloom filter of {capacity} keys at error rate {error_rate:g} needs "
                f"{self.bits} bits ({self.bits / 8 / 2**20:.0f} MB), over the 512 MB of one "
                "Redis string: split it into several filters"
            )
        self.key, self.params_key = bloom_keys(fc.namespace, name)
        self._fc = fc
        self._params = f"{SCHEME}:{self.bits}:{self.hashes}"

    def positions(self, key: Any) -> list[int]:
        """The ``k`` bit offsets of ``key``."""
        return self._offsets([key])

    def false_positive_rate(self, count: int | None = None) -> float:
        """The expected false-positive rate after ``count`` distinct adds (default capacity)."""
        n = self.capacity if count is None else count
        return float((1 - math.exp(-self.hashes * n / self.bits)) ** self.hashes)

    async def add(self, key: Any) -> bool:
        """Add ``key``; True if it was not in the filter before (some bit was still 0)."""
        return (await self.add_many((key,)))[0]

    async def add_many(self, keys: Iterable[Any]) -> list[bool]:
        """Add every key in one round trip; per key, whether it was new (see :meth:`add`)."""
        offsets = self._offsets(keys)
        return await self._run("bloom_add", offsets)

    async def contains(self, key: Any) -> bool:
        """False if ``key`` was certainly never added; True if it probably was."""
        return (await self.contains_many((key,)))[0]

    async def contains_many(self, keys: Iterable[Any]) -> list[bool]:
        """:meth:`contains` for every key, in one round trip."""
        offsets = self._offsets(keys)
        return await self._run("bloom_check", offsets)

    async def clear(self) -> None:
        """Drop the filter: every key reads as never added, and its parameters are free."""
        conn = await self._fc._designated()
        if conn is None:
            _local.get(self._fc, {}).pop(self.key, None)
            return
        client = conn.client
        await conn.run(lambda: client.delete(self.key, self.params_key))

    def _offsets(self, keys: Iterable[Any]) -> list[int]:
        m, k = self.bits, self.hashes
        out: list[int] = []
        for key in keys:
            digest = hashlib.blake2b(canonical(key), digest_size=16).digest()
            h1 = int.from_bytes(digest[:8], "little")
            h2 = int.from_bytes(digest[8:], "little")
            out.extend([(h1 + i * h2) % m for i in range(k)])
        return out

    async def _run(self, script_name: str, offsets: list[int]) -> list[bool]:
        if not offsets:
            return []
        conn = await self._fc._designated()
        if conn is None:
            return self._run_local(script_name == "bloom_add", offsets)
        keys = [self.key, self.params_key]
        args: list[Any] = [self._params, self.hashes, *offsets]
        try:
            reply = await conn.script(LUA[script_name], None, keys, args)
        except FlightError as exc:
            if "WRONGTYPE" in str(exc):
                raise ConfigError(
                    f"key {self.key!r} or {self.params_key!r} holds a value flightcache did "
                    "not write there (another application may share this namespace)"
                ) from exc
            raise
        if reply[0] != 1:
            raise self._mismatch(reply[1])
        return [bool(flag) for flag in reply[1:]]

    def _run_local(self, adding: bool, offsets: list[int]) -> list[bool]:
        filters = _local.setdefault(self._fc, {})
        entry = filters.get(self.key)
        if entry is not None and entry[0] != self._params:
            raise self._mismatch(entry[0])
        if entry is None:
            if not adding:
                return [False] * (len(offsets) // self.hashes)
            entry = filters[self.key] = (self._params, bytearray((self.bits + 7) // 8))
        bitmap = entry[1]
        k = self.hashes
        out: list[bool] = []
        for first in range(0, len(offsets), k):
            flag = not adding
            for offset in offsets[first : first + k]:
                byte, mask = offset >> 3, 0x80 >> (offset & 7)  # Redis's bit order
                if adding:
                    if not bitmap[byte] & mask:
                        bitmap[byte] |= mask
                        flag = True
                elif not bitmap[byte] & mask:
                    flag = False
                    break
            out.append(flag)
        return out

    def _mismatch(self, stored: bytes | str) -> ConfigError:
        text = stored.decode() if isinstance(stored, bytes) else stored
        return ConfigError(
            f"Bloom filter {self.name!r} exists with parameters {text!r}, not "
            f"{self._params!r} (capacity {self.capacity}, error rate {self.error_rate:g}); "
            "open it with its own capacity and error rate, or clear() it"
        )

    def __repr__(self) -> str:
        return (
            f"BloomFilter({self.name!r}, capacity={self.capacity}, "
            f"error_rate={self.error_rate:g}, bits={self.bits}, hashes={self.hashes})"
        )


async def admitted(bloom: BloomFilter, key: Any, *, fail_open: bool) -> bool:
    """Whether ``do(..., admit=bloom)`` may load ``key``: the filter's answer, or, when the
    server is out of reach and the cache fails open, yes (the loader decides)."""
    try:
        return await bloom.contains(key)
    except PoolExhausted:
        raise  # this process is busy, the server is not down: no fail-open for it
    except BackendUnavailable:
        if not fail_open:
            raise
        return True
