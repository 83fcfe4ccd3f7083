"""gate_up's matrix and SiLU in one compiled call (``quant_linear.linear_silu``, kernels/csrc/quant_linear_x8_cpu.cpp):
its gate and up rows paired 16 at a time (``pair_gate_up``), each thread applying the SiLU to the units it has just
multiplied. It must give silu_mul of the unpaired matrix's output bit for bit, on every instruction set, at every
row count, however the threads cut the units."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_kernel, fused_ops, quant_linear
from tests.kernels.test_quant_linear import random_weight
from tests.threads import torch_threads


@pytest.fixture(scope="module", autouse=True)
def kernel_built() -> None:
    if not cpu_kernel.available():
        pytest.skip(f"the CPU kernels cannot be built here: {cpu_kernel.unavailable_reason()}")


def gate_and_up(fmt: str, rows: int, k: int, pairs: bool) -> tuple[quant_linear.QuantizedWeight, ...]:
    """(paired gate_up, the same two stacked gate then up) in fmt's x8 or x8p layout."""
    gate, _ = random_weight(fmt, rows, k, seed=1)
    up, _ = random_weight(fmt, rows, k, seed=2)
    paired = quant_linear.pair_gate_up(gate, up, pairs)
    stacked = quant_linear.interleave(quant_linear.cat_rows([gate, up]), pairs)
    assert paired is not None and paired.format == stacked.format == f"{fmt}x8{'p' if pairs else ''}"
    return paired, stacked


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("pairs", [False, True])
def test_linear_silu_gives_silu_mul_of_the_matrix_bit_for_bit(fmt: str, pairs: bool) -> None:
    paired, stacked = gate_and_up(fmt, 80, 192, pairs)  # 5 units of 16 gate and 16 up rows: 20 groups of 8
    x = torch.randn(130, 192, generator=torch.Generator().manual_seed(3))
    x[:, 7] *= 30
    with cpu_kernel.instruction_set("avx2"):
        want = fused_ops.silu_mul(quant_linear.linear(x, stacked))
    assert want.shape == (130, 80) and want.std() > 0
    for isa in cpu_kernel.instruction_sets():  # amx: tiles from its 32 rows
        with cpu_kernel.instruction_set(isa):
            # 1-3 threads: below 64 rows a cut may fall inside a unit (2 threads: groups 10 | 10; 3: 7 | 7 | 6), which
            # the thread before takes whole; from 64 rows the threads take a unit at a time from a shared counter.
            for n in (1, 2, 3):
                with torch_threads(n):
                    for m in (1, 3, 8, 9, 33, 64, 130):
                        assert torch.equal(quant_linear.linear_silu(x[:m], paired), want[:m]), (isa, n, m)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_a_mebibyte_of_act_is_streamed_with_the_same_bits(fmt: str) -> None:
    """From 1 MiB of act (a prefill chunk's) each unit's lines go past the cache (non-temporal stores, fenced before
    the threads join): the same bits as the cached path's."""
    paired, stacked = gate_and_up(fmt, 1024, 64, cpu_kernel.pairs_groups())
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(5))
    assert 300 * 1024 * 4 >= 1 << 20
    with cpu_kernel.instruction_set("avx2"):
        want = fused_ops.silu_mul(quant_linear.linear(x, stacked))
    for isa in cpu_kernel.instruction_sets():
        with cpu_kernel.instruction_set(isa):
            for n in (1, 2, 3):
                with torch_threads(n):
                    assert torch.equal(quant_linear.linear_silu(x, paired), want), (isa, n)


def test_what_cannot_pair_is_left_unpaired() -> None:
    gate, _ = random_weight("q4_1", 24, 64)  # 24 rows: not whole units of 16
    assert quant_linear.pair_gate_up(gate, random_weight("q4_1", 24, 64)[0]) is None
    gate, _ = random_weight("q4_1", 32, 64)
    assert quant_linear.pair_gate_up(gate, random_weight("q8_0", 32, 64)[0]) is None  # formats differ
    assert quant_linear.pair_gate_up(gate, random_weight("q4_1", 32, 96)[0]) is None  # widths differ
    lone, _ = random_weight("q4_1x8", 40, 64)  # 5 groups: not whole units of 4 groups
    with pytest.raises(RuntimeError, match="not whole units of gate and up"):
        quant_linear.linear_silu(torch.randn(2, 64), lone)


def test_the_bundled_models_gate_up_is_paired(quantized_model, dense_model) -> None:
    """Its rows, dequantized, are the dense model's gate rows 0-15, up rows 0-15, gate rows 16-31, ..."""
    layer, dense = quantized_model.layers[2], dense_model.layers[2].gate_up
    assert layer.gate_up_paired
    inter = dense.shape[0] // 2
    units = torch.stack([dense[:inter].view(-1, 16, dense.shape[1]), dense[inter:].view(-1, 16, dense.shape[1])], 1)
    assert torch.equal(layer.gate_up.dequantize(), units.reshape(dense.shape))
