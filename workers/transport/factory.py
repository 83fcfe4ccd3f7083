"""Builds a KV transport by backend name; the base module never imports its implementations."""

from __future__ import annotations

from workers.transport.base import KVTransport

TRANSPORTS = ("tcp", "nixl", "nccl")


def make_transport(backend: str, host: str = "127.0.0.1", device: str = "cpu") -> KVTransport:
    """A transport by name; ``host`` is where a tcp transport listens, ``device`` where the cache lives."""
    if backend == "tcp":
        from workers.transport.tcp import TcpTransport

        return TcpTransport(host=host)
    if backend == "nixl":
        from workers.transport.nixl import NixlTransport

        return NixlTransport(device=device)
    if backend == "nccl":
        from workers.transport.nccl import NcclTransport

        return NcclTransport(host=host)
    raise ValueError(f"unknown KV transport {backend!r}; choose one of {', '.join(TRANSPORTS)}")
