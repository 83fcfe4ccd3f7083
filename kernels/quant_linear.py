"""Linear layers over GGUF-quantized weights (Q4_1, Q8_0) kept as their bytes, on CPU.

    w = QuantizedWeight("q4_1", data, in_features=576)    # data: the GGUF's blocks, [N, K / 32 * 20] uint8
    y = linear(x, w)                                        # x: [M, K] fp32 -> [M, N]
    gate_up = pair_gate_up(gate, up)                        # an MLP's two, rows alternating 16 at a time
    act = linear_silu(x, gate_up)                           # silu(x gate^T) * (x up^T), in one call

Decode at small batch is bound by the bytes of weights a step reads: Q4_1 is 5 bits a weight
against fp32's 32. The compiled kernels (``kernels/csrc/quant_linear*_cpu.cpp``) multiply straight from
the blocks, with x rounded to 8 bits a block of 32 (as llama.cpp does), at any number of rows: one int8
multiply-add instruction does 4x the products of an fp32 FMA, so they also beat dequantizing to fp32 for
torch's BLAS on long prefill chunks (the whole bundled model on a 2-core AVX2 CPU, 2026-11-24: 500 prompt
tokens in 605 against 953 ms, 4,000 in one step 5.6 against 8.3 s). The kernel's rounding is a row's own,
so a request's tokens do not depend on how many other tokens shared its step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import cpu_kernel

BLOCK = 32
# Bytes of one block of 32 columns per row of ``data``. "q4_1x8" and "q8_0x8" are Q4_1 and Q8_0 with 8
# weight rows interleaved into each row of data (``interleave``), the layout the kernel multiplies fastest;
# "x8p" the same groups stored two by two, block by block (quant_linear_x8_cpu.cpp), for the 512-bit loop.
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34, "q4_1x8": 160, "q8_0x8": 272, "q4_1x8p": 160, "q8_0x8p": 272}
ROWS_PER_DATA_ROW = {"q4_1": 1, "q8_0": 1, "q4_1x8": 8, "q8_0x8": 8, "q4_1x8p": 8, "q8_0x8p": 8}


@dataclass(frozen=True)
class QuantizedWeight:
    format: str  # a key of BLOCK_BYTES
    data: Tensor  # [N, in_features / 32 * BLOCK_BYTES[format]] uint8, the GGUF's blocks row by row
    in_features: int

    def __post_init__(self) -> None:
        if not cpu_kernel.available():  # also loads the ops this class calls
            raise ValueError(f"quantized weights need the compiled CPU kernels: {cpu_kernel.unavailable_reason()}")
        if self.format not in BLOCK_BYTES:
            raise ValueError(f"unsupported quantized format {self.format!r}; supported: {sorted(BLOCK_BYTES)}")
        if self.in_features % BLOCK or self.data.shape[1] != self.in_features // BLOCK * BLOCK_BYTES[self.format]:
            raise ValueError(f"{self.format} data of shape {tuple(self.data.shape)} does not hold rows of "
                             f"{self.in_features} weights")

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0]) * ROWS_PER_DATA_ROW[self.format]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self) -> Tensor:  # [N, K] fp32
        return _dequantize(self.format, self.data, self.in_features)

    def rows(self, ids: Tensor) -> Tensor:  # [T] -> [T, K] fp32: an embedding lookup
        per = ROWS_PER_DATA_ROW[self.format]
        if per == 1:
            return _dequantize(self.format, self.data[ids], self.in_features)
        # Interleaved: each id's row picked out of its group's blocks in one compiled call.
        return getattr(torch.ops.tandem_cpu, f"{self.format}_rows")(self.data, ids.long(), self.in_features)


def supported() -> bool:
    """Whether quantized weights can run here (the compiled CPU kernels built)."""
    return cpu_kernel.available()


def cat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack the output rows of weights of one format and width (fused Q/K/V, gate/up)."""
    first = weights[0]
    if any(w.format != first.format or w.in_features != first.in_features for w in weights):
        raise ValueError("only weights of one format and input width can be stacked")
    return QuantizedWeight(first.format, torch.cat([w.data for w in weights]), first.in_features)


def interleave(w: QuantizedWeight, pairs: bool | None = None) -> QuantizedWeight:
    """A Q4_1 or Q8_0 weight with a multiple of 8 rows as "q4_1x8" or "q8_0x8" (the same numbers, faster to
    multiply on a 2-core AVX2 CPU: Q4_1 2-2.5x from batch 4 and ~1.4x at batch 1; the Q8_0 head 1.5x at
    batch 8-16, as fast at batch 1); any other as it is. ``pairs`` (default: where the kernels multiply on
    512-bit vectors from one row of x, ``cpu_kernel.pairs_groups``): as "x8p", which that loop reads as one
    stream (batch 1 on 2 Zen 5 cores ~5% faster) and the 256-bit loops ~10% slower."""
    suffix = "x8p" if (cpu_kernel.pairs_groups() if pairs is None else pairs) else "x8"
    interleaved = f"{w.format}{suffix}"
    if interleaved not in BLOCK_BYTES or w.out_features % ROWS_PER_DATA_ROW[interleaved]:
        return w
    data = getattr(torch.ops.tandem_cpu, f"{w.format}_to_{suffix}")(w.data, w.in_features)
    return QuantizedWeight(interleaved, data, w.in_features)


# gate_up's rows in pair_gate_up's order alternate this many gate rows and as many up rows (decoder_cpu.cpp and
# quant_linear_x8_cpu.cpp read the same number).
SILU_UNIT = 16


def pair_gate_up(gate: QuantizedWeight, up: QuantizedWeight, pairs: bool | None = None) -> QuantizedWeight | None:
    """gate and up stacked for ``linear_silu``: their rows alternating SILU_UNIT at a time (gate rows 0-15, up rows
    0-15, gate rows 16-31, ...), interleaved by 8 rows (``interleave``, and its ``pairs``). None where that op cannot
    take them: other formats or widths, or rows not a whole number of units."""
    if (gate.format != up.format or gate.format not in ("q4_1", "q8_0") or gate.in_features != up.in_features
            or gate.out_features != up.out_features or gate.out_features % SILU_UNIT):
        return None
    units = gate.out_features // SILU_UNIT
    rows = torch.stack([gate.data.reshape(units, SILU_UNIT, -1), up.data.reshape(units, SILU_UNIT, -1)], dim=1)
    paired = interleave(QuantizedWeight(gate.format, rows.reshape(2 * gate.out_features, -1), gate.in_features), pairs)
    return paired if paired.format != gate.format else None


def linear_silu(x: Tensor, gate_up: QuantizedWeight) -> Tensor:
    """silu(gate) * up of ``linear(x, gate_up)`` for a gate_up from ``pair_gate_up``, in one compiled call that
    applies the SiLU while each thread's columns are in its cache: x [M, K] -> [M, N / 2], the same bits as
    ``silu_mul`` of the unpaired matrix's output."""
    return getattr(torch.ops.tandem_cpu, f"{gate_up.format}_linear_silu")(x.contiguous(), gate_up.data)


def linear(x: Tensor, w: Tensor | QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` for a dense weight or a quantized one; x: [M, K] -> [M, N]."""
    if isinstance(w, Tensor):
        return F.linear(x, w, bias)
    y = getattr(torch.ops.tandem_cpu, f"{w.format}_linear")(x.contiguous(), w.data)
    return y if bias is None else y + bias


def _dequantize(fmt: str, data: Tensor, in_features: int) -> Tensor:
    return getattr(torch.ops.tandem_cpu, f"{fmt}_dequantize")(data.contiguous(), in_features)
