"""The exception tree of flightcache.

::

    FlightError                 every error this library raises on purpose
    ├── LeaseLost               a write fenced by a token that no longer owns the flight
    │                           (``set(..., if_token=t)``); the token is ``.token``
    ├── FlightTimeout           a loader ran past its hard timeout, or a wait passed its bound
    ├── RemoteError             the loader failed in another process (type name, message, data)
    ├── StreamRestarted         a stream's owner died after chunks were delivered; a new
    │                           owner started it again, and the two must not be mixed
    ├── ValueTooLarge           an encoded value is over ``max_value_bytes``; nothing was written
    ├── SerializationError      the codec cannot encode or decode a value
    ├── BackendUnavailable      Redis/Valkey cannot be reached (the URL is shown without password)
    │   └── PoolExhausted       this process had no free connection for a whole wait bound: it
    │                           is overloaded, the server is not down (no fail-open for it)
    └── ConfigError             bad arguments or settings, or a foreign value at one of our keys

Every error carries ``.key`` (the key's digest, never the raw key) where one applies.
"""

from __future__ import annotations

from typing import Any


class FlightError(Exception):
    """Base class of every error flightcache raises on purpose."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class LeaseLost(FlightError):
    """A write fenced by a fencing token that no longer owns its key's flight (another
    owner took it over, or it ended): nothing was written. ``.token`` is the refused token."""

    def __init__(self, message: str, *, key: str | None = None, token: int | None = None) -> None:
        super().__init__(message, key=key)
        self.token = token


class FlightTimeout(FlightError):
    """A loader ran past its hard timeout, or a caller's wait passed its bound."""


class RemoteError(FlightError):
    """The loader raised in another process; ``type_name`` and ``message`` describe it.

    ``data`` carries the JSON details the loader's exception offered in its
    ``flightcache_data`` attribute (an upstream's status and error body, say), else None.
    """

    def __init__(
        self, type_name: str, message: str, *, key: str | None = None, data: Any = None
    ) -> None:
        super().__init__(f"{type_name}: {message}", key=key)
        self.type_name = type_name
        self.remote_message = message
        self.data = data


class StreamRestarted(FlightError):
    """A stream's owner died after this caller had chunks; the new owner starts over.

    The caller has a prefix of one generation and the next generation may differ, so the
    two are never mixed: the caller gets this error and may retry the whole request.
    """


class ValueTooLarge(FlightError):
    """An encoded value is larger than ``max_value_bytes``; nothing was written."""

    def __init__(self, size: int, limit: int, *, key: str | None = None) -> None:
        super().__init__(f"encoded value is {size} bytes, over the limit of {limit}", key=key)
        self.size = size
        self.limit = limit


class SerializationError(FlightError):
    """The codec cannot encode or decode a value."""


class BackendUnavailable(FlightError):
    """The Redis/Valkey server cannot be reached."""


class PoolExhausted(BackendUnavailable):
    """Every connection of this process's pool stayed busy for a whole wait bound
    (``socket_timeout`` plus the connect timeout). The process is overloaded, the server is
    not down: fail-open does not take over, and the breaker does not open. Raise
    ``max_connections``, or send fewer concurrent commands."""


class ConfigError(FlightError):
    """Bad arguments or settings, or a value at one of our keys that flightcache did not write."""
