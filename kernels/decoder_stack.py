"""A decode step's whole layer stack in one compiled call (``kernels/csrc/decoder_cpu.cpp``).

    stack = DecoderStack.pack(layers, num_heads=9, num_kv_heads=3, head_dim=64)   # None if it can't run
    stack.run_(h, cos, sin, kv_cache, slot_mapping, block_tables, seq_lens, scale=..., eps=...)

The same ops as the model's Python loop, in the same order, so the output is bit-identical; what it
saves is the interpreter between them (~4-5 ms a step on a 2-core CPU at batch 1, a third of the step).
It takes decode-only steps, fp32 on CPU, every matrix a GGUF block weight; anything else stays on the
Python loop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from kernels import cpu_kernel
from kernels.batch_split import BatchSplitChooser
from kernels.quant_linear import QuantizedWeight

# As decoder_cpu.cpp reads them; gate_up's plus PAIRED_GATE_UP where its gate and up rows alternate (pair_gate_up).
FORMAT_CODES = {"q4_1": 0, "q8_0": 1, "q4_1x8": 2, "q8_0x8": 3, "q4_1x8p": 4, "q8_0x8p": 5}
PAIRED_GATE_UP = 8


class LayerTensors(Protocol):
    """One decoder layer's weights, as the model holds them (``workers.model.llama.LayerWeights``)."""

    attn_norm: Tensor
    qkv: Tensor | QuantizedWeight
    qkv_bias: Tensor | None
    o_proj: Tensor | QuantizedWeight
    mlp_norm: Tensor
    gate_up: Tensor | QuantizedWeight
    down: Tensor | QuantizedWeight
    gate_up_paired: bool


@dataclass(frozen=True)
class DecoderStack:
    packed: torch.ScriptObject  # decoder_cpu.cpp's DecoderWeights: 7 tensors and 4 format codes a layer
    num_heads: int
    num_kv_heads: int
    # What the step passes: packed's number, while this holds packed (converting the object costs ~30 us a call).
    handle: int
    # How the threads share each batch size's steps, learned as they run (kernels/batch_split.py).
    ways: BatchSplitChooser = field(default_factory=BatchSplitChooser, compare=False)

    @staticmethod
    def pack(layers: Sequence[LayerTensors], *, num_heads: int, num_kv_heads: int,
             head_dim: int) -> DecoderStack | None:
        """The stack ready for the compiled call, or None where it can't take these weights or heads."""
        if not layers or not cpu_kernel.available():
            return None
        if head_dim not in cpu_kernel.HEAD_DIMS or num_heads // num_kv_heads > cpu_kernel.MAX_HEADS_PER_KV:
            return None
        weights: list[Tensor] = []
        formats: list[int] = []
        for layer in layers:
            matrices = [m for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
                        if isinstance(m, QuantizedWeight)]
            if len(matrices) < 4:
                return None  # dense weights keep the Python loop (and its HF-exact path)
            qkv, o_proj, gate_up, down = (m.data for m in matrices)
            bias = layer.qkv_bias if layer.qkv_bias is not None else torch.empty(0)
            weights += [layer.attn_norm, qkv, bias, o_proj, layer.mlp_norm, gate_up, down]
            codes = [FORMAT_CODES[m.format] for m in matrices]
            codes[2] += PAIRED_GATE_UP if layer.gate_up_paired else 0
            formats += codes
        packed = torch.classes.tandem_cpu.DecoderWeights(weights, formats)
        return DecoderStack(packed, num_heads, num_kv_heads, packed.handle())

    def takes(self, num_tokens: int, num_decode_tokens: int, h: Tensor, kv_cache: Tensor) -> bool:
        """Whether this step is one the compiled stack runs: decode only, fp32 on CPU (an fp32 or fp16 cache)."""
        return (num_decode_tokens == num_tokens and h.dtype == torch.float32
                and kv_cache.dtype in cpu_kernel.CACHE_DTYPES and h.device.type == "cpu"
                and kv_cache.device.type == "cpu")

    def run_(self, h: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, slot_mapping: Tensor, block_tables: Tensor,
             seq_lens: Tensor, *, scale: float, eps: float, split: bool | None = None) -> None:
        """h [B, hidden] becomes the residual stream after the last layer (the final norm is the caller's).
        ``split``: the batch's rows split among the threads (True) or every matrix's (False); None: the way
        ``ways`` has learned is faster for this batch size (the same bits either way)."""
        batch, threads = h.shape[0], torch.get_num_threads()
        learn = split is None
        if split is None:
            split = self.ways.split(batch, threads)
        t0 = time.perf_counter()
        torch.ops.tandem_cpu.decode_layers_.default(h, self.handle, cos, sin, kv_cache, slot_mapping,
                                                    block_tables, seq_lens, self.num_heads, self.num_kv_heads, scale,
                                                    eps, threads if split else 1)
        if learn:
            self.ways.record(batch, split, time.perf_counter() - t0)
