"""Stopping the router's background tasks so that they stop even when a cancel is lost.

On Python 3.11, ``asyncio.wait_for`` returns its result instead of raising when the task awaiting it is cancelled in
the same loop turn as the awaited work finishes (python/cpython#86296; 3.12 rewrote ``wait_for``). redis-py 8 sends
every command under ``wait_for`` (its default 5 s socket timeout), so a task cancelled while it talks to Redis runs on
about half the time: the worker directory polls 20 times a second, and a shutdown that awaited it once cancelled hung
until the watchdog killed the process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

RECANCEL_S = 0.05  # a lost cancel costs this long before the next


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel the tasks and return once every one has ended, cancelling again any still running RECANCEL_S later
    (so: for loops with no cleanup of their own to await). Their exceptions are retrieved (none is raised here); a
    cancel of the caller itself still propagates."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        # asyncio.wait neither raises a task's CancelledError nor absorbs the caller's.
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" at exit
