"""Host-side integer helpers for kernel launches.

``triton.cdiv`` and ``triton.next_power_of_2`` go through Triton's constexpr-function wrappers: on an
H100 host, seven such calls were about a fifth of a decode launch's ~75 us of host time. Launch code
runs once per layer per step, so it uses these plain versions.
"""

from __future__ import annotations

import functools

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.cache
def multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
