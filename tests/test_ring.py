"""The ketama ring: agreement with libketama and other clients, balance, and remapping."""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import math
import random
import time
from bisect import bisect_left
from collections import Counter

import pytest

from flightcache import ConfigError
from flightcache._backends.ring import HashRing, ketama_hash

# RJ/ketama's ketama.servers: the server file of libketama's own test harness.
LIBKETAMA_SERVERS = {
    "10.0.1.1:11211": 600,
    "10.0.1.2:11211": 300,
    "10.0.1.3:11211": 200,
    "10.0.1.4:11211": 350,
    "10.0.1.5:11211": 1000,
    "10.0.1.6:11211": 800,
    "10.0.1.7:11211": 950,
    "10.0.1.8:11211": 100,
}

KEYS = 100_000


@pytest.fixture(scope="module")
def random_keys() -> list[bytes]:
    rng = random.Random(20240611)
    return [rng.randbytes(16) for _ in range(KEYS)]


def ketama_test_output(ring: HashRing, count: int) -> str:
    """What libketama's ketama_test prints: an empty error line, then per key i in 0..count-1
    ``"<hash of str(i)> <continuum point> <server>"``."""
    points = [p for p, _ in ring.continuum]
    lines = ["\n"]
    for i in range(count):
        h = ketama_hash(str(i))
        j = bisect_left(points, h)
        point = points[j if j < len(points) else 0]
        lines.append(f"{h} {point} {ring.node_for(str(i))}\n")
    return "".join(lines)


# -- published vectors ------------------------------------------------------------------


def test_libketama_harness_first_lines() -> None:
    """The first lines of ketama_test over ketama.servers, as Wikimedia's HashRing test
    quotes them from the C library's output."""
    ring = HashRing(list(LIBKETAMA_SERVERS), weights=LIBKETAMA_SERVERS)
    assert ketama_test_output(ring, 5) == (
        "\n"
        "2216742351 2217271743 10.0.1.1:11211\n"
        "943901380 949045552 10.0.1.5:11211\n"
        "2373066440 2374693370 10.0.1.6:11211\n"
        "2127088620 2130338203 10.0.1.6:11211\n"
        "2046197672 2051996197 10.0.1.7:11211\n"
    )


@pytest.mark.parametrize(
    ("count", "md5"),
    [
        (1000, "d1a4912a80e4654ec2e4e462c8b911c6"),  # Wikimedia HashRingTest, from the C code
        (1_000_000, "5672b131391f5aa2b280936aec1eea74"),  # libketama's own test.sh
    ],
)
def test_libketama_harness_digest(count: int, md5: str) -> None:
    """libketama's test.sh checks the MD5 of ketama_test's whole output: weighted servers,
    one million keys; the same bytes come out of this ring."""
    ring = HashRing(list(LIBKETAMA_SERVERS), weights=LIBKETAMA_SERVERS)
    assert hashlib.md5(ketama_test_output(ring, count).encode()).hexdigest() == md5


def test_couchbase_rfc26_vectors() -> None:
    """Couchbase SDK RFC 26 (ketama for memcached buckets) and its Java client's tests."""
    ring = HashRing([f"192.168.1.{i}:11210" for i in (101, 102, 103, 104)])
    assert ring.node_at(4294967295) == "192.168.1.104:11210"  # past the top: wraps
    assert len(ring.continuum) == 640
    # Two servers with one point in common: the later one in the list keeps it.
    a, b = "example.com:11210", "example137723.com:11210"
    assert len(HashRing([a, b]).continuum) == 319
    assert HashRing([a, b]).node_at(1723476360) == b
    assert HashRing([b, a]).node_at(1723476360) == a


# -- an independent implementation written from the description -------------------------


def reference_ring(nodes: list[str], weights: dict[str, int]) -> list[tuple[int, int, str]]:
    """libketama's continuum, literally: ``floorf(pct * 40.0 * n)`` digests per server."""
    total = sum(weights.values())
    entries = []
    for order, name in enumerate(nodes):
        pct = ctypes.c_float(ctypes.c_float(weights[name]).value / total).value
        digests = math.floor(ctypes.c_float(pct * 40.0 * len(nodes)).value)
        for k in range(digests):
            d = hashlib.md5(f"{name}-{k}".encode()).digest()
            for h in range(4):
                point = d[3 + h * 4] << 24 | d[2 + h * 4] << 16 | d[1 + h * 4] << 8 | d[h * 4]
                entries.append((point, -order, name))  # ties: the later server first
    return sorted(entries)


