"""KV transports (tcp with its same-host copy, tcp on sockets only, nccl over gloo, nixl): exact block copies, coalesced
runs, clear errors, no hangs."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import pytest
import torch

from kernels import kv_quant
from workers.protocol.errors import TransferError
from workers.transport import tcp as tcp_transport
from workers.transport.base import BlockRun, KVTransport, coalesce_runs
from workers.transport.factory import make_transport
from workers.transport.nixl import nixl_available
from workers.transport.tcp import TcpTransport

SHAPE = (3, 2, 40, 4, 2, 8)  # layers, K/V, blocks, block_size, kv_heads, head_dim
BACKENDS = ["tcp", "tcp-sockets", "nccl",  # nccl: gloo between CPU caches, the same code path
            pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl-cu12 missing"))]


def make(backend: str) -> KVTransport:
    """``tcp-sockets``: the tcp transport with its same-host copy turned off (the path between hosts)."""
    return TcpTransport(same_host_copy=False) if backend == "tcp-sockets" else make_transport(backend)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def pair(backend):
    a, b = make(backend), make(backend)
    a.register(torch.randn(SHAPE))
    b.register(torch.zeros(SHAPE))
    yield a, b
    a.close()
    b.close()


def _remote_receiver(backend: str, conn, shape: tuple[int, ...] = SHAPE) -> None:  # type: ignore[no-untyped-def]
    """Serves its cache's blocks on request (a list of block ids) until told "stop"."""
    transport = make(backend)
    cache = torch.zeros(shape)
    transport.register(cache)
    conn.send(transport.address())
    while (blocks := conn.recv()) != "stop":
        conn.send(cache[:, :, blocks].clone())


@pytest.fixture
def remote_peer(backend, request):
    """A receiver in another process: (address, process, pipe); its cache shape is SHAPE unless the
    test says otherwise (``@pytest.mark.parametrize("remote_shape", ...)``)."""
    callspec = getattr(request.node, "callspec", None)
    shape = callspec.params.get("remote_shape", SHAPE) if callspec else SHAPE
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_remote_receiver, args=(backend, child, shape), daemon=True)
    proc.start()
    address = parent.recv()
    yield address, proc, parent
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.join(timeout=10)


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
    assert result.num_bytes == len(src) * per_block


def test_int8_cache_blocks_arrive_exactly_and_an_fp16_cache_refuses_them(backend):
    """An int8 cache's rows carry their scales (kernels/kv_quant.py), so its blocks move as any other bytes; a
    cache of another element type has other block bytes and says so instead of taking them."""
    a, b, fp16 = make(backend), make(backend), make(backend)
    try:
        a.register(kv_quant.quantize_rows(torch.randn(3, 2, 40, 4, 2, 8)))
        b.register(torch.zeros(3, 2, 40, 4, 2, 8 + kv_quant.SCALE_BYTES, dtype=torch.int8))
        fp16.register(torch.zeros(3, 2, 40, 4, 2, 8, dtype=torch.float16))
        a.write_blocks(b.address(), [3, 4, 17], [10, 11, 0], "req-int8", timeout_s=10)
        assert torch.equal(b.kv_cache[:, :, [10, 11, 0]], a.kv_cache[:, :, [3, 4, 17]])
        with pytest.raises(TransferError, match="layout mismatch"):
            a.write_blocks(fp16.address(), [3], [10], "req-fp16", timeout_s=10)
    finally:
        for t in (a, b, fp16):
            t.close()


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


def test_layout_mismatch_and_bad_range_are_refused(pair, backend):
    a, b = pair
    wrong = make(backend)
    wrong.register(torch.zeros(4, 2, 40, 4, 2, 8))  # one more layer
    with pytest.raises(TransferError, match="layout mismatch"):
        a.write_blocks(wrong.address(), [1], [1], "r", timeout_s=5)
    wrong.close()
    with pytest.raises(TransferError, match="outside"):
        a.write_blocks(b.address(), [1], [40], "r", timeout_s=5)


