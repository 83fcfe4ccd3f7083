"""A hook for the moment a forward starts its layers: the long part that runs without the GIL.

A decode worker's engine thread hands each step's tokens to the worker's event loop thread. Handed at the step's
end, that thread woke while the engine thread ran the next step's host code, and took the GIL at the first op
that let it go (every torch call does, briefly): the engine thread then waited there for the event loop's work
(the requests' streams, the output frame) and for the wake-ups between them. Served at 8 chats on 2 cores that
wait was 0.39 ms a step on average at the first ``torch.tensor`` of the step's inputs and 0.27 ms at the next
four (medians 0.24 and 0.07; ~3 us each in a quiet process): ~12% of a 5.5 ms step. Handed over as the layers
start, the event loop's work runs while they run.

The hook is the calling thread's (engines may share a model, each stepping on a thread of its own):

    set_compute_starts(hand_over)   # on the engine thread, once
    compute_starts()                # in a forward, right before its layers: runs this thread's hook, if any
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_local = threading.local()


def set_compute_starts(hook: Callable[[], None] | None) -> None:
    """This thread's hook (None: none)."""
    _local.hook = hook


def compute_starts() -> None:
    """A forward on this thread is about to run its layers."""
    hook = getattr(_local, "hook", None)
    if hook is not None:
        hook()
