"""Gateway processes (``flightcache serve``) for the gateway tests, and a small SSE client.

Every wait is bounded; a gateway's stderr goes to a file (a pipe nobody reads could fill
and block it), its stdout is read for the banner only.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

KEY = "sk-gateway-test-key-0123456789abcdef"
BANNER = re.compile(r"listening on (http://\S+) ")


@dataclass
class Gateway:
    """One ``flightcache serve`` process."""

    proc: subprocess.Popen[str]
    stderr_path: Path
    url: str = ""
    banner: str = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM, then the exit status (killed, and an AssertionError, if it overruns)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"gateway did not stop within {timeout} s") from None

    def close(self) -> None:
        """Make sure the process is gone and its pipe closed (for finally blocks). SIGTERM
        first: a SIGKILLed gateway would leave its embedded server running."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def spawn(upstream: str, *args: str, redis: str | None, directory: Path) -> Gateway:
    """Start ``flightcache serve --port 0`` (without waiting for it: see :func:`ready`)."""
    command = [sys.executable, "-m", "flightcache", "serve", "--upstream", upstream]
    command += ["--port", "0", *args]
    if redis is not None:
        command += ["--redis", redis]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("FLIGHTCACHE_REDIS_URL", None)
    env.pop("FLIGHTCACHE_UPSTREAM", None)
    stderr_path = directory / f"gateway-{time.monotonic_ns()}.err"
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    return Gateway(proc, stderr_path)


def ready(gateway: Gateway, timeout: float = 30.0) -> Gateway:
    """Wait for the banner (the address) and for ``/healthz`` to answer at all."""
    deadline = time.monotonic() + timeout
    assert gateway.proc.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(gateway.proc.stdout, selectors.EVENT_READ)
        while not gateway.banner:
            left = deadline - time.monotonic()
            if left <= 0 or gateway.proc.poll() is not None:
                gateway.close()
                raise AssertionError(f"gateway printed no banner; stderr:\n{gateway.stderr()}")
            if selector.select(min(left, 0.5)):
                gateway.banner = gateway.proc.stdout.readline()
    match = BANNER.search(gateway.banner)
    assert match, gateway.banner
    gateway.url = match[1]
    while True:
        try:
            httpx.get(f"{gateway.url}/healthz", timeout=max(deadline - time.monotonic(), 0.1))
            return gateway
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def start(upstream: str, *args: str, redis: str | None, directory: Path) -> Gateway:
    gateway = spawn(upstream, *args, redis=redis, directory=directory)
    try:
        return ready(gateway)
    except BaseException:
        gateway.close()
        raise


def start_many(configs: Iterable[tuple[str, ...]], **kw: Any) -> list[Gateway]:
    """Start several gateways at once (they import in parallel), then wait for each."""
    upstream = kw.pop("upstream")
    gateways = [spawn(upstream, *args, **kw) for args in configs]
    try:
        return [ready(g) for g in gateways]
    except BaseException:
        for g in gateways:
            g.close()
        raise


# -- a client -------------------------------------------------------------------------------


@dataclass
class Answer:
    """One answer of the gateway: status, headers, and the SSE events or the JSON body."""

    status: int
    headers: httpx.Headers
    events: list[Any] = field(default_factory=list)  # parsed objects, then "[DONE]"
    body: Any = None
    broken: str | None = None  # the connection broke off (a transport error's name)

    @property
    def cache(self) -> str | None:
        return self.headers.get("x-cache")

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def error(self) -> dict[str, Any] | None:
        for event in self.events:
            if isinstance(event, dict) and "error" in event:
                return dict(event["error"])
        if isinstance(self.body, dict) and "error" in self.body:
            return dict(self.body["error"])
        return None

    @property
    def text(self) -> str:
        """Choice 0's text, from the events or the body."""
        if self.body is not None:
            choice = self.body["choices"][0]
            return str(choice["message"]["content"] if "message" in choice else choice["text"])
        parts = []
        for event in self.events:
            if not isinstance(event, dict):
                continue
            for choice in event.get("choices") or []:
                if choice.get("index", 0) == 0:
                    delta = choice.get("delta") or {}
                    parts.append(delta.get("content") or choice.get("text") or "")
        return "".join(parts)


async def ask(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    path: str = "/v1/chat/completions",
    key: str = KEY,
    headers: dict[str, str] | None = None,
    on_event: Callable[[int], None] | None = None,
) -> Answer:
    """POST ``body``; SSE answers are read event by event (``on_event(count)`` after each)."""
    sent = {"authorization": f"Bearer {key}", **(headers or {})}
    async with client.stream("POST", url + path, json=body, headers=sent) as response:
        answer = Answer(response.status_code, response.headers)
        try:
            if "text/event-stream" in response.headers.get("content-type", ""):
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    answer.events.append("[DONE]" if data == "[DONE]" else orjson.loads(data))
                    if on_event is not None:
                        on_event(len(answer.events))
            else:
                answer.body = orjson.loads(await response.aread())
        except httpx.TransportError as exc:
            answer.broken = type(exc).__name__
    return answer


def stats(upstream: str) -> dict[str, Any]:
    result: dict[str, Any] = httpx.get(f"{upstream}/stats", timeout=10).json()
    return result


def control(upstream: str, **settings: Any) -> None:
    httpx.post(f"{upstream}/control", json=settings, timeout=10).raise_for_status()


def reset(upstream: str) -> None:
    httpx.post(f"{upstream}/control/reset", timeout=10).raise_for_status()


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


async def astats(client: httpx.AsyncClient, upstream: str) -> dict[str, Any]:
    result: dict[str, Any] = (await client.get(f"{upstream}/stats")).json()
    return result
