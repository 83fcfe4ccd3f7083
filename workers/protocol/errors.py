"""Typed errors of the engine. Routers map ``InvalidRequestError`` to HTTP 400."""

from __future__ import annotations


class TandemError(Exception):
    """Base of every error Tandem raises on purpose."""


class InvalidRequestError(TandemError, ValueError):
    """The request itself is wrong (bad parameter, prompt too long); the caller must change it."""


class ModelLoadError(TandemError):
    """The model path is missing, unreadable, or not a supported architecture."""


class CapacityError(InvalidRequestError):
    """The request is valid but can never fit this engine's KV pool."""


class TransferError(TandemError):
    """A KV transfer failed or timed out; the destination blocks hold no valid KV."""


class OverloadedError(TandemError):
    """The worker sheds the request (HTTP 429 with Retry-After); ``reason`` says why."""

    reason = "overloaded"  # a class attribute: it survives Ray's wrapping of a remote exception


class QueueFullError(OverloadedError):
    """The worker's queue already holds ``max_queue_len`` requests."""

    reason = "queue_full"


class QueueTimeoutError(OverloadedError):
    """The request waited ``max_queue_time_s`` without being admitted."""

    reason = "queue_timeout"


class WorkerStopped(TandemError):
    """The worker stopped (drain timeout, shutdown) while it held the request."""


# The error kinds of a shed request, as ``error_kind`` names them (routers answer 429 to each).
OVERLOADED_KINDS = tuple(f"overloaded_{cls.reason}" for cls in (QueueFullError, QueueTimeoutError))


def error_kind(error: BaseException) -> str:
    """The kind a worker reports for a failed request (routers map it to an HTTP status)."""
    if isinstance(error, CapacityError):
        return "capacity"
    if isinstance(error, InvalidRequestError):
        return "invalid_request"
    if isinstance(error, TransferError):
        return "transfer"
    if isinstance(error, OverloadedError):
        return f"overloaded_{error.reason}"  # the router answers 429 and counts the reason
    if isinstance(error, WorkerStopped):
        return "unavailable"
    return "internal"