def reference_lookup(entries: list[tuple[int, int, str]], key: str) -> str:
    d = hashlib.md5(key.encode()).digest()
    h = d[3] << 24 | d[2] << 16 | d[1] << 8 | d[0]
    for point, _, name in entries:
        if point >= h:
            return name
    return entries[0][2]


@pytest.mark.parametrize(
    "weights",
    [
        {"127.0.0.1:6379": 1},
        {"10.0.0.1:6379": 1, "10.0.0.2:6379": 1, "10.0.0.3:6379": 1},
        {"a:1": 1, "b:2": 2, "c:3": 3, "d:4": 5},
        LIBKETAMA_SERVERS,
    ],
    ids=["one", "three-equal", "weighted", "libketama-file"],
)
def test_matches_reference_implementation(weights: dict[str, int]) -> None:
    nodes = list(weights)
    ring = HashRing(nodes, weights=weights)
    entries = reference_ring(nodes, weights)
    assert [p for p, _ in ring.continuum] == [p for p, _, _ in entries]
    rng = random.Random(5)
    for _ in range(500):
        key = f"user:{rng.getrandbits(48)}"
        assert ring.node_for(key) == reference_lookup(entries, key)
    for point, _, name in entries[:50]:  # a key landing exactly on a point stays there
        assert ring.node_at(point) == name


@pytest.mark.skipif(
    importlib.util.find_spec("uhashring") is None, reason="uhashring is not installed"
)
@pytest.mark.parametrize("weighted", [False, True])
def test_agrees_with_uhashring(weighted: bool) -> None:
    """A third-party ketama ring (uhashring, used only here) places keys the same way."""
    from uhashring import HashRing as UHashRing  # type: ignore[import-untyped]

    weights = LIBKETAMA_SERVERS if weighted else dict.fromkeys(LIBKETAMA_SERVERS, 1)
    theirs = UHashRing(nodes={name: {"weight": w} for name, w in weights.items()}, hash_fn="ketama")
    ours = HashRing(list(weights), weights=weights)
    points = {p for p, _ in ours.continuum}
    rng = random.Random(9)
    for _ in range(20_000):
        key = f"{rng.getrandbits(64):x}"
        if ketama_hash(key) not in points:
            assert ours.node_for(key) == theirs.get_node(key)
    # The one difference: a key that hashes exactly onto a point. libketama keeps that point
    # (``h <= point``), uhashring's bisect_right goes on to the next one. This key, met in
    # the loop above, hashes onto 1923128066, a point of 10.0.1.5 in both rings.
    key = "1afd3e74a197cf17"
    assert ketama_hash(key) == 1923128066 and ours.node_at(1923128066) == "10.0.1.5:11211"
    assert ours.node_for(key) == "10.0.1.5:11211" != theirs.get_node(key)


def test_str_key_is_its_utf8_bytes() -> None:
    ring = HashRing(["a:1", "b:1", "c:1"])
    for key in ("plain", "ünïcode", "emoji \N{ROCKET}"):
        assert ring.node_for(key) == ring.node_for(key.encode())
        assert ring.node_for(key) == ring.node_at(ketama_hash(key))


# -- balance and remapping --------------------------------------------------------------


def _max_over_mean(ring: HashRing, keys: list[bytes]) -> float:
    counts = Counter(ring.node_for(k) for k in keys)
    assert set(counts) == set(ring.nodes)
    return max(counts.values()) / (len(keys) / len(ring.nodes))


@pytest.mark.parametrize("n", range(3, 11))
def test_balance_with_ketama_points(n: int, random_keys: list[bytes]) -> None:
    """With ketama's 160 points a server's share of the circle varies by about
    1/sqrt(160) = 8 %, so max/mean is 1.05-1.15 for these names (and above 1.10 for half
    or more of all random sets of names at N >= 6). This bound guards against a broken ring; the
    1.10 target needs more points (next test), which no other ketama client would share."""
    ratio = _max_over_mean(HashRing([f"127.0.0.1:{7000 + i}" for i in range(n)]), random_keys)
    print(f"ketama-160 N={n} max/mean={ratio:.3f}")
    assert ratio <= 1.25


