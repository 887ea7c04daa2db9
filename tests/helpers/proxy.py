"""A TCP proxy on loopback whose connections a test can cut, to take a node off the server."""

from __future__ import annotations

import asyncio
import contextlib
import threading


class CuttableProxy:
    """Forwards 127.0.0.1:<port> to a target; ``cut()`` drops every connection and refuses
    new ones, like a network partition between its clients and the server."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._cut = False
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

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        async def cut() -> None:
            self._cut = True
            for w in list(self._writers):
                w.transport.abort()

        asyncio.run_coroutine_threadsafe(cut(), self._loop).result(5)

    def close(self) -> None:
        self.cut()

        async def stop() -> None:
            if self._server is not None:
                self._server.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()