def test_transfer_to_another_process(pair, remote_peer):
    a, _ = pair
    address, _, ask = remote_peer
    src, dst = [0, 1, 2, 3, 9, 25], [10, 11, 12, 13, 5, 39]
    result = a.write_blocks(address, src, dst, "r", timeout_s=10)
    ask.send(dst)
    assert torch.equal(ask.recv(), a.kv_cache[:, :, src])
    ask.send([i for i in range(SHAPE[2]) if i not in dst])
    assert ask.recv().abs().sum() == 0
    assert result.num_bytes == len(src) * SHAPE[0] * 2 * SHAPE[3] * SHAPE[4] * SHAPE[5] * 4


@pytest.mark.parametrize("remote_shape", [(3, 2, 24, 4, 2, 8), (3, 2, 64, 4, 2, 8)], ids=["fewer", "more"])
def test_pools_of_different_sizes(backend, remote_peer, remote_shape):
    """The decode pool is rarely the prefill pool's size: each (layer, K/V) slab of the receiver starts at
    its own block count, so blocks must land by the receiver's layout (a same-host copy once used the
    sender's, and wrote every layer past the first into the wrong place)."""
    a = make(backend)
    a.register(torch.randn(SHAPE))
    try:
        address, _, ask = remote_peer
        src, dst = [0, 1, 2, 7, 39], [3, 4, 5, 0, remote_shape[2] - 1]
        a.write_blocks(address, src, dst, "sizes", timeout_s=20)
        ask.send(dst)
        assert torch.equal(ask.recv(), a.kv_cache[:, :, src])
        ask.send([i for i in range(remote_shape[2]) if i not in dst])
        assert ask.recv().abs().sum() == 0
    finally:
        a.close()


BIG_SHAPE = (4, 2, 64, 16, 4, 64)  # 128 KiB per block over all slabs: 48 blocks are 6 MiB


@pytest.mark.parametrize("remote_shape", [BIG_SHAPE])
def test_a_large_transfer_split_across_lanes_lands_exactly(backend, remote_peer, remote_shape):
    """Past copy_lanes.PARALLEL_MIN_BYTES the same-host tcp copy and nixl split the bytes over two
    threads; every byte still lands where it belongs, and a dead peer still fails cleanly."""
    from workers.transport.copy_lanes import PARALLEL_MIN_BYTES

    a = make(backend)
    a.register(torch.randn(BIG_SHAPE))
    try:
        address, proc, ask = remote_peer
        src = list(range(40)) + [41, 43, 50, 60, 44, 45, 46, 63]  # one long run, then scattered ones
        dst = list(range(10, 50)) + [0, 2, 4, 6, 51, 52, 53, 63]
        result = a.write_blocks(address, src, dst, "big", timeout_s=20)
        assert result.num_bytes == len(src) * a.kv_cache[:, :, 0].numel() * 4 >= PARALLEL_MIN_BYTES
        ask.send(dst)
        assert torch.equal(ask.recv(), a.kv_cache[:, :, src])
        ask.send([i for i in range(BIG_SHAPE[2]) if i not in dst])
        assert ask.recv().abs().sum() == 0
        proc.kill()
        proc.join(timeout=10)
        t0 = time.perf_counter()
        with pytest.raises(TransferError, match="failed|timed out|refused"):
            a.write_blocks(address, src, dst, "after-death", timeout_s=3.0)
        assert time.perf_counter() - t0 < 5
    finally:
        a.close()


