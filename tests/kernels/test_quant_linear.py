"""The quantized linear kernels (kernels/csrc/quant_linear*_cpu.cpp) against the gguf package's own
dequantize, which HF runs: blocks made by gguf's quantize and blocks from the bundled GGUF; row counts
through the register tiles and their tails, up to a long prefill chunk; odd row counts of W. The kernels
round x to 8 bits a block (llama.cpp's Q8): each must equal a readable torch emulation of that rounding to
fp32 precision (so a row's result does not hang on its batch), and the exact product within what rounding
costs.
Then the fused elementwise ops against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, dequantize, quantize

from kernels import cpu_kernel, fused_ops, quant_linear
from kernels.quant_linear import QuantizedWeight
from tests.threads import torch_threads

FORMATS = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0,
           # the same blocks, interleaved by 8 rows after quantizing; x8p: those groups two by two
           "q4_1x8": GGMLQuantizationType.Q4_1, "q8_0x8": GGMLQuantizationType.Q8_0,
           "q4_1x8p": GGMLQuantizationType.Q4_1, "q8_0x8p": GGMLQuantizationType.Q8_0}
INTERLEAVED = [fmt for fmt in FORMATS if "x8" in fmt]
ROW_COUNTS = [1, 2, 3, 4, 5, 7, 8, 9, 17, 96, 300, 513]


@pytest.fixture(scope="module", autouse=True)
def kernel_built() -> None:
    if not cpu_kernel.available():  # no compiler or no AVX2: the engine keeps dense weights, as it says
        pytest.skip(f"the CPU kernels cannot be built here: {cpu_kernel.unavailable_reason()}")


def random_weight(fmt: str, n: int, k: int, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """A quantized weight and its dequantized fp32 reference, as the gguf package computes it."""
    dense = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = quantize(dense, FORMATS[fmt])
    reference = torch.from_numpy(np.array(dequantize(blocks, FORMATS[fmt]), dtype=np.float32))
    weight = QuantizedWeight(fmt.split("x")[0], torch.from_numpy(np.array(blocks)), k)
    if fmt in INTERLEAVED:
        weight = quant_linear.interleave(weight, pairs=fmt.endswith("p"))
        assert weight.format == fmt and weight.out_features == n
    return weight, reference


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_is_bit_exact(fmt: str) -> None:
    w, reference = random_weight(fmt, 40 if fmt in INTERLEAVED else 37, 96)  # x8p: 2 pairs and a lone group
    assert torch.equal(w.dequantize(), reference)
    ids = torch.tensor([5, 0, 36, 5, 31, 8])  # interleaved: rows from several groups, at several places in one
    assert torch.equal(w.rows(ids), reference[ids])
    assert w.rows(ids[:0]).shape == (0, 96)


@pytest.mark.parametrize("fmt", INTERLEAVED)
def test_an_embedding_lookup_outside_the_table_is_refused(fmt: str) -> None:
    w, _ = random_weight(fmt, 40, 96)
    for bad in (40, -1):
        with pytest.raises(RuntimeError, match=f"id {bad} is outside"):
            w.rows(torch.tensor([3, bad]))


def q8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: each block of 32 rounded to int8 steps of max|x| / 127, in fp32 as the kernel
    computes it (x * (127 / max), rounded half to even): in fp64 a value near a half step can round the other
    way, one step apart."""
    blocks = x.reshape(x.shape[0], -1, 32).float()
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv)
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", ROW_COUNTS)
def test_linear_matches_dequantized_matmul(fmt: str, m: int) -> None:
    n = 72 if fmt in INTERLEAVED else 67  # an odd N where the layout allows it
    w, reference = random_weight(fmt, n, 160, seed=m)
    gen = torch.Generator().manual_seed(m)  # seeded: an unseeded x took whatever earlier tests left in the RNG
    x = torch.randn(m, 160, generator=gen)
    x[:, 7] *= 30  # an outlier channel, as real activations have
    bias = torch.randn(n, generator=gen)
    got = quant_linear.linear(x, w, bias).double()
    exact = x.double() @ reference.double().T + bias.double()
    assert got.shape == (m, n)
    emulated = q8_rounded(x) @ reference.double().T + bias.double()
    assert (got - emulated).abs().max().item() < 1e-3
    assert ((got - exact).norm() / exact.norm()).item() < 0.02  # what 8-bit activations cost


