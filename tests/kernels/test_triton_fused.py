"""The Triton RMSNorm (with the residual add) and RoPE kernels against the torch formulas HF runs
(interpreter on CPU, in fp16: bf16 arithmetic is wrong there; real kernels and bf16 on a GPU)."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_ops
from kernels.triton_fused import add_rms_norm, rope

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16]


def torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units of the last place (the dtype's spacing at b's magnitude)."""
    spacing = torch.finfo(b.dtype).eps * b.float().abs().clamp_min(torch.finfo(b.dtype).tiny)
    return int(((a.float() - b.float()).abs() / spacing).max().ceil().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 1000])
def test_add_rms_norm_is_torchs_add_then_norm(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    h = (torch.randn(7, hidden, generator=g) * 3).to(DEVICE, dtype)
    delta = torch.randn(7, hidden, generator=g).to(DEVICE, dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(DEVICE, dtype)
    expected_h = h + delta
    expected = torch_rms_norm(expected_h, w, 1e-5)
    got = add_rms_norm(h, delta, w, 1e-5)
    assert torch.equal(h, expected_h)  # the residual add is one rounding, as torch's
    assert ulps_apart(got, expected) <= 1  # the fp32 sum's order may tip a rounding
    assert (got != expected).float().mean().item() < 0.02
    alone = add_rms_norm(expected_h.clone(), None, w, 1e-5)
    assert torch.equal(alone, got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rounds_as_torch_does(dtype):
    from workers.model.rope import RotaryEmbedding

    rot = RotaryEmbedding(64, 512, 10000.0, None, torch.device(DEVICE), dtype)
    positions = torch.tensor([0, 1, 17, 300, 511], device=DEVICE)
    cos, sin = rot.cos_sin(positions)
    # Q and K heads side by side in a wider row, as the model's fused QKV output holds them.
    qkv = torch.randn(5, 12 * 64, generator=torch.Generator().manual_seed(0)).to(DEVICE, dtype)
    qk = qkv[:, : 9 * 64].view(5, 9, 64)
    expected = torch_rope(qk, cos, sin)
    untouched = qkv[:, 9 * 64 :].clone()
    half = 32
    rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
    # What one rounding of the products can move the sum by (where they nearly cancel, many of the sum's ulps)
    products = (qk.float() * cos[:, None].float()).abs() + (rotated.float() * sin[:, None].float()).abs()
    rope(qk, cos, sin)
    assert ((qk.float() - expected.float()).abs() <= torch.finfo(dtype).eps * products).all()
    if not ON_GPU:  # the interpreter rounds every op as torch does: torch's bits
        assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, 9 * 64 :], untouched)


def test_fused_ops_take_the_triton_kernels_on_16_bit_cuda_tensors_only(monkeypatch):
    calls: list[str] = []
    import kernels.triton_ops as ops

    monkeypatch.setattr(ops, "add_rms_norm", lambda *a: calls.append("norm") or a[0])
    monkeypatch.setattr(ops, "rope", lambda *a: calls.append("rope"))
    x = torch.randn(2, 64)
    fused_ops.rms_norm(x, torch.ones(64), 1e-5)
    fused_ops.add_rms_norm_(x.half(), x.half(), torch.ones(64).half(), 1e-5)  # CPU tensors: torch
    assert calls == []
    if ON_GPU:
        xs = x.to("cuda", torch.bfloat16)
        fused_ops.rms_norm(xs, torch.ones(64, device="cuda", dtype=torch.bfloat16), 1e-5)
        fused_ops.rms_norm(x.cuda(), torch.ones(64, device="cuda"), 1e-5)  # fp32 stays torch
        assert calls == ["norm"]
