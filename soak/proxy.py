"""TCP links between each worker and the server, which the nemesis can cut or slow down.

One thread runs one event loop for every link. A link listens on its own loopback port and
forwards each connection to the server. ``cut(name)`` drops every connection of that link and
refuses new ones until ``heal(name)`` (a partition between one worker and the server);
``slow(name, seconds)`` delays everything the server sends back on that link by that much,
in order (a slow network; requests still reach the server at once). Both act on the proxy's
own sockets, never on the server. (A copy of the idea in ``tests/helpers/proxy.py``, which
the soak does not import.)
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, cast

CHUNK = 65536


@dataclass
class _Link:
    name: str
    port: int = 0
    server: asyncio.base_events.Server | None = None
    cut: bool = False
    latency: float = 0.0
    transports: set[asyncio.Transport] = field(default_factory=set)


class Links:
    """Per-worker links to one server (``target``), each cuttable and slowable."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._links: dict[str, _Link] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    # -- control, from any thread ---------------------------------------------------------

    def add(self, name: str) -> int:
        """A new link; returns the loopback port a worker connects to."""
        return int(self._call(self._add(name)))

    def cut(self, name: str) -> None:
        self._call(self._cut(name))

    def heal(self, name: str) -> None:
        self._call(self._set(name, cut=False))

    def slow(self, name: str, seconds: float) -> None:
        self._call(self._set(name, latency=seconds))

    def close(self) -> None:
        async def stop() -> None:
            for link in self._links.values():
                link.cut = True
                for t in list(link.transports):
                    t.abort()
                if link.server is not None:
                    link.server.close()
            # the connections' tasks end once their sockets are gone
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if tasks:
                await asyncio.wait(tasks, timeout=1.0)

        with contextlib.suppress(Exception):
            self._call(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(5)

    # -- inside the loop ------------------------------------------------------------------

    async def _add(self, name: str) -> int:
        link = _Link(name)
        link.server = await asyncio.start_server(
            lambda r, w: self._handle(link, r, w), "127.0.0.1", 0
        )
        link.port = link.server.sockets[0].getsockname()[1]
        self._links[name] = link
        return link.port

    async def _cut(self, name: str) -> None:
        link = self._links[name]
        link.cut = True
        for t in list(link.transports):
            t.abort()
        link.transports.clear()

    async def _set(self, name: str, **values: Any) -> None:
        link = self._links[name]
        for attr, value in values.items():
            setattr(link, attr, value)

    async def _handle(
        self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if link.cut:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:  # the server is down: the client sees its connection closed
            writer.transport.abort()
            return
        if link.cut:  # cut while connecting
            writer.transport.abort()
            up_writer.transport.abort()
            return
        pair = cast(
            "tuple[asyncio.Transport, asyncio.Transport]", (writer.transport, up_writer.transport)
        )
        link.transports.update(pair)

        async def upstream() -> None:
            with contextlib.suppress(Exception):
                while data := await reader.read(CHUNK):
                    up_writer.write(data)
                    await up_writer.drain()
            up_writer.close()

        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def from_server() -> None:
            with contextlib.suppress(Exception):
                while data := await up_reader.read(CHUNK):
                    queue.put_nowait((loop.time() + link.latency, data))
            queue.put_nowait((0.0, b""))

        async def to_client() -> None:
            with contextlib.suppress(Exception):
                while True:
                    due, data = await queue.get()
                    if not data:
                        break
                    wait = due - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)  # the link's latency, in order
                    writer.write(data)
                    await writer.drain()
            writer.close()

        await asyncio.gather(upstream(), from_server(), to_client())
        link.transports.difference_update(pair)
