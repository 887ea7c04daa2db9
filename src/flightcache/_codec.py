"""Encoding of values and errors as stored in Redis.

A stored value is one tag byte followed by the payload: ``j`` JSON (orjson, the default),
``m`` msgpack, ``p`` pickle, ``e`` an error record (always JSON). A reader refuses a tag of a
codec it was not configured with, so a shared Redis can never make a JSON reader unpickle.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import orjson

from ._errors import ConfigError, FlightTimeout, RemoteError, SerializationError, ValueTooLarge

ERROR_TAG = b"e"
MAX_ERROR_MESSAGE = 2000


class Codec(Protocol):
    tag: bytes

    def dumps(self, value: Any) -> bytes: ...

    def loads(self, data: bytes) -> Any: ...


class JsonCodec:
    tag = b"j"

    def dumps(self, value: Any) -> bytes:
        return orjson.dumps(value)

    def loads(self, data: bytes) -> Any:
        return orjson.loads(data)


class MsgpackCodec:
    tag = b"m"

    def __init__(self) -> None:
        try:
            self._msgpack: Any = importlib.import_module("msgpack")
        except ImportError as exc:
            raise ConfigError("codec 'msgpack' needs: pip install 'flightcache[msgpack]'") from exc

    def dumps(self, value: Any) -> bytes:
        return bytes(self._msgpack.packb(value, use_bin_type=True))

    def loads(self, data: bytes) -> Any:
        return self._msgpack.unpackb(data, raw=False)


class PickleCodec:
    """Opt-in only: any writer to the namespace can run code in every reader."""

    tag = b"p"

    def __init__(self) -> None:
        self._pickle: Any = importlib.import_module("pickle")

    def dumps(self, value: Any) -> bytes:
        return bytes(self._pickle.dumps(value, protocol=5))

    def loads(self, data: bytes) -> Any:
        return self._pickle.loads(data)


def make_codec(codec: str | Codec) -> Codec:
    if codec == "json":
        return JsonCodec()
    if codec == "msgpack":
        return MsgpackCodec()
    if codec == "pickle":
        return PickleCodec()
    if isinstance(codec, str):
        raise ConfigError(f"unknown codec {codec!r}: use 'json', 'msgpack', 'pickle' or an object")
    tag = getattr(codec, "tag", None)
    if not isinstance(tag, bytes) or len(tag) != 1 or tag in (ERROR_TAG, b"j", b"m", b"p"):
        raise ConfigError("a custom codec needs a one-byte .tag not used by the built-in codecs")
    return codec


class Envelope:
    """Turns values and errors into stored bytes and back, enforcing the size limit."""

    def __init__(self, codec: Codec, max_value_bytes: int) -> None:
        self.codec = codec
        self.max_value_bytes = max_value_bytes

    def encode(self, value: Any, *, key: str | None = None) -> bytes:
        try:
            data = self.codec.tag + self.codec.dumps(value)
        except Exception as exc:
            raise SerializationError(
                f"cannot encode a {type(value).__name__} with codec "
                f"{type(self.codec).__name__}: {exc}",
                key=key,
            ) from exc
        if len(data) > self.max_value_bytes:
            raise ValueTooLarge(len(data), self.max_value_bytes, key=key)
        return data

    def is_error(self, data: bytes) -> bool:
        return data[:1] == ERROR_TAG

    def decode(self, data: bytes, *, key: str | None = None) -> Any:
        """The value in ``data``; raises the stored error when ``data`` is an error record."""
        tag = data[:1]
        if tag == self.codec.tag:
            try:
                return self.codec.loads(data[1:])
            except Exception as exc:
                raise SerializationError(f"cannot decode stored value: {exc}", key=key) from exc
        if tag == ERROR_TAG:
            raise self.error_from(data, key=key)
        raise SerializationError(
            f"stored value has codec tag {tag!r}, this cache reads {self.codec.tag!r}: "
            "two caches with different codecs share a namespace",
            key=key,
        )

    @staticmethod
    def encode_error(exc: BaseException) -> bytes:
        if isinstance(exc, RemoteError):
            kind, message = exc.type_name, exc.remote_message
        else:
            kind, message = type(exc).__name__, str(exc)
        record = {"type": kind, "message": message[:MAX_ERROR_MESSAGE]}
        if isinstance(exc, FlightTimeout):
            record["flight"] = "timeout"
        return ERROR_TAG + orjson.dumps(record)

    @staticmethod
    def error_from(data: bytes, *, key: str | None = None) -> Exception:
        try:
            record = orjson.loads(data[1:])
            kind, message = str(record["type"]), str(record["message"])
        except Exception:
            return SerializationError("stored error record is malformed", key=key)
        if record.get("flight") == "timeout":
            return FlightTimeout(message, key=key)
        return RemoteError(kind, message, key=key)
