"""Server-sent events that stop the moment the client goes away.

Starlette's ``StreamingResponse`` under an ASGI 2.4 server (uvicorn) notices a disconnect only when
a later write fails, and never closes the body iterator, so a request waiting in a queue or between
tokens would keep running on the workers. Here a watcher cancels the stream on ``http.disconnect``
and the iterator is always closed, which runs its cleanup (cancelling the request on every worker).
"""

from __future__ import annotations

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client went away mid-write
                group.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
