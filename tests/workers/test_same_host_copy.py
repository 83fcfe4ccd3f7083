"""process_vm_writev through workers/same_host_copy: exact spans, thousands of them, clear errors."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from workers.transport.same_host_copy import host_identity, write_to_process


def test_spans_land_exactly_even_past_one_call_of_iov_max():
    src, dst = torch.randn(5000, 16), torch.zeros(5000, 16)
    rows = list(range(0, 5000, 2))  # 2,500 separate 64-byte spans: three system calls
    spans = [(r * 64, (4999 - r) * 64, 64) for r in rows]
    assert write_to_process(os.getpid(), src.data_ptr(), dst.data_ptr(), spans) == len(rows) * 64
    assert torch.equal(dst[[4999 - r for r in rows]], src[rows])
    assert dst[[4999 - r for r in range(1, 5000, 2)]].abs().sum() == 0


def test_an_address_outside_the_peer_is_an_oserror_not_a_crash():
    src = torch.randn(1024)
    with pytest.raises(OSError) as err:
        write_to_process(os.getpid(), src.data_ptr(), 4096, [(0, 0, 4096)])
    assert err.value.errno == errno.EFAULT


def test_host_identity_is_stable_within_a_host():
    assert host_identity() is not None and host_identity() == host_identity()


def test_a_large_write_is_split_across_threads_and_lands_exactly():
    src, dst = torch.randn(3, 1 << 20), torch.zeros(3, 1 << 20)  # 12 MiB: past the parallel threshold
    spans = [(2 * 4 << 20, 0, 4 << 20), (0, 4 << 20, 4 << 20), (4 << 20, 8 << 20, (4 << 20) - 4)]
    assert write_to_process(os.getpid(), src.data_ptr(), dst.data_ptr(), spans) == (12 << 20) - 4
    assert torch.equal(dst[0], src[2]) and torch.equal(dst[1], src[0])
    assert torch.equal(dst[2, :-1], src[1, :-1]) and dst[2, -1] == 0


def test_an_error_on_a_helper_thread_reaches_the_caller():
    import ctypes
    import mmap

    size = 12 << 20  # the helper thread writes the second half, which the peer (here: us) forbids
    dst = mmap.mmap(-1, size)
    base = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(base + size // 2), ctypes.c_size_t(size // 2), 0) == 0  # PROT_NONE
    src = torch.randn(size // 4)
    try:
        with pytest.raises(OSError) as err:
            write_to_process(os.getpid(), src.data_ptr(), base, [(0, 0, size)])
        assert err.value.errno == errno.EFAULT
        assert bytes(dst[: size // 2]) == bytes(src.view(torch.uint8)[: size // 2].numpy())  # the first half landed
    finally:
        libc.mprotect(ctypes.c_void_p(base + size // 2), ctypes.c_size_t(size // 2), mmap.PROT_READ | mmap.PROT_WRITE)
