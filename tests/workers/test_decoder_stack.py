"""The compiled layer stack (kernels/csrc/decoder_cpu.cpp) against the model's Python loop: the same ops
in the same order, so a decode step's logits and the KV it writes must be bit-identical; on the default
model's GGUF blocks and on a tiny model with Q/K/V biases (Qwen2's) and a Q8_0 matrix among Q4_1 ones."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quantize

from kernels import cpu_kernel, kv_quant
from kernels.batch_split import BatchSplitChooser
from kernels.decoder_stack import FORMAT_CODES, PAIRED_GATE_UP
from kernels.quant_linear import QuantizedWeight
from tests.threads import torch_threads
from tests.tiny_model import random_weights, tiny_config
from workers.model import llama
from workers.model.attention_metadata import AttentionMetadata
from workers.model.config import ModelConfig
from workers.model.llama import LlamaModel

BLOCK = 16
SEQ_LENS = [5, 17, 40]  # tokens in cache, the new one included: one, two and three blocks


@pytest.fixture(scope="module", autouse=True)
def kernel_built() -> None:
    if not cpu_kernel.available():
        pytest.skip(f"the CPU kernels cannot be built here: {cpu_kernel.unavailable_reason()}")


def quantized_tiny_model(num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32) -> LlamaModel:
    """Two layers, head_dim 32 unless given (blocks of 32 need hidden % 32 == 0), biases on Q/K/V; every matrix
    Q4_1 but layer 1's down projection, Q8_0."""
    cfg = dataclasses.replace(tiny_config(vocab_size=512, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                          head_dim=head_dim), architecture="qwen2", attention_bias=True)
    weights: dict[str, torch.Tensor | QuantizedWeight] = dict(random_weights(cfg, seed=3))
    g = torch.Generator().manual_seed(4)
    for name, w in list(weights.items()):
        if name.endswith("proj.weight"):
            fmt = "q8_0" if name == "model.layers.1.mlp.down_proj.weight" else "q4_1"
            kind = GGMLQuantizationType.Q8_0 if fmt == "q8_0" else GGMLQuantizationType.Q4_1
            blocks = np.array(quantize(w.numpy(), kind))
            weights[name] = QuantizedWeight(fmt, torch.from_numpy(blocks), w.shape[1])
    for i in range(cfg.num_layers):
        for n, size in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
            weights[f"model.layers.{i}.self_attn.{n}_proj.bias"] = torch.randn(size * cfg.head_dim, generator=g)
    return LlamaModel(cfg, weights, torch.device("cpu"), torch.float32)  # type: ignore[arg-type]


def decode_step(model: LlamaModel, kv: torch.Tensor, seed: int, seq_lens: list[int]) -> torch.Tensor:
    """One decode-only step of len(seq_lens) sequences over ``kv`` (written in place); their logits."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(seq_lens) // BLOCK + 1
    tables = torch.arange(len(seq_lens) * max_blocks, dtype=torch.int32).view(len(seq_lens), max_blocks)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    positions = lens.long() - 1
    slots = tables[torch.arange(len(seq_lens)), positions // BLOCK].long() * BLOCK + positions % BLOCK
    empty = torch.zeros(0, 1, dtype=torch.int32)
    md = AttentionMetadata(slot_mapping=slots, num_decode_tokens=len(seq_lens), decode_block_tables=tables,
                           decode_seq_lens=lens, prefill_block_tables=empty,
                           prefill_query_start_loc=torch.zeros(1, dtype=torch.int32), prefill_seq_lens=empty[:, 0],
                           backend="cpu")
    ids = torch.randint(0, model.config.vocab_size, (len(seq_lens),), generator=g)
    return model.forward(ids, positions, kv, md, torch.arange(len(seq_lens)))


class Always(BatchSplitChooser):
    """Every step one way: the batch split among the threads, or not."""

    def __init__(self, split: bool):
        super().__init__()
        self.way = split

    def split(self, batch: int, threads: int) -> bool:
        return self.way


def assert_stack_matches_loop(model: LlamaModel, kv_dtype: torch.dtype = torch.float32,
                              seq_lens: list[int] = SEQ_LENS, split: bool | None = None) -> None:
    """``split``: the stack's step run that way (None: the way it has learned)."""
    cfg = model.config
    stack = model.decoder_stack
    assert stack is not None, "quantized fp32 weights on CPU must take the compiled stack"
    if split is not None:
        model.decoder_stack = dataclasses.replace(stack, ways=Always(split))
    max_blocks = max(seq_lens) // BLOCK + 1
    kv = torch.randn(cfg.num_layers, 2, len(seq_lens) * max_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim,
                     generator=torch.Generator().manual_seed(1))
    kv = kv_quant.quantize_rows(kv) if kv_dtype == torch.int8 else kv.to(kv_dtype)
    kv_loop = kv.clone()
    try:
        got = decode_step(model, kv, seed=2, seq_lens=seq_lens)
        model.decoder_stack = None
        want = decode_step(model, kv_loop, seed=2, seq_lens=seq_lens)
    finally:
        model.decoder_stack = stack
    assert torch.isfinite(want).all() and want.std() > 0
    assert torch.equal(got, want), f"max |diff| {(got - want).abs().max().item()}"
    assert torch.equal(kv, kv_loop), "the stack wrote other K/V than the loop"


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.int8])
def test_default_model_stack_is_bit_identical(quantized_model, kv_dtype: torch.dtype) -> None:
    assert_stack_matches_loop(quantized_model, kv_dtype)


