"""The Redis/Valkey connection of one FlightCache: client, Lua scripts, and error mapping."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from importlib.resources import files
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis import exceptions as rexc

from ._errors import BackendUnavailable, ConfigError, FlightError
from ._keys import FlightKeys
from ._types import Stats

T = TypeVar("T")

SCRIPT_NAMES = ("join_flight", "claim_flight", "renew_lease", "complete_flight", "fail_flight")


def safe_url(url: str) -> str:
    """The URL with any password replaced, fit for logs and error messages."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, "", ""))


def load_script(name: str) -> str:
    return files("flightcache").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


class RedisConnection:
    """One redis-py asyncio client plus the registered scripts, with errors mapped.

    Every call goes through :meth:`run`, which counts commands and turns driver errors into
    :class:`BackendUnavailable` (connection trouble, URL without password) or
    :class:`ConfigError` (a foreign value of the wrong type at one of our keys).
    """

    def __init__(
        self,
        url: str,
        *,
        stats: Stats,
        socket_timeout: float = 10.0,
        connect_timeout: float = 3.0,
        max_connections: int = 64,
        client_name: str | None = None,
    ) -> None:
        self.url = url
        self.safe_url = safe_url(url)
        self.stats = stats
        self.socket_timeout = socket_timeout
        try:
            pool = aioredis.BlockingConnectionPool.from_url(
                url,
                max_connections=max_connections,
                timeout=connect_timeout + socket_timeout,
                socket_timeout=socket_timeout,
                socket_connect_timeout=connect_timeout,
                socket_keepalive=True,
                client_name=client_name,
                decode_responses=False,
            )
        except ValueError as exc:
            raise ConfigError(f"bad Redis URL {self.safe_url}: {exc}") from exc
        self.client: aioredis.Redis = aioredis.Redis(connection_pool=pool)
        self.scripts = {
            name: self.client.register_script(load_script(name)) for name in SCRIPT_NAMES
        }

    async def run(self, op: Callable[[], Awaitable[T]], fk: FlightKeys | None = None) -> T:
        self.stats.commands += 1
        try:
            return await op()
        except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
            raise BackendUnavailable(
                f"cannot reach Redis at {self.safe_url}: {type(exc).__name__}"
            ) from exc
        except rexc.ResponseError as exc:
            if "WRONGTYPE" in str(exc) and fk is not None:
                raise await self._wrong_type(fk) from exc
            raise FlightError(f"Redis at {self.safe_url} refused a command: {exc}") from exc

    async def script(
        self, name: str, fk: FlightKeys, keys: Sequence[str], args: Sequence[Any]
    ) -> Any:
        script = self.scripts[name]
        return await self.run(lambda: script(keys=list(keys), args=list(args)), fk)

    async def _wrong_type(self, fk: FlightKeys) -> ConfigError:
        expected = {
            fk.result: b"string",
            fk.meta: b"hash",
            fk.stream: b"stream",
            fk.waiters: b"list",
        }
        for name, want in expected.items():
            try:
                got: Any = await self.client.type(name)
            except rexc.RedisError:
                continue
            if got not in (want, b"none"):
                return ConfigError(
                    f"key {name!r} holds a {got.decode()}, not what flightcache writes there "
                    "(another application may share this namespace)",
                    key=fk.digest,
                )
        return ConfigError(
            f"a key of flight {fk.digest} holds a value of the wrong type", key=fk.digest
        )

    async def aclose(self) -> None:
        await self.client.aclose()
        await self.client.connection_pool.disconnect()  # a pool we made is ours to close
