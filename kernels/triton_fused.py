"""Triton kernels for a layer's elementwise work on a GPU in 16-bit: RMSNorm with the residual add, and RoPE.

Torch runs HF's RMSNorm as about eight kernels and RoPE as six; here each is one program per token.
Both round where torch rounds (every 16-bit op's result): RMSNorm's mean, rsqrt and scale in fp32, cast
to the input dtype, then times the weight; RoPE's two products and their sum each rounded. The norm stays
within one unit in the last place of torch's (its fp32 sum of squares runs in another order). RoPE is
launched without FMA contraction: on an H200 the default (contraction on) kept a product unrounded before
the sum, and results differed from torch's where the two products nearly cancel.

    x = add_rms_norm_(h, delta, w, eps)    # h += delta (rounded), x = w * to16(h / rms(h))
    rope_(qk, cos, sin)                    # qk [T, heads, D] rotated in place (HF's half-split layout)

16-bit only on purpose: in fp32 the compiler may contract a product and a sum into one FMA, which
rounds once where torch rounds twice, and the fp32 path is the one kept exact against HF.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.host_math import next_power_of_2


@triton.jit
def _add_rms_norm_kernel(
    h_ptr,  # [T, N] residual stream, updated in place when HAS_DELTA
    delta_ptr,  # [T, N] added to h first (unused without HAS_DELTA)
    w_ptr,  # [N]
    out_ptr,  # [T, N]
    stride_h, stride_delta, stride_out,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two of N
    HAS_DELTA: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    dtype = h_ptr.dtype.element_ty
    h = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + cols, mask=ok, other=0.0)
        h = (h.to(tl.float32) + delta.to(tl.float32)).to(dtype)
        tl.store(h_ptr + row * stride_h + cols, h, mask=ok)
    x = h.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = (x * inv_rms).to(dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(
    x_ptr,  # [T, heads, D], each head's D contiguous
    cos_ptr,  # [T, D] contiguous
    sin_ptr,  # [T, D] contiguous
    stride_xt, stride_xh,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,  # D / 2, a power of two
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF)
    ok = (heads < NUM_HEADS)[:, None]
    dtype = x_ptr.dtype.element_ty
    first = x_ptr + t * stride_xt + heads[:, None] * stride_xh + i[None, :]  # [HEADS_PAD, HALF]
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_ptr + t * 2 * HALF + i).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + t * 2 * HALF + HALF + i).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + t * 2 * HALF + i).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + t * 2 * HALF + HALF + i).to(tl.float32)[None, :]
    # x * cos + cat(-x2, x1) * sin, every product and the sum rounded as torch rounds them
    y1 = ((x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)).to(dtype)
    y2 = ((x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)).to(dtype)
    tl.store(first, y1, mask=ok)
    tl.store(first + HALF, y2, mask=ok)


def supports(x: torch.Tensor) -> bool:
    """16-bit rows with contiguous columns (see the module's note on fp32)."""
    return x.dtype in (torch.float16, torch.bfloat16) and x.stride(-1) == 1


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` in place when a delta is given, then RMSNorm of h. h, delta: [T, N]; weight: [N]."""
    num_tokens, n = h.shape
    out = torch.empty_like(h)
    if num_tokens == 0:
        return out
    assert h.stride(1) == 1 and weight.is_contiguous() and (delta is None or delta.stride(1) == 1)
    _add_rms_norm_kernel[(num_tokens,)](
        h, h if delta is None else delta, weight, out, h.stride(0), 0 if delta is None else delta.stride(0),
        out.stride(0), eps, N=n, BLOCK=next_power_of_2(n), HAS_DELTA=delta is not None,
    )
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``x`` [T, heads, D] in place by ``cos``/``sin`` [T, D]."""
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens == 0:
        return
    assert x.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous() and cos.shape == (num_tokens, head_dim)
    assert head_dim == next_power_of_2(head_dim) and head_dim >= 2, "head_dim must be a power of 2"
    _rope_kernel[(num_tokens,)](
        x, cos, sin, x.stride(0), x.stride(1),
        NUM_HEADS=num_heads, HEADS_PAD=next_power_of_2(num_heads), HALF=head_dim // 2,
        enable_fp_fusion=False,  # each product rounded before the sum, as torch rounds it
    )
