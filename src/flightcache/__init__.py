"""flightcache: run an expensive call once across many processes, share the result, cache it.

See ``FlightCache`` for the API and ``docs/`` for the protocol.
"""

from ._bloom import BloomFilter
from ._cache import FlightCache
from ._codec import Codec
from ._embedded import EmbeddedServer
from ._errors import (
    BackendUnavailable,
    ConfigError,
    FlightError,
    FlightTimeout,
    LeaseLost,
    RemoteError,
    SerializationError,
    StreamRestarted,
    ValueTooLarge,
)
from ._flight import Tuning
from ._nodes import Invalidation, NodeInfo
from ._ring import HashRing
from ._streaming import FlightStream
from ._types import MISSING, NOT_FOUND, UNSET, FlightInfo

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
    "FlightError",
    "FlightInfo",
    "FlightStream",
    "FlightTimeout",
    "HashRing",
    "Invalidation",
    "LeaseLost",
    "NodeInfo",
    "RemoteError",
    "SerializationError",
    "StreamRestarted",
    "Tuning",
    "ValueTooLarge",
    "__version__",
]
