"""One pub/sub connection per server, shared by everything in a process that waits for news.

A :class:`Listener` subscribes to a fixed set of channels (given before it starts), hands
each message to its channel's handler, and keeps the connection honest: a ping when it has
been quiet for ``ping_s``, a reconnect (with backoff; on a Cluster, to the next node, since
any node hears every ``PUBLISH``) when the connection fails or a ping goes unanswered.
Whenever it (re)subscribes, and whenever it loses the connection, every channel's
``on_gap`` runs: a message may have been missed, and only the owner of the channel knows how
to recover (re-read a stream, forget leased copies). Waiting costs no connection but this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as rexc

from .._waits import within

log = logging.getLogger("flightcache.listener")


@dataclass(frozen=True, slots=True)
class Channel:
    name: str
    on_message: Callable[[bytes], None]
    on_gap: Callable[[], None]


class Listener:
    """Subscribes to ``channels`` on one server (``urls()``: where to connect, in turn)."""

    def __init__(
        self,
        urls: Callable[[], list[str]],
        *,
        client_name: str,
        ping_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._urls = urls
        self._client_name = client_name.replace(" ", "_")
        self.ping_s = ping_s
        self._clock = clock
        self._channels: dict[str, Channel] = {}
        self._task: asyncio.Task[None] | None = None
        self._client: aioredis.Redis | None = None
        self._subscribed = asyncio.Event()
        self._stopping = False
        self.reconnects = 0

    @property
    def subscribed(self) -> bool:
        """Whether every channel is subscribed now (the server answered ``SUBSCRIBE``)."""
        return self._subscribed.is_set()

    def add(
        self, name: str, on_message: Callable[[bytes], None], on_gap: Callable[[], None]
    ) -> None:
        if self._task is not None:
            raise RuntimeError("channels are added before the listener starts")
        self._channels[name] = Channel(name, on_message, on_gap)

    def start(self) -> None:
        if self._task is None and self._channels:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def wait_subscribed(self, timeout: float) -> bool:
        with contextlib.suppress(asyncio.TimeoutError):
            await within(self._subscribed.wait(), timeout)
        return self.subscribed

    async def aclose(self) -> None:
        self._stopping = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            _, pending = await asyncio.wait([task], timeout=1.0)
            if pending and self._client is not None:
                # redis-py's get_message can swallow a cancellation that lands as its read
                # times out; a closed connection ends the listener for sure.
                await self._client.connection_pool.disconnect()
                await asyncio.wait(pending, timeout=2.0)
        await self._drop_client()

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()
                await client.connection_pool.disconnect()

    def _connect(self, attempt: int) -> aioredis.Redis:
        urls = self._urls()
        return aioredis.Redis(
            connection_pool=aioredis.ConnectionPool.from_url(
                urls[attempt % len(urls)],
                max_connections=2,
                socket_connect_timeout=3.0,
                socket_timeout=max(self.ping_s, 2.0),  # subscribe and ping are bounded
                client_name=self._client_name,
                **keepalive(urls[attempt % len(urls)]),
            )
        )

    async def _confirmed(self, pubsub: Any) -> None:
        """Until the server confirmed every SUBSCRIBE (redis-py sends them, it does not
        wait for the answers); within one ping interval, or the connection is given up."""
        deadline = self._clock() + self.ping_s
        waiting = len(self._channels)
        while waiting:
            left = deadline - self._clock()
            if left <= 0:
                raise rexc.ConnectionError("SUBSCRIBE was not confirmed")
            message = await pubsub.get_message(ignore_subscribe_messages=False, timeout=left)
            if message is None:
                continue
            if message.get("type") == "subscribe":
                waiting -= 1
            elif message.get("type") == "message":
                self._dispatch(message)

    def _dispatch(self, message: dict[str, Any]) -> None:
        channel = self._channels.get(_text(message.get("channel")))
        if channel is not None:
            try:
                channel.on_message(message["data"])
            except Exception:  # a handler's bug must not deafen the others
                log.exception("listener: handler of %s failed", channel.name)

    def _gap(self) -> None:
        for channel in self._channels.values():
            try:
                channel.on_gap()
            except Exception:  # a handler's bug must not deafen the others
                log.exception("listener: gap handler of %s failed", channel.name)

    async def _run(self) -> None:
        backoff = 0.1
        attempt = 0
        while not self._stopping:
            await self._drop_client()
            self._client = self._connect(attempt)
            attempt += 1
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(*self._channels)
                await self._confirmed(pubsub)  # only then is a message sure to arrive
                self._subscribed.set()
                # Anything said while we were not subscribed is lost: say so.
                self._gap()
                backoff = 0.1
                pinged: float | None = None
                heard = self._clock()
                while not self._stopping:
                    message = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=self.ping_s
                    )
                    if message is None and self._clock() - heard < self.ping_s:
                        continue  # a reply it ignores (SUBSCRIBE's), not a quiet interval
                    if message is None:
                        # A dead connection must not pass for a quiet one: ping, and give up
                        # on it if the answer has not come by the next quiet interval.
                        if pinged is not None and self._clock() - pinged > self.ping_s:
                            raise rexc.ConnectionError("no answer to a ping")
                        if pinged is None:
                            await pubsub.ping()
                            pinged = self._clock()
                        continue
                    heard = self._clock()
                    kind = message.get("type")
                    if kind == "pong":
                        pinged = None
                    elif kind == "message":
                        pinged = None  # the connection works
                        self._dispatch(message)
            except (rexc.RedisError, OSError) as exc:
                was_subscribed = self.subscribed
                self._subscribed.clear()
                self._gap()  # deaf now: anything may be missed until we are back
                if self._stopping:
                    return
                self.reconnects += 1
                # A lost subscription is news; a server not reachable yet is the callers' to
                # report (they fail open or raise), not the listener's.
                (log.warning if was_subscribed else log.info)(
                    "listener %s lost (%s); reconnecting", self._client_name, exc
                )
                await asyncio.sleep(backoff)  # reconnect backoff
                backoff = min(backoff * 2, 2.0)
            finally:
                self._subscribed.clear()
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]


def keepalive(url: str) -> dict[str, bool]:
    """TCP keepalive for a TCP URL; a Unix socket has none (redis-py's Unix connection takes
    no such argument)."""
    return {} if url.startswith("unix://") else {"socket_keepalive": True}


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