@pytest.mark.parametrize("fmt", INTERLEAVED)
def test_every_instruction_set_gives_the_same_bits(fmt: str) -> None:
    """VNNI's dpbusd sums the same integers as AVX2's maddubs chain, and the float work after is the same:
    a row's output must not depend on the machine's instruction set (nor on the row tile, 4 or 8, nor on
    whether its group was paired for 512-bit vectors, nor on whether a pair was unpacked once for all tiles)."""
    w, _ = random_weight(fmt, 72, 192, seed=3)  # 9 groups of 8: pairs for 512-bit vectors, and one left
    x = torch.randn(130, 192, generator=torch.Generator().manual_seed(3))
    x[:, 5] *= 40
    x[::3, 64:96] = 0  # a block of zeros (its scale 0) in every third row: x is rounded alike on every set too
    outputs = {}
    row_counts = (1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 21, 33, 45, 64, 130)
    for isa in cpu_kernel.instruction_sets():
        with cpu_kernel.instruction_set(isa):  # from 33 rows the 512-bit path unpacks each pair once
            outputs[isa] = {m: quant_linear.linear(x[:m], w) for m in row_counts}
    assert "avx2" in outputs
    for isa, by_rows in outputs.items():
        for m, y in by_rows.items():
            assert torch.equal(y, outputs["avx2"][m]), (isa, m)
            assert torch.equal(y, outputs["avx2"][130][:m]), (isa, m)  # a row's output is its own
    # Nor on where the threads cut the groups: 1 thread takes all 9; below 64 rows 2 and 3 threads cut at groups 5
    # and 3 and 6, inside pairs (x8p stores groups two by two, so a cut there leaves a group without its partner);
    # from 64 rows (a prompt's) they take 4 groups at a time from a shared counter, in whatever order they finish.
    for n in (1, 3):
        with torch_threads(n):
            for m in (1, 8, 45, 64, 130):
                assert torch.equal(quant_linear.linear(x[:m], w), outputs["avx2"][m]), (n, m)


@pytest.mark.skipif("amx" not in cpu_kernel.instruction_sets(), reason="this CPU (or its OS) gives no AMX-INT8 tiles")
@pytest.mark.parametrize("fmt", INTERLEAVED)
def test_amx_tiles_give_the_same_bits_at_every_row_count(fmt: str) -> None:
    """On tiles (kernels/csrc/quant_x8_amx.h) at every row count, not only from amx_min_rows(): one tile of 1-16
    rows, tiles of two sizes (17: 9 and 8; 40: 14, 13, 13), many tiles (130), on 1-3 threads (cuts inside pairs)."""
    w, _ = random_weight(fmt, 72, 192, seed=7)
    x = torch.randn(130, 192, generator=torch.Generator().manual_seed(7))
    x[:, 9] *= 50
    x[1::4, 32:64] = 0
    with cpu_kernel.instruction_set("avx2"):
        expected = quant_linear.linear(x, w)
    with cpu_kernel.instruction_set("amx"):
        before = torch.ops.tandem_cpu.set_amx_min_rows(1)
        try:
            assert torch.ops.tandem_cpu.amx_min_rows() == 1
            for n in (1, 2, 3):
                with torch_threads(n):
                    for m in (*range(1, 18), 24, 40, 130):
                        assert torch.equal(quant_linear.linear(x[:m], w), expected[:m]), (n, m)
        finally:
            torch.ops.tandem_cpu.set_amx_min_rows(before)
    with cpu_kernel.instruction_set("avx512_vnni"):
        assert torch.ops.tandem_cpu.amx_min_rows() == 0  # the 512-bit loops alone