def test_biases_and_mixed_formats_are_bit_identical() -> None:
    assert_stack_matches_loop(quantized_tiny_model())


def test_gate_up_paired_or_not_gives_the_same_bits(monkeypatch) -> None:
    """A quantized gate_up is paired where it can be (its gate and up rows alternating, the SiLU inside the matrix:
    kernels/quant_linear.py pair_gate_up); unpaired, the stack runs the matrix then silu_mul. Either way the stack
    gives the loop's bits, and the two models the same logits."""
    paired = quantized_tiny_model()
    assert all(layer.gate_up_paired for layer in paired.layers)
    monkeypatch.setattr(llama, "pair_gate_up", lambda gate, up: None)
    plain = quantized_tiny_model()
    assert not any(layer.gate_up_paired for layer in plain.layers)
    assert_stack_matches_loop(plain)
    cfg = plain.config
    kv = torch.randn(cfg.num_layers, 2, 3 * (max(SEQ_LENS) // BLOCK + 1), BLOCK, cfg.num_kv_heads, cfg.head_dim,
                     generator=torch.Generator().manual_seed(1))
    assert torch.equal(decode_step(paired, kv.clone(), 2, SEQ_LENS), decode_step(plain, kv.clone(), 2, SEQ_LENS))


def test_only_gate_up_takes_the_paired_code(quantized_model) -> None:
    layer = quantized_model.layers[0]
    weights = [layer.attn_norm, layer.qkv.data, torch.empty(0), layer.o_proj.data, layer.mlp_norm,
               layer.gate_up.data, layer.down.data]
    codes = [FORMAT_CODES[w.format] for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    torch.classes.tandem_cpu.DecoderWeights(weights, [codes[0], codes[1], codes[2] + PAIRED_GATE_UP, codes[3]])
    with pytest.raises(RuntimeError, match="only gate_up's, in an x8 or x8p format, takes alternating gate and up"):
        torch.classes.tandem_cpu.DecoderWeights(weights, [codes[0] + PAIRED_GATE_UP, *codes[1:]])


@pytest.mark.parametrize("threads", [2, 3])
def test_heads_cut_between_threads_are_bit_identical(threads: int) -> None:
    """The threads that compute qkv add its bias, rotate and store the heads wholly in their own rows; a head cut
    between two threads' rows is the leader's. QKV of 7 heads of 64 rows in 56 groups of 8, split 4 groups at a
    time: on 2 and on 3 threads a head is cut (without the leader's pass over cut heads both runs fail: checked)."""
    model = quantized_tiny_model(num_heads=5, num_kv_heads=1, head_dim=64)
    with torch_threads(threads):
        for kv_dtype in (torch.float32, torch.float16, torch.int8):
            assert_stack_matches_loop(model, kv_dtype)


def test_a_batch_of_nine_on_two_and_three_threads_is_bit_identical(quantized_model) -> None:
    """Nine sequences (more than the team's threads share evenly in the attention), an int8 cache, 2 and 3
    threads: the step's thread team splits its loops as the Python loop's calls do, so the bits agree."""
    for n in (2, 3):
        with torch_threads(n):
            assert_stack_matches_loop(quantized_model, torch.int8, seq_lens=[1, 5, 16, 17, 33, 40, 2, 9, 25])


@pytest.mark.parametrize("threads", [2, 3])
def test_a_batch_split_among_the_threads_is_bit_identical(quantized_model, threads: int) -> None:
    """Each thread its own rows through every layer (decode_layers_'s parts): 3 and 9 sequences, every cache
    dtype, rows cut unevenly (9 on 2 threads); the same logits and K/V as the loop, so as the team's way."""
    with torch_threads(threads):
        for kv_dtype in (torch.float32, torch.float16, torch.int8):
            assert_stack_matches_loop(quantized_model, kv_dtype, split=True)
        assert_stack_matches_loop(quantized_model, torch.int8, seq_lens=[1, 5, 16, 17, 33, 40, 2, 9, 25], split=True)
    with torch_threads(2):
        assert_stack_matches_loop(quantized_tiny_model(), split=True)  # biases, a Q8_0 matrix
        assert_stack_matches_loop(quantized_model, seq_lens=[7], split=True)  # one row: nothing to split


def blank_step(cfg: ModelConfig, rows: int = 1, layers: int | None = None) -> dict[str, torch.Tensor]:
    """run_'s tensors for ``rows`` sequences of one token each (row i in block i) over a zero cache of ``layers``
    (default the model's): for calls that must fail, or whose values nobody reads."""
    ids = torch.arange(rows, dtype=torch.int32)
    cos = torch.ones(rows, cfg.head_dim)
    return {"h": torch.zeros(rows, cfg.hidden_size), "cos": cos, "sin": cos,
            "kv_cache": torch.zeros(layers or cfg.num_layers, 2, rows, BLOCK, cfg.num_kv_heads, cfg.head_dim),
            "slot_mapping": (ids * BLOCK).long(), "block_tables": ids[:, None], "seq_lens": ids + 1}


def test_an_error_inside_a_split_step_leaves_the_stack_working(quantized_model) -> None:
    """A check failing on each thread of a split batch raises once, by name, and the next step runs."""
    stack = quantized_model.decoder_stack
    cfg = quantized_model.config
    wrong = dataclasses.replace(stack, num_heads=cfg.num_heads + cfg.num_kv_heads)
    with torch_threads(2), pytest.raises(RuntimeError, match="layer 0: qkv has"):
        wrong.run_(**blank_step(cfg, rows=2), scale=1.0, eps=1e-5, split=True)
    with torch_threads(2):
        assert_stack_matches_loop(quantized_model, split=True)


def test_dense_weights_keep_the_python_loop(dense_model) -> None:
    assert dense_model.decoder_stack is None  # the HF-exact path stays as it is


def test_the_stack_refuses_a_malformed_call(quantized_model) -> None:
    stack = quantized_model.decoder_stack
    assert stack is not None
    cfg = quantized_model.config
    with pytest.raises(RuntimeError, match="one layer per 7 weights"):
        stack.run_(**blank_step(cfg, layers=cfg.num_layers - 1), scale=1.0, eps=1e-5)  # one layer short


def test_the_stack_refuses_an_empty_batch(quantized_model) -> None:
    """No rows: a message, not a crash (a batch of 0 once divided by zero splitting the work: SIGFPE)."""
    stack = quantized_model.decoder_stack
    cfg = quantized_model.config
    kv = torch.zeros(cfg.num_layers, 2, 1, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    none = torch.zeros(0, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="B > 0"):
        stack.run_(torch.zeros(0, cfg.hidden_size), torch.ones(0, cfg.head_dim), torch.ones(0, cfg.head_dim), kv,
                   none.long(), none[:, None], none, scale=1.0, eps=1e-5)


def test_an_error_inside_the_step_leaves_the_stack_working(quantized_model) -> None:
    """A check that fails mid-step (layer 0's QKV rows against too many heads) raises from inside the step's
    thread team (kernels/csrc/thread_team.h); the team's threads are released and the next step runs."""
    stack = quantized_model.decoder_stack
    cfg = quantized_model.config
    wrong = dataclasses.replace(stack, num_heads=cfg.num_heads + cfg.num_kv_heads)
    with pytest.raises(RuntimeError, match="layer 0: qkv has"):
        wrong.run_(**blank_step(cfg), scale=1.0, eps=1e-5)
    assert_stack_matches_loop(quantized_model)


def test_a_step_through_a_freed_stacks_number_is_refused(quantized_model) -> None:
    """The step passes the packed weights' number; once nothing holds them, the number finds nothing (refused by
    name, never read), and a live stack's number stays its own."""
    stack = quantized_model.decoder_stack
    cfg = quantized_model.config
    copy = type(stack).pack(quantized_model.layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                            head_dim=cfg.head_dim)
    assert copy is not None and copy.handle != stack.handle and copy.packed.handle() == copy.handle
    freed = dataclasses.replace(copy, packed=None)
    del copy
    with pytest.raises(RuntimeError, match=f"no packed decoder stack numbered {freed.handle} "):
        freed.run_(**blank_step(cfg), scale=1.0, eps=1e-5)
    assert_stack_matches_loop(quantized_model)


def test_the_phase_clock_books_every_phase_and_changes_no_bits(quantized_model) -> None:
    """set_stack_phase_timing (bench_step_phases.py): while on, each of a layer's phases gets time and the step's
    outputs stay the loop's; read with reset, it starts again from zero; off, it books nothing."""
    ops = torch.ops.tandem_cpu
    was = ops.set_stack_phase_timing(True)
    try:
        ops.stack_phase_seconds(True)
        assert_stack_matches_loop(quantized_model)
        phases = ops.stack_phase_seconds(True)
        assert list(phases) == ["attn_norm", "qkv", "attention", "o_proj", "mlp_norm", "gate_up", "silu", "down"]
        assert all(seconds > 0 for seconds in phases.values()), phases
        assert not any(ops.stack_phase_seconds(False).values())
        with torch_threads(2):  # a split batch: its first thread's phases
            assert_stack_matches_loop(quantized_model, split=True)
        assert all(seconds > 0 for seconds in ops.stack_phase_seconds(True).values())
        ops.set_stack_phase_timing(False)
        assert_stack_matches_loop(quantized_model)
        assert not any(ops.stack_phase_seconds(False).values())
    finally:
        ops.set_stack_phase_timing(was)
