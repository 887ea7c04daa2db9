"""The sync door's engine room: the async FlightCache on a private event-loop thread, the
worker threads that run plain loaders and generators, and what keeps them right across
``fork()`` and interpreter exit (docs/sync.md)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import inspect
import logging
import os
import threading
import time
import weakref
from collections.abc import (
    AsyncIterator,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
)
from typing import Any, ParamSpec, TypeVar, cast

from ._cache import FlightCache
from ._errors import ConfigError, FlightError, FlightTimeout
from ._protocol.jobs import Producer
from ._syncread import FastPath
from ._types import CacheState, Loader

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

log = logging.getLogger("flightcache.sync")

MARGIN_S = 15.0  # added to every engine bound: an embedded server's start, a slow thread hop
LONGEST_LEASE_S = 60.0  # set/invalidate may outwait another node's near-cache lease
LOOP_THREAD = "flightcache-sync-loop"
LOADER_THREADS = "flightcache-loader"
_END = object()


class _Engine:
    """One ``FlightCache`` on a private event loop in a daemon thread, in one process."""

    def __init__(self, make: Callable[[], FlightCache], workers: int, bound: float) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.pool = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix=LOADER_THREADS
        )
        self.loop.set_default_executor(self.pool)  # asyncio.to_thread and sync loaders
        self.thread = threading.Thread(target=self._serve, name=LOOP_THREAD, daemon=True)
        self.fast: FastPath | None = None  # the caller-thread reads, once the cache is open
        self._fast_known = False
        self._fast_lock = threading.Lock()
        self.thread.start()
        try:
            self.cache: FlightCache = self.call(make, bound)  # its asyncio parts on its loop
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(bound)
            self.pool.shutdown(wait=False)
            raise

    def fast_path(self) -> FastPath | None:
        """The caller-thread reads of this engine (``_syncread.py``): None until the cache
        is open (the first call opens it, on the loop), and for a backend other than one
        plain server."""
        if self._fast_known:
            return self.fast
        if self.cache._state is not CacheState.OPENED:
            return None
        with self._fast_lock:
            if not self._fast_known:
                self.fast = FastPath.of(self.cache, self.loop)
                self._fast_known = True
        return self.fast

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            try:
                tasks = asyncio.all_tasks(self.loop)
                for task in tasks:
                    task.cancel()
                if tasks:
                    gather = asyncio.gather(*tasks, return_exceptions=True)
                    self.loop.run_until_complete(gather)
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            finally:
                asyncio.set_event_loop(None)
                self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T], bound: float, key: str | None = None) -> T:
        """Run ``coro`` on the loop; wait for its outcome at most ``bound`` seconds."""
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:  # the loop was closed by another thread's close()
            coro.close()
            raise FlightError("this FlightCacheSync is closed") from None
        return self.wait(future, bound, key)

    def call(self, fn: Callable[[], T], bound: float) -> T:
        """Run the plain function ``fn`` on the loop's thread and return what it returns."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)

        try:
            self.loop.call_soon_threadsafe(run)
        except RuntimeError:
            raise FlightError("this FlightCacheSync is closed") from None
        return self.wait(future, bound)

    @staticmethod
    def wait(future: concurrent.futures.Future[T], bound: float, key: str | None = None) -> T:
        try:
            return future.result(bound)  # blocks on a lock: no GIL held while waiting
        except concurrent.futures.TimeoutError:
            if future.done():  # the call's own TimeoutError
                raise
            future.cancel()  # this caller leaves; a flight goes on for its other callers
            raise FlightTimeout(
                f"FlightCacheSync: no answer from the engine within {bound:g} s", key=key
            ) from None
        except BaseException:  # KeyboardInterrupt, say: stop waiting, leave the flight
            future.cancel()
            raise

    def close(self, bound: float) -> None:
        """Close the cache (owners give their flights back), stop the loop, end the threads."""
        if threading.current_thread() is self.thread:  # a finalizer run on the loop itself
            self.loop.create_task(self._close_and_stop())
            return
        deadline = time.monotonic() + bound
        try:
            self.run(self.cache.aclose(), bound)
        except Exception as exc:
            log.warning("closing the engine of a FlightCacheSync failed: %r", exc)
        with contextlib.suppress(RuntimeError):  # already closed
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.fast is not None:
            self.fast.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        # Idle workers end at once; one still running a loader that lost its flight is
        # waited for until the bound, then left to finish (a thread cannot be stopped).
        for worker in list(self.pool._threads):
            if worker is not threading.current_thread():
                worker.join(max(0.0, min(1.0, deadline - time.monotonic())))

    async def _close_and_stop(self) -> None:
        try:
            await self.cache.aclose()
        finally:
            self.loop.call_soon(self.loop.stop)


_CORES: weakref.WeakSet[_Core] = weakref.WeakSet()
# Engines a forked child inherited from its parent: kept, so that the child never uses,
# closes or garbage-collects the parent's loop, sockets and threads.
_INHERITED: list[_Engine] = []


def _after_fork_in_child() -> None:
    for core in list(_CORES):
        core.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

