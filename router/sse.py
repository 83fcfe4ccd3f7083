"""Server-sent events that stop the moment the client goes away.

Starlette's ``StreamingResponse`` under an ASGI 2.4 server (uvicorn) notices a disconnect only when
a later write fails, and never closes the body iterator, so a request waiting in a queue or between
tokens would keep running on the workers. Here a watcher cancels the stream on ``http.disconnect``
and the iterator is always closed, which runs its cleanup (cancelling the request on every worker).

The work runs in the request's own task and the watcher is one plain asyncio task: an anyio task
group per request cost ~0.1 ms of the router's latency budget (it names and formats its tasks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

T = TypeVar("T")


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> tuple[T | None, bool]:
    """Await ``work`` in this task unless the client disconnects first.

    Returns ``(result, False)``, or ``(None, True)`` when the client went away (``work`` was cancelled).
    """
    task = asyncio.current_task()
    assert task is not None
    disconnected = False

    async def watch() -> None:
        nonlocal disconnected
        while (await receive())["type"] != "http.disconnect":
            pass
        disconnected = True
        task.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await work, False
    except asyncio.CancelledError:
        if not disconnected:
            raise  # cancelled from outside (server shutdown): not ours to swallow
        task.uncancel()
        return None, True
    finally:
        watcher.cancel()


class EventStreamResponse(StreamingResponse):
    """``stall_timeout_s``: a write that waits this long (the client reads nothing and the send buffers are
    full) ends the stream, which cancels the request everywhere; ``on_stall`` is told. A stalled client
    never holds up other streams (each writes from its own task) but would hold its KV blocks and the
    chunks queued behind it until it read again."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, headers: Mapping[str, str] | None = None, stall_timeout_s: float | None = None,
                 on_stall: Callable[[], None] | None = None):
        super().__init__(content, headers=headers)
        self.stall_timeout_s = stall_timeout_s
        self.on_stall = on_stall

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await until_disconnect(receive, self._stream(send))
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _stream(self, send: Send) -> None:
        try:
            await self.stream_response(send if self.stall_timeout_s is None else self._bounded(send))
        except _Stalled:
            if self.on_stall is not None:
                self.on_stall()
        except OSError:
            pass  # the client went away mid-write

    def _bounded(self, send: Send) -> Send:
        timeout_s = self.stall_timeout_s

        async def bounded_send(message: Message) -> None:
            try:
                async with asyncio.timeout(timeout_s):
                    await send(message)
            except TimeoutError as e:
                raise _Stalled from e

        return bounded_send


class _Stalled(Exception):
    """A write to the client waited past the stall timeout."""
