"""Length-prefixed frames on an asyncio stream: a 4-byte little-endian length, then that many bytes.

What a decode worker's output stream to a router is made of (workers/service/output_server.py): one frame a
decode step (that router's chunks, ``pack_list``).
"""

from __future__ import annotations

import asyncio
import struct

_LEN = struct.Struct("<I")
# A frame is a step's chunks; the largest are first chunks with prompt logprobs (a 32K-token prompt with 20
# alternatives a token: ~8 MB). Past this the stream is corrupt or not ours: refused, not allocated.
MAX_FRAME_BYTES = 256 * 1024 * 1024


class FrameError(Exception):
    """The stream does not hold a frame here (a length past ``MAX_FRAME_BYTES``)."""


def write_frame(writer: asyncio.StreamWriter, payload: bytes) -> None:
    """Queue one frame (the caller drains the writer as its flow control needs)."""
    writer.write(_LEN.pack(len(payload)) + payload)


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> bytes | None:
    """The next frame's bytes; None where the stream ends cleanly before one (the peer closed it). A stream cut
    inside a frame raises ``asyncio.IncompleteReadError``."""
    try:
        header = await reader.readexactly(_LEN.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise
    (length,) = _LEN.unpack(header)
    if length > max_bytes:
        raise FrameError(f"a frame of {length} bytes (at most {max_bytes})")
    return await reader.readexactly(length)