EXIT_BOUND_S = 5.0  # closing an unclosed client as the interpreter exits


def _close_all_at_exit() -> None:
    for core in list(_CORES):
        core.close(EXIT_BOUND_S)


# Clients still open when the interpreter exits are closed before its thread pools are shut
# down (an atexit or weakref.finalize hook runs after that, when the engine could no longer
# stop an embedded server through a worker thread). CPython's hook, as concurrent.futures's.
_register_before_threads_end = getattr(threading, "_register_atexit", None)
if _register_before_threads_end is not None:
    _ = concurrent.futures.ThreadPoolExecutor  # its own hook first, so that ours runs before
    _register_before_threads_end(_close_all_at_exit)


class _Core:
    """The engine of one ``FlightCacheSync`` in this process: made on first use, made
    again in a forked child, closed with the door (or when the door is collected)."""

    def __init__(self, make: Callable[[str | None], FlightCache], workers: int, bound: float):
        self.make = make
        self.workers = workers
        self.bound = bound
        self.lock = threading.Lock()
        self.engine: _Engine | None = None
        self.state = CacheState.UNOPENED
        self.server_url: str | None = None  # the parent's embedded server, in a child
        _CORES.add(self)

    def current(self) -> _Engine:
        engine = self.engine
        if engine is not None and engine.pid == os.getpid():
            return engine
        with self.lock:
            if self.state is CacheState.CLOSED:
                raise FlightError("this FlightCacheSync is closed")
            if self.engine is not None and self.engine.pid != os.getpid():
                self.after_fork()  # a fork that bypassed os.register_at_fork
            if self.engine is None:
                url = self.server_url
                self.engine = _Engine(lambda: self.make(url), self.workers, self.bound)
                self.state = CacheState.OPENED
            return self.engine

    def after_fork(self) -> None:
        self.lock = threading.Lock()  # another thread of the parent may have held it
        engine = self.engine
        if engine is not None:
            _INHERITED.append(engine)
            cache = getattr(engine, "cache", None)
            if self.server_url is None and cache is not None:
                self.server_url = cache.server_url
            self.engine = None

    def close(self, bound: float | None = None) -> None:
        with self.lock:
            engine, self.engine = self.engine, None
            self.state = CacheState.CLOSED
        if engine is not None and engine.pid == os.getpid():
            engine.close(self.bound if bound is None else bound)


def _loader_for(loader: Callable[[], Any], context: contextvars.Context) -> Loader:
    """The engine's loader: an async one as it is; a plain one in a worker thread."""
    if inspect.iscoroutinefunction(loader):
        return cast("Loader", loader)

    async def in_thread(*args: Any) -> Any:
        run = context.copy().run  # a copy per run: a refresh-ahead may run it again
        value = await asyncio.get_running_loop().run_in_executor(None, run, loader, *args)
        if inspect.isawaitable(value):  # a plain callable that returned a coroutine
            value = await value
        return value

    # The engine reads what the loader takes (its signature) through the wrapper, and
    # hands on whatever it passes.
    in_thread.__wrapped__ = loader  # type: ignore[attr-defined]
    return in_thread


def _start(producer: Callable[[], Iterable[Any]]) -> Iterator[Any]:
    return iter(producer())


def _step(iterator: Iterator[Any]) -> Any:
    return next(iterator, _END)


def _producer_for(
    producer: Callable[[], Any],
    context: contextvars.Context,
    pool: concurrent.futures.ThreadPoolExecutor,
) -> Producer:
    """The engine's producer: an async generator function as it is; a plain generator
    stepped in the engine's worker threads, one ``next`` at a time, and closed when its
    flight ends (after a step still running, never beside it)."""
    if inspect.isasyncgenfunction(producer):
        return cast("Producer", producer)

    async def chunks() -> AsyncIterator[Any]:
        run = context.copy().run
        step: concurrent.futures.Future[Any] = pool.submit(run, _start, producer)
        iterator: Iterator[Any] | None = None
        try:
            iterator = it = cast("Iterator[Any]", await asyncio.wrap_future(step))
            while True:
                step = pool.submit(run, _step, it)
                chunk = await asyncio.wrap_future(step)
                if chunk is _END:
                    return
                yield chunk
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:

                def close_it(_: object = None) -> None:
                    with contextlib.suppress(RuntimeError):  # the pool was shut down
                        pool.submit(run, close)

                step.add_done_callback(close_it)  # at once if no step is running

    return chunks


def _listed(tags: Any) -> Any:
    """Tags read in the caller's thread (an iterator); anything else is passed on for the
    engine to check (a bare string is refused there, not split into characters)."""
    if tags is None or isinstance(tags, (str, bytes, list, tuple, set, frozenset)):
        return tags
    return list(tags)


def _not_in_a_loop() -> None:
    if asyncio._get_running_loop() is not None:
        raise ConfigError(
            "FlightCacheSync blocks its caller, and this thread runs an event loop: use "
            "FlightCache here (await fc.do(...)), or run the call in a thread "
            "(await asyncio.to_thread(fcs.do, ...))"
        )
