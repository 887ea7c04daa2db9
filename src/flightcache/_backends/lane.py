"""Script calls on blocking sockets, for a thread of their own: the owner's lease renewals.

The renewals must not wait for a busy event loop, so they run on a thread; and on that
thread they use plain blocking connections, not an event loop of its own: an asyncio round
trip is a dozen system calls, and a thread that gives up the GIL at each one waits out the
interpreter's switch interval to get it back behind a busy loop (a renewal took over a
second that way). A blocking round trip is a send and a read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis import exceptions as rexc
from redis.sentinel import Sentinel

from .._config import safe_url
from .._errors import BackendUnavailable
from .convoy import STALE_S, pack_calls
from .listener import keepalive
from .scripts import Script
from .sentinel import SENTINEL_SCHEMES, parse_sentinel_url

# How long more to wait for the answer (seconds), asked again each time that runs out; None:
# stop waiting (nobody needs the answer any more).
Patience = Callable[[], "float | None"]


class Abandoned(Exception):
    """The answer came too late for every call in it: the connection was dropped."""


class SyncLane:
    """One blocking connection to the server of a URL (or to the master the sentinels name),
    for batches of script calls from one thread. Not for a Cluster: redis-py's blocking
    cluster client did not find the new master after a failover (its renewals run on the
    caller's loop)."""

    def __init__(
        self,
        url: str,
        *,
        socket_timeout: float,
        connect_timeout: float,
        client_name: str | None,
    ) -> None:
        self.safe_url = safe_url(url)
        options: dict[str, Any] = dict(
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            client_name=client_name,
            **keepalive(url),
        )
        self._client: redis.Redis
        if url.startswith(SENTINEL_SCHEMES):
            parsed = parse_sentinel_url(url)
            sentinels = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
                parsed.sentinels,
                sentinel_kwargs=dict(
                    socket_connect_timeout=connect_timeout,
                    socket_timeout=connect_timeout,
                    **parsed.sentinel,
                ),
            )
            self._client = sentinels.master_for(  # type: ignore[no-untyped-call, unused-ignore]
                parsed.service, **{**options, **parsed.server}
            )
        else:
            self._client = redis.Redis.from_url(url, max_connections=2, **options)

    def calls(
        self, lua: Script, calls: Sequence[tuple[Sequence[str], Sequence[Any]]], patience: Patience
    ) -> list[Any]:
        """Each call's reply, in order (an error reply is kept as a ``ResponseError``): one
        round trip. ``BackendUnavailable`` when the server cannot
        be reached; :class:`Abandoned` when ``patience`` gave up on the answer."""
        try:
            return self._server_calls(lua, [(lua, keys, args) for keys, args in calls], patience)
        except (rexc.ConnectionError, rexc.TimeoutError, OSError) as e:
            raise BackendUnavailable(
                f"cannot reach Redis at {self.safe_url}: {type(e).__name__}"
            ) from e

    def _server_calls(
        self,
        lua: Script,
        calls: list[tuple[Script, Sequence[str], Sequence[Any]]],
        patience: Patience,
    ) -> list[Any]:
        pool: Any = self._client.connection_pool
        replies: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        loaded = resent = False
        while True:
            connection = pool.get_connection()
            idle = connection.is_connected  # reused: the server may have closed it meanwhile
            sent = time.monotonic()
            missing: list[int] = []
            try:
                packed = pack_calls([calls[i] for i in todo])
                connection.send_packed_command([packed], check_health=False)
                while True:  # the first reply, waited for only as long as it is needed
                    limit = patience()
                    if limit is None:
                        raise Abandoned()
                    if connection.can_read(timeout=limit):
                        break
                for i in todo:
                    try:
                        replies[i] = connection.read_response()
                    except rexc.NoScriptError as exc:
                        replies[i] = exc
                        missing.append(i)
                    except rexc.ResponseError as exc:  # an answer: the connection is fine
                        replies[i] = exc
            except (rexc.ConnectionError, OSError):
                connection.disconnect()
                pool.release(connection)
                if resent or not idle or time.monotonic() - sent > STALE_S:
                    raise
                resent = True
                continue
            except BaseException:
                connection.disconnect()
                pool.release(connection)
                raise
            pool.release(connection)
            if not missing or loaded:
                return replies
            loaded = True
            self._client.script_load(lua.text)
            todo = missing

    def close(self) -> None:
        self._client.close()
        self._client.connection_pool.disconnect()