@pytest.mark.skipif("amx" not in cpu_kernel.instruction_sets(), reason="this CPU (or its OS) gives no AMX-INT8 tiles")
@pytest.mark.parametrize("fmt", INTERLEAVED)
def test_amx_outputs_of_a_mebibyte_are_streamed_with_the_same_bits(fmt: str) -> None:
    """From 1 MiB of output the tiles write y with non-temporal stores (quant_x8_amx.h): the same bits as avx2's,
    with each thread's last stores fenced before the threads join. With 2,056 columns every other row's lines are
    not whole: those are stored plainly."""
    x = torch.randn(160, 64, generator=torch.Generator().manual_seed(11))
    for rows in (2048, 2056):
        w, _ = random_weight(fmt, rows, 64, seed=11)
        assert x.shape[0] * rows * 4 >= 1 << 20
        with cpu_kernel.instruction_set("avx2"):
            expected = quant_linear.linear(x, w)
        with cpu_kernel.instruction_set("amx"):
            for n in (1, 2, 3):
                with torch_threads(n):
                    assert torch.equal(quant_linear.linear(x, w), expected), (rows, n)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_groups_stored_two_by_two_give_the_same_bits(fmt: str) -> None:
    """x8p holds x8's blocks in another order (9 groups: 4 pairs and a lone one): the same products, bit for
    bit, on every instruction set, and the same rows looked up."""
    plain, _ = random_weight(f"{fmt}x8", 72, 192, seed=5)
    pairs, _ = random_weight(f"{fmt}x8p", 72, 192, seed=5)
    assert plain.data.shape == pairs.data.shape and not torch.equal(plain.data, pairs.data)
    x = torch.randn(9, 192, generator=torch.Generator().manual_seed(5))
    for isa in cpu_kernel.instruction_sets():
        with cpu_kernel.instruction_set(isa):
            for m in (1, 4, 9):
                assert torch.equal(quant_linear.linear(x[:m], pairs), quant_linear.linear(x[:m], plain)), (isa, m)
    ids = torch.tensor([0, 8, 15, 64, 71])
    assert torch.equal(pairs.rows(ids), plain.rows(ids))


def test_unknown_instruction_set_is_refused() -> None:
    with pytest.raises(RuntimeError, match="unknown instruction set sse4"):
        torch.ops.tandem_cpu.set_isa("sse4")
    assert torch.ops.tandem_cpu.isa() in cpu_kernel.instruction_sets()
    with pytest.raises(RuntimeError, match="amx_min_rows must be >= 1, got 0"):
        torch.ops.tandem_cpu.set_amx_min_rows(0)


def test_bundled_gguf_blocks(quantized_model, dense_model) -> None:
    """The model's stacked Q/K/V blocks, un-permuted by whole rows (then interleaved by 8), equal the dense
    (HF-layout) weights."""
    qkv = quantized_model.layers[3].qkv
    dense = dense_model.layers[3].qkv
    layout = "x8p" if cpu_kernel.pairs_groups() else "x8"  # the one for this CPU's best instruction set
    assert isinstance(qkv, QuantizedWeight) and qkv.format == f"q4_1{layout}"
    assert torch.equal(qkv.dequantize(), dense)
    assert isinstance(quantized_model.embed, QuantizedWeight) and quantized_model.embed.format == f"q8_0{layout}"


def test_bad_shapes_are_refused() -> None:
    w, _ = random_weight("q4_1", 8, 64)
    with pytest.raises(RuntimeError, match="K=96"):
        quant_linear.linear(torch.randn(2, 96), w)
    with pytest.raises(ValueError, match="does not hold rows"):
        QuantizedWeight("q4_1", w.data, 96)
    with pytest.raises(ValueError, match="unsupported quantized format"):
        QuantizedWeight("q5_k", w.data, 64)
    with pytest.raises(ValueError, match="one format"):
        quant_linear.cat_rows([w, random_weight("q8_0", 8, 64)[0]])
    odd, _ = random_weight("q4_1", 12, 64)
    assert quant_linear.interleave(odd) is odd  # 12 rows do not make groups of 8: kept as they are
    with pytest.raises(RuntimeError, match="multiple of 8 rows"):
        torch.ops.tandem_cpu.q4_1_to_x8(odd.data, 64)