def test_tcp_same_host_copy_is_used_only_between_processes_of_one_host(monkeypatch):
    used = []
    real = tcp_transport.write_to_process
    monkeypatch.setattr(tcp_transport, "write_to_process", lambda *a: used.append(a) or real(*a))
    a, b, sockets_only = TcpTransport(), TcpTransport(), TcpTransport(same_host_copy=False)
    a.register(torch.randn(SHAPE))
    for t in (b, sockets_only):
        t.register(torch.zeros(SHAPE))
    try:
        assert b.address()["host_id"] == a.host_id and "pid" not in sockets_only.address()
        a.write_blocks(b.address(), [1, 2], [3, 4], "direct", timeout_s=5)
        assert len(used) == 1 and torch.equal(b.kv_cache[:, :, 3:5], a.kv_cache[:, :, 1:3])
        a.write_blocks(sockets_only.address(), [1, 2], [3, 4], "socket", timeout_s=5)
        other_host = {**b.address(), "host_id": "another-boot/1"}
        a.write_blocks(other_host, [5], [6], "socket", timeout_s=5)
        assert len(used) == 1 and torch.equal(sockets_only.kv_cache[:, :, 3:5], a.kv_cache[:, :, 1:3])
        assert torch.equal(b.kv_cache[:, :, 6], a.kv_cache[:, :, 5])
    finally:
        for t in (a, b, sockets_only):
            t.close()


@pytest.fixture
def tcp_pair():
    a, b = TcpTransport(), TcpTransport()
    a.register(torch.randn(SHAPE))
    b.register(torch.zeros(SHAPE))
    assert a.host_id is not None, "this Linux host has process_vm_writev"
    yield a, b
    a.close()
    b.close()


def test_tcp_same_host_copy_refused_by_the_kernel_falls_back_to_the_socket(tcp_pair, monkeypatch, caplog):
    def refuse(*_):
        raise OSError(errno.EPERM, "Operation not permitted")

    a, b = tcp_pair
    monkeypatch.setattr(tcp_transport, "write_to_process", refuse)
    a.write_blocks(b.address(), [7, 8], [1, 2], "r", timeout_s=5)
    assert torch.equal(b.kv_cache[:, :, 1:3], a.kv_cache[:, :, 7:9])
    assert a.host_id is None and "use the socket" in caplog.text


def test_tcp_same_host_copy_to_a_wrong_address_fails_cleanly(tcp_pair):
    a, b = tcp_pair
    with pytest.raises(TransferError, match="stale address"):  # the receiver vouches for pid and base
        a.write_blocks({**b.address(), "base": 4096}, [1], [1], "r", timeout_s=5)
    with pytest.raises(TransferError, match="stale address"):
        a.write_blocks({**b.address(), "pid": 1}, [1], [1], "r", timeout_s=5)
    assert b.kv_cache.abs().sum() == 0
    a.write_blocks(b.address(), [1], [1], "next", timeout_s=5)
    assert torch.equal(b.kv_cache[:, :, 1], a.kv_cache[:, :, 1])


def test_killed_peer_fails_within_timeout_and_sender_keeps_serving(pair, remote_peer):
    a, b = pair
    address, proc, _ = remote_peer
    a.write_blocks(address, [0], [0], "warm", timeout_s=10)  # an established connection, then death
    proc.kill()
    proc.join(timeout=10)
    t0 = time.perf_counter()
    with pytest.raises(TransferError, match="failed|timed out"):
        a.write_blocks(address, list(range(30)), list(range(30)), "r", timeout_s=3.0)
    assert time.perf_counter() - t0 < 5
    a.write_blocks(b.address(), [5], [6], "next", timeout_s=5)
    assert torch.equal(b.kv_cache[:, :, 6], a.kv_cache[:, :, 5])


def test_stopped_peer_never_hangs_the_sender(pair, remote_peer):
    """A receiver that stops answering (SIGSTOP): the write finishes or fails within the timeout.

    One-sided backends (nixl over shared memory) may legitimately complete without the receiver's CPU.
    """
    a, b = pair
    address, proc, _ = remote_peer
    os.kill(proc.pid, signal.SIGSTOP)
    t0 = time.perf_counter()
    try:
        a.write_blocks(address, list(range(30)), list(range(30)), "r", timeout_s=1.5)
    except TransferError as e:
        assert "timed out" in str(e) or "failed" in str(e)
    assert time.perf_counter() - t0 < 4
    a.write_blocks(b.address(), [7], [8], "next", timeout_s=5)
    assert torch.equal(b.kv_cache[:, :, 8], a.kv_cache[:, :, 7])


