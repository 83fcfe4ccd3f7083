"""process_vm_writev through workers/same_host_copy: exact spans, thousands of them, clear errors."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from workers.same_host_copy import host_identity, write_to_process


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
