"""RMSNorm (with the residual add), SiLU-times-up and RoPE in one pass a row: the compiled CPU ops
(``kernels/csrc/fused_ops_cpu.cpp``) for fp32 CPU tensors where they build, Triton kernels
(``kernels/triton_fused.py``: norm and RoPE) for 16-bit CUDA tensors, torch elsewhere.

    x = add_rms_norm_(h, delta, w, eps)   # h += delta; x = rms_norm(h)
    token_ids = argmax_rows(logits)        # a greedy step's tokens
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import cpu_kernel, dispatch


def _compiled(x: Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and cpu_kernel.available()


def _triton_fused(*tensors: Tensor) -> ModuleType | None:
    """The Triton ops where every tensor is a 16-bit CUDA one they take, else None."""
    if any(t.device.type != "cuda" for t in tensors):
        return None
    ops = dispatch.triton_ops()
    return ops if ops is not None and all(ops.fused_supports(t) for t in tensors) else None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """As HF computes it: normalize in fp32, cast back, then scale."""
    if _compiled(x):
        return torch.ops.tandem_cpu.rms_norm(x, weight, eps)
    if x.dim() == 2 and (ops := _triton_fused(x)) is not None:
        return ops.add_rms_norm(x, None, weight, eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_(h: Tensor, delta: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``h += delta`` in place, then ``rms_norm(h)``."""
    if _compiled(h) and _compiled(delta):
        return torch.ops.tandem_cpu.add_rms_norm_(h, delta, weight, eps)
    if h.dim() == 2 and (ops := _triton_fused(h, delta)) is not None:
        return ops.add_rms_norm(h, delta, weight, eps)
    h += delta
    return rms_norm(h, weight, eps)


def silu_mul(gate_up: Tensor) -> Tensor:  # [M, 2I] -> [M, I]
    if _compiled(gate_up):
        return torch.ops.tandem_cpu.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Rotate ``x`` [T, heads, D] in place by ``cos``/``sin`` [T, D] (HF's half-split layout)."""
    if _compiled(cos) and x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(-1) == 1:
        torch.ops.tandem_cpu.rope_(x, cos, sin)
        return
    head_dim = x.shape[-1]
    if (head_dim & (head_dim - 1) == 0 and cos.is_contiguous() and sin.is_contiguous()
            and (ops := _triton_fused(x, cos, sin)) is not None):
        ops.rope(x, cos, sin)
        return
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    x.copy_(x * cos[:, None] + rotated * sin[:, None])


def argmax_rows(x: Tensor) -> Tensor:  # [M, V] -> [M] int64
    """``x.argmax(dim=-1)``: the first maximum of each row (the first NaN where a row has one)."""
    if _compiled(x) and x.shape[1] > 0 and x.stride(1) == 1:
        return torch.ops.tandem_cpu.argmax_rows(x)
    return x.argmax(dim=-1)