@pytest.mark.parametrize("n", range(3, 11))
@pytest.mark.parametrize("pattern", ["127.0.0.1:{}", "10.0.0.{}:6379", "redis-{}:6379"])
def test_balance_target_with_640_points(n: int, pattern: str, random_keys: list[bytes]) -> None:
    names = [pattern.format(7000 + i if pattern.startswith("127") else i) for i in range(n)]
    ratio = _max_over_mean(HashRing(names, points_per_server=640), random_keys[:50_000])
    print(f"640 points {pattern} N={n} max/mean={ratio:.3f}")
    assert ratio <= 1.10


@pytest.mark.parametrize("n", range(3, 11))
@pytest.mark.parametrize("pattern", ["127.0.0.1:{}", "10.0.0.{}:6379"])
def test_adding_a_shard_moves_only_its_share(
    n: int, pattern: str, random_keys: list[bytes]
) -> None:
    def name(i: int) -> str:
        return pattern.format(7000 + i if pattern.startswith("127") else i)

    before = HashRing([name(i) for i in range(n)])
    after = before.with_node(name(n))
    moved = 0
    for key in random_keys:
        old, new = before.node_for(key), after.node_for(key)
        if old != new:
            assert new == name(n)  # keys only ever move onto the new shard
            moved += 1
    fraction = moved / len(random_keys)
    print(f"ketama-160 {pattern} N={n}->{n + 1} moved={fraction:.4f} ideal={1 / (n + 1):.4f}")
    assert fraction <= 1.2 / (n + 1)


def test_removing_a_shard_moves_only_its_keys(random_keys: list[bytes]) -> None:
    before = HashRing([f"10.0.0.{i}:6379" for i in range(6)])
    after = before.without_node("10.0.0.2:6379")
    for key in random_keys[:20_000]:
        if before.node_for(key) != "10.0.0.2:6379":
            assert after.node_for(key) == before.node_for(key)
    assert after.nodes == tuple(n for n in before.nodes if n != "10.0.0.2:6379")


def test_node_for_time(random_keys: list[bytes]) -> None:
    """Reported, not asserted: the cost of one lookup (MD5 of the key plus a bisect)."""
    ring = HashRing([f"10.0.0.{i}:6379" for i in range(10)])
    node_for = ring.node_for
    start = time.perf_counter()
    for key in random_keys:
        node_for(key)
    per_call = (time.perf_counter() - start) / len(random_keys)
    print(f"node_for: {per_call * 1e6:.2f} us per call over 10 shards (1600 points)")


# -- arguments -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodes", "kwargs"),
    [
        ([], {}),
        (["a:1", "a:1"], {}),
        (["a:1", ""], {}),
        (["a:1"], {"weights": {"b:1": 1}}),
        (["a:1"], {"weights": {"a:1": 0}}),
        (["a:1"], {"weights": {"a:1": 1.5}}),
        (["a:1"], {"points_per_server": 0}),
        (["a:1"], {"points_per_server": 162}),
        (["a:1"], {"points_per_server": True}),
        (["a:1", "b:1"], {"weights": {"a:1": 1, "b:1": 10_000}}),  # a gets no point
    ],
)
def test_bad_arguments(nodes: list[str], kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        HashRing(nodes, **kwargs)  # type: ignore[arg-type]


def test_with_and_without_node_checks() -> None:
    ring = HashRing(["a:1", "b:1"])
    with pytest.raises(ConfigError):
        ring.with_node("a:1")
    with pytest.raises(ConfigError):
        ring.without_node("c:1")
    with pytest.raises(ConfigError):
        ring.without_node("a:1").without_node("b:1")  # no node left
    assert ring.with_node("c:1", weight=2).weights == {"a:1": 1, "b:1": 1, "c:1": 2}
    assert len(ring) == 2 and "points=320" in repr(ring)