@pytest.mark.parametrize("m", [1, 3, 40])
def test_fused_elementwise_ops(m: int) -> None:
    h, delta, w = torch.randn(m, 576) * 3, torch.randn(m, 576), torch.randn(576)
    expected_h = h + delta
    expected = F.rms_norm(expected_h, (576,), w, 1e-5)
    assert torch.allclose(fused_ops.rms_norm(expected_h, w, 1e-5), expected, atol=1e-5, rtol=1e-5)
    got = fused_ops.add_rms_norm_(h, delta, w, 1e-5)
    assert torch.equal(h, expected_h)  # the residual add happened in place
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    gate_up = torch.randn(m, 2 * 1536) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(fused_ops.silu_mul(gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("width", [1536, 1000, 37])
def test_silu_mul_gives_the_same_bits_on_every_instruction_set(width: int) -> None:
    """512-bit loops (and a masked tail) where the kernels run AVX-512, at::vec's 256-bit ones elsewhere: a lane
    takes the same operations either way, exp included, so the bits agree; values reach exp's clamps (|x| > 88)."""
    gate_up = torch.cat([torch.randn(20, 2 * width) * 4, torch.linspace(-200, 200, 2 * width)[None]])
    outs = {}
    for isa in cpu_kernel.instruction_sets():
        with cpu_kernel.instruction_set(isa):
            outs[isa] = fused_ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(outs["avx2"], F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    for isa, got in outs.items():
        assert torch.equal(got, outs["avx2"]), isa


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_fused_rope_matches_hf_rotation(num_tokens: int) -> None:
    qkv = torch.randn(num_tokens, (9 + 2 * 3) * 64)
    qk = qkv[:, : 12 * 64].view(num_tokens, 12, 64)  # a strided view, as the model passes it
    angles = torch.rand(num_tokens, 32) * 100
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    rotated = torch.cat([-qk[..., 32:], qk[..., :32]], dim=-1)
    expected = qk * cos[:, None] + rotated * sin[:, None]
    untouched = qkv[:, 12 * 64 :].clone()
    fused_ops.rope_(qk, cos, sin)
    assert torch.allclose(qk, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, 12 * 64 :], untouched)  # V is not rotated


def test_argmax_rows_is_torchs_argmax() -> None:
    """The greedy token: the first of tied maxima, the first NaN of a row with any, +-inf, rows of every width
    (vector tails), and logits as the model gives them."""
    for width in (1, 7, 8, 9, 49152):
        x = torch.randn(7, width)
        x[1] = 0.5  # all tied
        x[2, width // 2] = float("inf")
        x[3] = float("-inf")
        x[4, -1] = float("nan")
        x[5, : width // 3] = float("nan")  # an empty slice below width 3
        x[6] = -0.0
        x[6, width // 2 :] = 0.0  # -0 and +0 tie: the first wins
        assert torch.equal(torch.ops.tandem_cpu.argmax_rows(x), x.argmax(dim=-1)), width
    logits = torch.randn(16, 49152) * 8
    logits[:, 1234] = logits.max() + 1
    logits[3, 999] = logits[3, 1234]  # a tie: the first wins
    assert torch.equal(fused_ops.argmax_rows(logits), logits.argmax(dim=-1))
    assert torch.equal(fused_ops.argmax_rows(logits[:, ::2]), logits[:, ::2].argmax(dim=-1))  # strided: torch's


def test_weight_format_is_checked_by_name() -> None:
    from workers.engine.config import EngineConfig
    from workers.engine.model_loading import resolve_weight_format

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_weight_format(EngineConfig(), cpu, torch.float32) == "gguf"
    assert resolve_weight_format(EngineConfig(), cuda, torch.bfloat16) == "dense"  # auto never picks what can't run
    assert resolve_weight_format(EngineConfig(weight_format="dense"), cpu, torch.float32) == "dense"
    with pytest.raises(ValueError, match="weight_format must be auto, gguf or dense, got 'q5_k'"):
        resolve_weight_format(EngineConfig(weight_format="q5_k"), cpu, torch.float32)
    with pytest.raises(ValueError, match="weight_format 'gguf' runs on CPU in float32, not cuda"):
        resolve_weight_format(EngineConfig(weight_format="gguf"), cuda, torch.bfloat16)
