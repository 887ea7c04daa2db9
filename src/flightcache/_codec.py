"""Encoding of values and errors as stored in Redis.

A stored value is one tag byte followed by the payload: ``j`` JSON (orjson, the default),
``m`` msgpack, ``p`` pickle, ``e`` an error record (always JSON). A reader refuses a tag of a
codec it was not configured with, so a shared Redis can never make a JSON reader unpickle.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import orjson

from ._errors import (
    ConfigError,
    FlightTimeout,
    RemoteError,
    SerializationError,
    StreamRestarted,
    ValueTooLarge,
)
from ._types import NOT_FOUND

ERROR_TAG = b"e"
STREAM_TAG = b"S"  # followed by a value envelope of the list of a stream's chunks
NOT_FOUND_TAG = b"n"  # the loader said the thing does not exist (flightcache.NOT_FOUND)
TAGGED_TAG = b"t"  # followed by a tag header and a stored value (_protocol/tags.py)
MAX_ERROR_MESSAGE = 2000
MAX_ERROR_RECORD = 64 * 1024  # an error's details past this are dropped (the error is kept)


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a __str__ that raises must not stop the error from being reported
        return f"<{type(exc).__name__} with an unprintable message>"


def _clean(text: str) -> str:
    """At most MAX_ERROR_MESSAGE characters of valid UTF-8 (lone surrogates escaped)."""
    text = text[:MAX_ERROR_MESSAGE]
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


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
    if (
        not isinstance(tag, bytes)
        or len(tag) != 1
        or tag in (ERROR_TAG, STREAM_TAG, NOT_FOUND_TAG, TAGGED_TAG, b"j", b"m", b"p")
    ):
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

    def encode_stream(self, chunks: list[Any], *, key: str | None = None) -> bytes:
        """A finished stream: its chunks as one stored value, replayed on a hit."""
        return STREAM_TAG + self.encode(chunks, key=key)

    def encode_chunk(self, chunk: Any, *, key: str | None = None) -> bytes:
        """One chunk as it travels on the flight's stream (no tag: the codec is the cache's)."""
        try:
            return self.codec.dumps(chunk)
        except Exception as exc:
            raise SerializationError(
                f"cannot encode a stream chunk of type {type(chunk).__name__}: {exc}", key=key
            ) from exc

    def decode_chunk(self, data: bytes, *, key: str | None = None) -> Any:
        try:
            return self.codec.loads(data)
        except Exception as exc:
            raise SerializationError(f"cannot decode a stream chunk: {exc}", key=key) from exc

    def is_error(self, data: bytes) -> bool:
        return data[:1] == ERROR_TAG

    def is_stream(self, data: bytes) -> bool:
        return data[:1] == STREAM_TAG

    def decode(self, data: bytes, *, key: str | None = None) -> Any:
        """The value in ``data``; raises the stored error when ``data`` is an error record."""
        tag = data[:1]
        if tag == NOT_FOUND_TAG:
            return NOT_FOUND
        if tag == self.codec.tag:
            try:
                return self.codec.loads(data[1:])
            except Exception as exc:
                raise SerializationError(f"cannot decode stored value: {exc}", key=key) from exc
        if tag == ERROR_TAG:
            raise self.error_from(data, key=key)
        if tag == STREAM_TAG:
            return self.decode(data[1:], key=key)
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
            kind, message = type(exc).__name__, _text(exc)
        record: dict[str, Any] = {"type": _clean(kind), "message": _clean(message)}
        if isinstance(exc, FlightTimeout):
            record["flight"] = "timeout"
        if isinstance(exc, StreamRestarted):
            record["flight"] = "restarted"
        details = getattr(exc, "flightcache_data", None)
        if details is None and isinstance(exc, RemoteError):
            details = exc.data
        if details is not None:
            try:
                encoded = orjson.dumps({**record, "data": details})
            except TypeError:
                encoded = b""  # details that are not JSON are dropped, never the error itself
            if 0 < len(encoded) <= MAX_ERROR_RECORD:
                return ERROR_TAG + encoded
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
        if record.get("flight") == "restarted":
            return StreamRestarted(message, key=key)
        return RemoteError(kind, message, key=key, data=record.get("data"))
