"""A TCP proxy on loopback whose connections a test can cut, or whose replies it can hold.

Cutting takes a node off the server (a partition). Holding replies makes a request reach the
server while its answer is delayed on the way back, like a slow network: the test decides
when the answer arrives. Both act on the proxy's own sockets, never on the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class CuttableProxy:
    """Forwards 127.0.0.1:<port> to a target.

    ``cut()`` drops every connection and refuses new ones, like a network partition between
    its clients and the server, until ``heal()``. ``hold_replies()`` keeps what the server
    sends back on every connection that has not subscribed to a pub/sub channel (commands
    reach the server; their answers wait in the proxy) until ``release_replies()``; pub/sub
    connections keep flowing, so a node still hears messages while its commands' answers
    are late.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._cut = False
        self._holding = False
        self._released = asyncio.Event()
        self._held = bytearray()  # a copy of every reply held so far, for tests to look at
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self) -> CuttableProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(5)
        return self

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers.update((writer, up_writer))
        subscriber = [False]

        async def upstream() -> None:
            with contextlib.suppress(Exception):
                while data := await reader.read(65536):
                    if b"SUBSCRIBE" in data.upper():
                        subscriber[0] = True
                    up_writer.write(data)
                    await up_writer.drain()
            up_writer.close()

        async def downstream() -> None:
            with contextlib.suppress(Exception):
                while data := await up_reader.read(65536):
                    while self._holding and not subscriber[0]:
                        self._held.extend(data)
                        await self._released.wait()
                    writer.write(data)
                    await writer.drain()
            writer.close()

        await asyncio.gather(upstream(), downstream())

    def _call(self, fn: object) -> object:
        async def run() -> object:
            return fn()  # type: ignore[operator]

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(5)

    def hold_replies(self) -> None:
        def hold() -> None:
            self._holding = True
            self._released.clear()
            self._held.clear()

        self._call(hold)

    def held(self) -> bytes:
        """Everything the server answered while replies were held (not yet delivered)."""
        return bytes(self._call(lambda: bytes(self._held)))  # type: ignore[arg-type]

    def release_replies(self) -> None:
        def release() -> None:
            self._holding = False
            self._released.set()

        self._call(release)

    def cut(self) -> None:
        async def cut() -> None:
            self._cut = True
            self._holding = False
            self._released.set()
            for w in list(self._writers):
                w.transport.abort()

        asyncio.run_coroutine_threadsafe(cut(), self._loop).result(5)

    def heal(self) -> None:
        """End the partition: new connections are forwarded again."""

        def heal() -> None:
            self._cut = False

        self._call(heal)

    def close(self) -> None:
        self.cut()

        async def stop() -> None:
            if self._server is not None:
                self._server.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()
