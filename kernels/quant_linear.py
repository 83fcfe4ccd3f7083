"""Linear layers over GGUF-quantized weights (Q4_1, Q8_0) kept as their bytes, on CPU.

    w = QuantizedWeight("q4_1", data, in_features=576)    # data: the GGUF's blocks, [N, K / 32 * 20] uint8
    y = linear(x, w)                                        # x: [M, K] fp32 -> [M, N]

Decode at small batch is bound by the bytes of weights a step reads: Q4_1 is 5 bits a weight
against fp32's 32. Up to ``DENSE_FROM_ROWS`` rows of x the compiled kernel
(``kernels/csrc/quant_linear_cpu.cpp``) multiplies straight from the blocks; from there on (a long
prefill chunk) the weight is dequantized in slabs of rows and multiplied with torch's BLAS, which is
faster once the multiply, not the read, is the cost. Both paths round x to 8 bits a block of 32 (as
llama.cpp does) and multiply the same numbers, so a request's tokens do not depend on how many other
tokens shared its step; only the summation order differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import cpu_kernel

BLOCK = 32
# Bytes of one block of 32 columns per row of ``data``. "q4_1x8" is Q4_1 with 8 weight rows interleaved
# into each row of data (``interleave``), the layout the kernel multiplies fastest.
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34, "q4_1x8": 160}
ROWS_PER_DATA_ROW = {"q4_1": 1, "q8_0": 1, "q4_1x8": 8}
# Rows of x from which a step dequantizes and multiplies with BLAS. One layer's matrix with its weights in
# cache (2-core AVX2 CPU, 2026-11-23): the kernel wins at 16 rows (0.28 against 0.37 ms), BLAS at 64
# (0.87 against 1.17 ms). Streaming from memory the kernel reads a fifth of the bytes, so decode batches
# up to here stay on it; long prefill chunks go to BLAS.
DENSE_FROM_ROWS = 96
# Rows of weight dequantized at a time on the dense path: a slab stays in L2 instead of streaming a
# whole fp32 copy of the matrix through memory.
SLAB_ROWS = 256


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
        if ROWS_PER_DATA_ROW[self.format] != 1:
            raise ValueError(f"{self.format} interleaves rows: look rows up in the GGUF layout")
        return _dequantize(self.format, self.data[ids], self.in_features)


def supported() -> bool:
    """Whether quantized weights can run here (the compiled CPU kernels built)."""
    return cpu_kernel.available()


def cat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack the output rows of weights of one format and width (fused Q/K/V, gate/up)."""
    first = weights[0]
    if any(w.format != first.format or w.in_features != first.in_features for w in weights):
        raise ValueError("only weights of one format and input width can be stacked")
    return QuantizedWeight(first.format, torch.cat([w.data for w in weights]), first.in_features)


def interleave(w: QuantizedWeight) -> QuantizedWeight:
    """A Q4_1 weight with a multiple of 8 rows as "q4_1x8" (the same numbers: 2-2.5x faster to multiply from
    batch 4, ~1.4x at batch 1 on a 2-core AVX2 CPU); any other weight as it is."""
    if w.format != "q4_1" or w.out_features % ROWS_PER_DATA_ROW["q4_1x8"]:
        return w
    return QuantizedWeight("q4_1x8", torch.ops.tandem_cpu.q4_1_to_x8(w.data, w.in_features), w.in_features)


def linear(x: Tensor, w: Tensor | QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` for a dense weight or a quantized one; x: [M, K] -> [M, N]."""
    if isinstance(w, Tensor):
        return F.linear(x, w, bias)
    if x.shape[0] < DENSE_FROM_ROWS:
        y = getattr(torch.ops.tandem_cpu, f"{w.format}_linear")(x.contiguous(), w.data)
    else:  # x rounded as the kernel rounds it: both paths multiply the same numbers (fp32 rounding aside)
        xq = torch.ops.tandem_cpu.q8_round(x.contiguous())
        slab = SLAB_ROWS // ROWS_PER_DATA_ROW[w.format]
        y = torch.cat([F.linear(xq, _dequantize(w.format, w.data[n : n + slab], w.in_features))
                       for n in range(0, w.data.shape[0], slab)], dim=1)
    return y if bias is None else y + bias


def _dequantize(fmt: str, data: Tensor, in_features: int) -> Tensor:
    return getattr(torch.ops.tandem_cpu, f"{fmt}_dequantize")(data.contiguous(), in_features)
