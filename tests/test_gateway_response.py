"""The gateway's streamed response body (``gateway/_response.py``) under a real uvicorn server:
a client that hangs up stops the body at once and its request ends as a normal one; a body
that ends leaves no task behind; a server shutting down still cancels an open body."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from flightcache.gateway import _response
from flightcache.gateway._response import StreamedBody
from flightcache.gateway._serve_util import ServerThread


class Recorder:
    """What the server's bodies and requests did, read from the test's thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bodies: list[str] = []  # how each body ended: "done", "cancelled", "closed"
        self.requests: list[str] = []  # how each request's app call ended
        self.background: list[str] = []  # each response's background task, once it ran

    def add(self, where: list[str], what: str) -> None:
        with self.lock:
            where.append(what)

    def wait(self, where: list[str], count: int, timeout: float = 5.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if len(where) >= count:
                    return list(where)
            assert time.monotonic() < deadline, f"only {where} after {timeout} s"
            time.sleep(0.01)


def make_app(rec: Recorder) -> Any:
    async def events(forever: bool) -> AsyncIterator[bytes]:
        try:
            yield b"data: one\n\n"
            if forever:
                await asyncio.Event().wait()
            yield b"data: two\n\n"
            rec.add(rec.bodies, "done")
        except asyncio.CancelledError:
            rec.add(rec.bodies, "cancelled")
            raise
        except GeneratorExit:
            rec.add(rec.bodies, "closed")
            raise

    async def stream(request: Request) -> Response:
        forever = request.query_params.get("forever") == "1"
        after = BackgroundTask(rec.add, rec.background, "ran")
        return StreamedBody(events(forever), media_type="text/event-stream", background=after)

    async def tasks(request: Request) -> Response:
        return JSONResponse(len(asyncio.all_tasks()))

    inner = Starlette(routes=[Route("/stream", stream), Route("/tasks", tasks)])

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await inner(scope, receive, send)
        except asyncio.CancelledError:
            rec.add(rec.requests, "cancelled")
            raise
        except BaseException as exc:
            rec.add(rec.requests, type(exc).__name__)
            raise
        if scope["type"] == "http" and scope["path"] == "/stream":
            rec.add(rec.requests, "returned")

    return app


@pytest.fixture(params=["own-task", "starlette"])
def served(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A server of ``make_app``; "starlette": the way kept for Python 3.10."""
    if request.param == "starlette":
        monkeypatch.setattr(_response, "_UNCANCEL", False)
    rec = Recorder()
    server = ServerThread(make_app(rec), graceful_timeout=0.3)
    server.start()
    try:
        yield server, rec
    finally:
        server.stop()


async def test_a_client_that_hangs_up_stops_the_body_at_once_and_its_request_ends_normally(
    served: Any,
) -> None:
    server, rec = served
    async with httpx.AsyncClient(timeout=10) as client:
        async with client.stream("GET", f"{server.url}/stream?forever=1") as response:
            async for line in response.aiter_lines():
                if line == "data: one":
                    break  # leaving the block closes the connection mid-answer
    assert rec.wait(rec.bodies, 1, timeout=2.0) == ["cancelled"]
    assert rec.wait(rec.requests, 1, timeout=2.0) == ["returned"]
    assert rec.wait(rec.background, 1, timeout=2.0) == ["ran"]  # as after a whole answer


async def test_a_body_that_ends_is_whole_and_its_request_ends_normally(served: Any) -> None:
    server, rec = served
    async with httpx.AsyncClient(timeout=10) as client:
        for _ in range(20):
            answer = await client.get(f"{server.url}/stream")
            assert answer.text == "data: one\n\ndata: two\n\n"
    assert rec.wait(rec.bodies, 20) == ["done"] * 20
    assert rec.wait(rec.requests, 20) == ["returned"] * 20
    assert rec.wait(rec.background, 20) == ["ran"] * 20


async def test_a_body_that_ends_leaves_no_task_behind_whatever_the_server_receive_does() -> None:
    """Called as an ASGI app whose ``receive`` never answers (a server that keeps it open
    after the response): nothing of the response is left waiting once it has returned."""
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        await asyncio.Event().wait()

    async def body() -> AsyncIterator[bytes]:
        yield b"data: one\n\n"

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "GET"}
    before = len(asyncio.all_tasks())
    for _ in range(10):
        await StreamedBody(body(), media_type="text/event-stream")(scope, receive, send)
    for _ in range(3):
        await asyncio.sleep(0)  # a cancelled task is gone after its next turn
    assert len(asyncio.all_tasks()) == before
    assert [m.get("body") for m in sent if m["type"] == "http.response.body"] == [
        b"data: one\n\n",
        b"",
    ] * 10


def test_a_server_shutting_down_cancels_an_open_body_and_its_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server's own cancellation is not taken for the client's leaving: it goes on out
    of the app (the request does not return as if it had ended)."""
    rec = Recorder()
    server = ServerThread(make_app(rec), graceful_timeout=0.3)
    server.start()
    got_first = threading.Event()

    def read() -> None:
        with httpx.Client(timeout=10) as client:
            try:
                with client.stream("GET", f"{server.url}/stream?forever=1") as response:
                    for line in response.iter_lines():
                        if line == "data: one":
                            got_first.set()
            except httpx.HTTPError:
                pass  # the server closes the connection

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert got_first.wait(5)
    finally:
        server.stop()
    reader.join(5)
    assert rec.wait(rec.bodies, 1) == ["cancelled"]
    assert rec.wait(rec.requests, 1) == ["cancelled"]