def test_tcp_unresponsive_listener_times_out():
    a = TcpTransport()
    a.register(torch.randn(SHAPE))
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never reads or answers
    try:
        t0 = time.perf_counter()
        with pytest.raises(TransferError, match="timed out"):
            a.write_blocks({"host": "127.0.0.1", "port": silent.getsockname()[1]}, list(range(30)),
                           list(range(30)), "r", timeout_s=1.0)
        assert time.perf_counter() - t0 < 3
    finally:
        silent.close()
        a.close()


@pytest.fixture
def nccl_pair():
    a, b = make_transport("nccl"), make_transport("nccl")
    a.register(torch.randn(SHAPE))
    b.register(torch.zeros(SHAPE))
    yield a, b
    a.close()
    b.close()


def test_nccl_pair_group_is_kept_and_one_dropped_after_a_failure_is_made_again(nccl_pair):
    a, b = nccl_pair
    assert b.address()["collective"] == "gloo"
    a.write_blocks(b.address(), [1], [1], "first", timeout_s=10)
    a.write_blocks(b.address(), [2], [2], "second", timeout_s=10)
    assert len(b._receiving) == 1  # one group for both transfers
    b._drop_receiving(next(iter(b._receiving)))  # the receiver's side failed and dropped its group
    with pytest.raises(TransferError, match="unknown pair group"):
        a.write_blocks(b.address(), [3], [3], "refused", timeout_s=10)
    a.write_blocks(b.address(), [4, 5], [4, 5], "new group", timeout_s=10)
    a.piece_bytes = 1  # one layer per send; the receiver splits the same way, whatever its own setting
    a.write_blocks(b.address(), [7, 8, 9], [9, 8, 7], "pieces", timeout_s=10)
    assert torch.equal(b.kv_cache[:, :, [1, 2, 4, 5, 9, 8, 7]], a.kv_cache[:, :, [1, 2, 4, 5, 7, 8, 9]])
    assert b.kv_cache[:, :, 3].abs().sum() == 0


def test_a_peer_of_another_backend_is_refused_with_the_reason(nccl_pair):
    a, b = nccl_pair
    tcp = TcpTransport(same_host_copy=False)
    tcp.register(torch.randn(SHAPE))
    try:
        with pytest.raises(TransferError, match="backend mismatch: the sender speaks tcp, the receiver nccl"):
            tcp.write_blocks(b.address(), [1], [1], "r", timeout_s=5)
        with pytest.raises(TransferError, match="backend mismatch: the sender speaks tcp, the receiver nccl"):
            tcp.write_blocks({**b.address(), "backend": "tcp"}, [1], [1], "r", timeout_s=5)  # the receiver's check
        with pytest.raises(TransferError, match="backend mismatch: the sender speaks nccl, the receiver tcp"):
            a.write_blocks(tcp.address(), [1], [1], "r", timeout_s=5)
    finally:
        tcp.close()
    assert b.kv_cache.abs().sum() == 0


def test_nccl_receiver_that_never_posts_its_receive_times_out_the_send(nccl_pair, monkeypatch):
    a, b = nccl_pair
    a.write_blocks(b.address(), [1], [1], "warm", timeout_s=10)
    stuck = threading.Event()
    monkeypatch.setattr(b, "_receive_payload", lambda *_: stuck.wait(10))
    t0 = time.perf_counter()
    with pytest.raises(TransferError, match="timed out"):
        a.write_blocks(b.address(), list(range(30)), list(range(30)), "stuck", timeout_s=1.0)
    assert time.perf_counter() - t0 < 3
    stuck.set()
    monkeypatch.undo()
    a.write_blocks(b.address(), [6], [6], "after", timeout_s=10)
    assert torch.equal(b.kv_cache[:, :, 6], a.kv_cache[:, :, 6])
