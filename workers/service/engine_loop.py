"""One engine stepping on its own thread; other threads (the asyncio loop of a worker) talk to it
through ``call``, which runs a function on the engine thread between two steps.

The engine is plain single-threaded Python; this is the only place where a worker's threads meet
it, so no lock is needed anywhere else. When there is nothing to step, the thread sleeps on its
command queue instead of spinning.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from workers.engine.engine import Engine, StepResult
from workers.model.compute_starts import set_compute_starts

T = TypeVar("T")
log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


class EngineLoop:
    def __init__(self, engine: Engine, on_step: Callable[[Engine, StepResult, float], None],
                 on_fatal: Callable[[BaseException], None], name: str = "engine", num_threads: int | None = None,
                 compute_starts: Callable[[], None] | None = None):
        """``on_step(engine, result, seconds)`` runs on the engine thread after every step;
        ``on_fatal(error)`` once if a step raises (the loop then stops). ``num_threads``: the engine thread's
        torch threads (default: the constructing thread's). ``compute_starts``: run on the engine thread as
        each forward starts its layers (workers/model/compute_starts.py). Nothing runs before ``start()``."""
        self.engine = engine
        self._on_step = on_step
        self._on_fatal = on_fatal
        self._commands: queue.SimpleQueue[tuple[Callable[[Engine], Any], concurrent.futures.Future[Any]] | None] = (
            queue.SimpleQueue())
        self._stopping = False
        # OpenMP thread counts are per calling thread: a new thread starts from OMP_NUM_THREADS, not from
        # torch.set_num_threads of the thread that built us. A worker process keeps every other thread at one
        # (workers/actors.py): see there why one OpenMP team a process matters.
        self._num_threads = num_threads or torch.get_num_threads()
        self._compute_starts = compute_starts
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def num_threads(self) -> int:
        """The engine thread's torch threads."""
        return self._num_threads

    def call(self, fn: Callable[[Engine], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(engine)`` on the engine thread; its result or exception lands in the future."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._stopping:
            future.set_exception(RuntimeError("the engine loop has stopped"))
            return future
        self._commands.put((fn, future))
        return future

    async def run(self, fn: Callable[[Engine], T]) -> T:
        """``call`` for coroutines."""
        return await asyncio.wrap_future(self.call(fn))

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        torch.set_num_threads(self._num_threads)
        set_compute_starts(self._compute_starts)
        engine = self.engine
        idle = True
        while not self._stopping:
            if not self._drain(block=idle or not engine.has_unfinished):
                return
            if not engine.has_unfinished:
                idle = True
                continue
            try:
                t0 = time.perf_counter()
                result = engine.step()
                idle = result.num_tokens == 0
                self._on_step(engine, result, time.perf_counter() - t0)
            except BaseException as e:  # noqa: BLE001 - a broken engine must fail its requests, not hang them
                log.exception("engine step failed; the worker stops serving")
                self._stopping = True
                self._on_fatal(e)
                self._fail_queued(e)
                return

    def _fail_queued(self, error: BaseException) -> None:
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(error)

    def _drain(self, block: bool) -> bool:
        """Run queued commands (waiting a little for one if ``block``); False once told to stop."""
        try:
            item = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is None:
                return False
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return True
