"""flightcache: run an expensive call once across many processes, share the result, cache it.

See ``FlightCache`` for the API (``FlightCacheSync`` for threads and sync code) and ``docs/``
for the protocol.
"""

from ._backends.embedded import EmbeddedServer
from ._backends.ring import HashRing
from ._cache import FlightCache
from ._codec import Codec
from ._config import Tuning
from ._errors import (
    BackendUnavailable,
    ConfigError,
    FlightError,
    FlightTimeout,
    LeaseLost,
    PoolExhausted,
    RemoteError,
    SerializationError,
    StreamRestarted,
    ValueTooLarge,
)
from ._leases.nodes import NodeInfo
from ._protections.bloom import BloomFilter
from ._protocol.context import FlightContext
from ._protocol.streaming import FlightStream
from ._sync import FlightCacheSync, FlightStreamSync
from ._types import MISSING, NOT_FOUND, UNSET, FlightInfo, Invalidation

__version__ = "0.1.0"

__all__ = [
    "MISSING",
    "NOT_FOUND",
    "UNSET",
    "BackendUnavailable",
    "BloomFilter",
    "Codec",
    "ConfigError",
    "EmbeddedServer",
    "FlightCache",
    "FlightCacheSync",
    "FlightContext",
    "FlightError",
    "FlightInfo",
    "FlightStream",
    "FlightStreamSync",
    "FlightTimeout",
    "HashRing",
    "Invalidation",
    "LeaseLost",
    "NodeInfo",
    "PoolExhausted",
    "RemoteError",
    "SerializationError",
    "StreamRestarted",
    "Tuning",
    "ValueTooLarge",
    "__version__",
]
