"""The tcp KV transport: exact block copies, coalesced runs, clear errors, no hangs."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from workers.kv_transport import BlockRun, TransferError, coalesce_runs
from workers.tcp_transport import TcpTransport

SHAPE = (3, 2, 40, 4, 2, 8)  # layers, K/V, blocks, block_size, kv_heads, head_dim


@pytest.fixture
def pair():
    a, b = TcpTransport(), TcpTransport()
    a.register(torch.randn(SHAPE))
    b.register(torch.zeros(SHAPE))
    yield a, b
    a.close()
    b.close()


def test_coalesce_runs():
    assert coalesce_runs([4, 5, 6, 9, 10, 2], [20, 21, 22, 7, 8, 30]) == [
        BlockRun(4, 20, 3), BlockRun(9, 7, 2), BlockRun(2, 30, 1)]
    assert coalesce_runs([1, 2], [5, 9]) == [BlockRun(1, 5, 1), BlockRun(2, 9, 1)]
    with pytest.raises(ValueError):
        coalesce_runs([1], [1, 2])


def test_blocks_arrive_exactly_and_nothing_else_changes(pair):
    a, b = pair
    src, dst = [3, 4, 5, 17, 30, 31], [10, 11, 12, 0, 38, 39]
    result = a.write_blocks(b.address(), src, dst, "req-1", timeout_s=10)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(b.kv_cache[:, :, d], a.kv_cache[:, :, s])
    untouched = [i for i in range(SHAPE[2]) if i not in dst]
    assert b.kv_cache[:, :, untouched].abs().sum() == 0
    per_block = SHAPE[0] * 2 * SHAPE[3] * SHAPE[4] * SHAPE[5] * 4
    assert result.num_bytes == len(src) * per_block == b.num_bytes_received


def test_concurrent_transfers(pair):
    a, b = pair
    errors = []

    def send(i):
        try:
            a.write_blocks(b.address(), [i], [i + 20], f"r{i}", timeout_s=10)
        except TransferError as e:
            errors.append(e)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert torch.equal(b.kv_cache[:, :, 20:36], a.kv_cache[:, :, 0:16])


def test_dead_peer_fails_fast(pair):
    a, b = pair
    address = b.address()
    b.close()
    t0 = time.perf_counter()
    with pytest.raises(TransferError, match="failed"):
        a.write_blocks(address, [1], [1], "r", timeout_s=5)
    assert time.perf_counter() - t0 < 2


def test_unresponsive_peer_times_out(pair):
    a, _ = pair
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never reads or answers
    try:
        t0 = time.perf_counter()
        with pytest.raises(TransferError, match="timed out"):
            a.write_blocks({"host": "127.0.0.1", "port": silent.getsockname()[1]}, list(range(30)),
                           list(range(30)), "r", timeout_s=1.0)
        assert time.perf_counter() - t0 < 3
    finally:
        silent.close()
    # the sender keeps serving others
    other = TcpTransport()
    other.register(torch.zeros(SHAPE))
    a.write_blocks(other.address(), [0], [0], "r2", timeout_s=5)
    assert torch.equal(other.kv_cache[:, :, 0], a.kv_cache[:, :, 0])
    other.close()


def test_layout_mismatch_and_bad_range_are_refused(pair):
    a, b = pair
    wrong = TcpTransport()
    wrong.register(torch.zeros(4, 2, 40, 4, 2, 8))  # one more layer
    with pytest.raises(TransferError, match="layout mismatch"):
        a.write_blocks(wrong.address(), [1], [1], "r", timeout_s=5)
    wrong.close()
    with pytest.raises(TransferError, match="outside"):
        a.write_blocks(b.address(), [1], [40], "r", timeout_s=5)
