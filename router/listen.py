"""The router's listening socket, with a bounded kernel send buffer for every connection.

Linux grows a socket's send buffer up to ``net.ipv4.tcp_wmem``'s maximum (4 MiB here): a streaming client
that stops reading would have megabytes of tokens queued before the router noticed. Setting SO_SNDBUF on
the listening socket (accepted sockets inherit it) turns that growth off, so a stalled client's writes
block after ~64 KiB (plus uvicorn's own 64 KiB write buffer) and ``client_stall_timeout_s`` can cut it
off. A token stream needs far less: at 100 ms of round trip 64 KiB still carries 640 KB/s.
"""

from __future__ import annotations

import socket

SEND_BUFFER_BYTES = 64 << 10


def listening_socket(host: str, port: int) -> socket.socket:
    """Bound (not yet listening: uvicorn calls listen); port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    sock.bind((host, port))
    return sock
