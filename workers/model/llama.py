"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Plain tensors, no nn.Module: Q/K/V and gate/up are fused into one matmul each, and logits are
computed only for the rows that sample.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

import kernels
from kernels import kv_quant
from kernels.decoder_stack import DecoderStack
from kernels.fused_ops import add_rms_norm_, rms_norm, rope_, silu_mul
from kernels.huge_pages import huge_page_copies, huge_page_zeros
from kernels.quant_linear import QuantizedWeight, cat_rows, interleave, linear, linear_silu, pair_gate_up
from workers.model.attention_metadata import AttentionMetadata
from workers.model.compute_starts import compute_starts
from workers.model.config import ModelConfig
from workers.model.rope import RotaryEmbedding
from workers.protocol.errors import ModelLoadError

Weight = torch.Tensor | QuantizedWeight  # a matrix: dense in the model's dtype, or a GGUF's blocks


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: Weight  # [(H + 2 KVH) D, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: Weight  # [hidden, H D]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Weight  # [2 I, hidden]: gate's rows then up's, or (gate_up_paired) alternating (pair_gate_up)
    down: Weight  # [hidden, I]
    gate_up_paired: bool = False  # gate_up from pair_gate_up: its SiLU runs inside the matrix (linear_silu)


def stack_rows(parts: list[Weight]) -> Weight:
    """Fuse matrices by output rows; parts of mixed kinds are all dequantized first."""
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return cat_rows(parts)  # type: ignore[arg-type]
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)  # type: ignore[arg-type]
    dtype = next(p.dtype for p in parts if isinstance(p, torch.Tensor))
    return torch.cat([p.dequantize().to(dtype) if isinstance(p, QuantizedWeight) else p for p in parts])


def fast_layout(w: Weight) -> Weight:
    """Q4_1 and Q8_0 blocks interleaved by 8 rows for the kernel (the same numbers); anything else as it is."""
    return interleave(w) if isinstance(w, QuantizedWeight) else w


def gate_up_weight(gate: Weight, up: Weight) -> tuple[Weight, bool]:
    """gate_up for the MLP, and whether it is paired for ``linear_silu`` (quantized weights it takes: no matrix
    output written out and read back for the SiLU), else gate's rows then up's."""
    if isinstance(gate, QuantizedWeight) and isinstance(up, QuantizedWeight):
        paired = pair_gate_up(gate, up)
        if paired is not None:
            return paired, True
    return fast_layout(stack_rows([gate, up])), False


class LlamaModel:
    """Weights come dense, or (CPU only) as ``QuantizedWeight`` for any matrix, the embedding included."""

    def __init__(self, config: ModelConfig, weights: dict[str, Weight], device: torch.device, dtype: torch.dtype):
        self.config = config
        self.device = device
        self.dtype = dtype

        def take(name: str) -> Weight:
            if name not in weights:
                raise ModelLoadError(f"weight {name!r} missing from checkpoint")
            w = weights[name]
            if isinstance(w, QuantizedWeight):
                if device.type != "cpu" or dtype != torch.float32:
                    raise ModelLoadError(f"quantized weights run on CPU in float32, not {device.type} {dtype}")
                return w
            return w.to(device=device, dtype=dtype).contiguous()

        def take_dense(name: str) -> torch.Tensor:
            w = take(name)
            assert isinstance(w, torch.Tensor), f"{name} is a vector: never quantized"
            return w

        embed = take("model.embed_tokens.weight")
        self.norm = take_dense("model.norm.weight")
        self.lm_head = fast_layout(embed if config.tie_word_embeddings else take("lm_head.weight"))
        # A tied embedding shares the head's bytes: its row lookups read the interleaved layout too.
        self.embed = self.lm_head if config.tie_word_embeddings else embed
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            bias = None
            if config.attention_bias:
                bias = torch.cat([take_dense(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            gate_up, paired = gate_up_weight(take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight"))
            self.layers.append(LayerWeights(
                attn_norm=take_dense(p + "input_layernorm.weight"),
                qkv=fast_layout(stack_rows([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])),
                qkv_bias=bias,
                o_proj=fast_layout(take(p + "self_attn.o_proj.weight")),
                mlp_norm=take_dense(p + "post_attention_layernorm.weight"),
                gate_up=gate_up,
                down=fast_layout(take(p + "mlp.down_proj.weight")),
                gate_up_paired=paired,
            ))
        self._quantized_to_huge_pages()
        self.rope = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                    config.rope_scaling, device, dtype)
        self.scale = config.head_dim ** -0.5
        # Decode steps over GGUF blocks run the layer stack in one compiled call; tests and benches may
        # set it to None to compare with the Python loop below.
        self.decoder_stack: DecoderStack | None = DecoderStack.pack(
            self.layers, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)

    def _quantized_to_huge_pages(self) -> None:
        """The GGUF blocks every CPU decode step streams (the layers' matrices and the head) moved into memory
        backed by huge pages, where fewer TLB misses and page-bound prefetcher stops make them quicker to stream
        (kernels/huge_pages.py: batch-8 steps ~5% faster here)."""
        tied = self.embed is self.lm_head
        places: list[tuple[object, str]] = [(layer, name) for layer in self.layers
                                            for name in ("qkv", "o_proj", "gate_up", "down")]
        places += [(self, name) for name in (("lm_head",) if tied else ("lm_head", "embed"))]
        places = [(owner, name) for owner, name in places if isinstance(getattr(owner, name), QuantizedWeight)]
        copies = huge_page_copies([getattr(owner, name).data for owner, name in places])
        for (owner, name), data in zip(places, copies, strict=True):
            setattr(owner, name, replace(getattr(owner, name), data=data))
        if tied:
            self.embed = self.lm_head  # a tied embedding reads the head's bytes

    def new_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One tensor for every layer's K and V: [layers, 2, num_blocks, block_size, KVH, D] (int8: D + 4, each
        head row's scale after its values); dtype: the model's unless given (``resolve_kv_cache_dtype`` says which
        others run)."""
        cfg = self.config
        dtype = dtype or self.dtype
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, kv_quant.head_row(dtype, cfg.head_dim))
        if self.device.type == "cpu":  # a step reads its blocks wherever they lie: fewer TLB misses (huge_pages.py)
            return huge_page_zeros(shape, dtype)
        return torch.zeros(shape, device=self.device, dtype=dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [layers, 2, num_blocks, block_size, KVH, D] (int8: D + 4)
        attn: AttentionMetadata,
        logits_indices: torch.Tensor,  # [N] rows whose next token is sampled
    ) -> torch.Tensor:  # [N, vocab] float32
        cfg = self.config
        num_tokens = input_ids.shape[0]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        h = self._embed(input_ids)
        cos, sin = self.rope.cos_sin(positions)
        eps = cfg.rms_norm_eps
        mlp_out: torch.Tensor | None = None  # each layer's MLP output joins h in the next layer's fused norm
        stack = self.decoder_stack
        if (stack is not None and stack.takes(num_tokens, attn.num_decode_tokens, h, kv_cache)
                and kernels.resolve_backend(h.device, attn.backend) == "cpu"):
            compute_starts()  # (compute_starts.py)
            stack.run_(h, cos, sin, kv_cache, attn.slot_mapping, attn.decode_block_tables, attn.decode_seq_lens,
                       scale=self.scale, eps=eps)
            return self._logits(h, logits_indices)
        compute_starts()
        for i, layer in enumerate(self.layers):
            if mlp_out is None:
                x = rms_norm(h, layer.attn_norm, eps)
            else:
                x = add_rms_norm_(h, mlp_out, layer.attn_norm, eps)
            qkv = linear(x, layer.qkv, layer.qkv_bias)
            # Q and K are adjacent in each row: rotate both heads-sets in one pass.
            qk = qkv[:, : q_size + kv_size].view(num_tokens, -1, cfg.head_dim)
            rope_(qk, cos, sin)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, q_size + kv_size :].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            kernels.store_kv(k, v, k_cache, v_cache, attn.slot_mapping, backend=attn.backend)
            o = self._attention(q, k_cache, v_cache, attn)
            x = add_rms_norm_(h, linear(o.reshape(num_tokens, q_size), layer.o_proj), layer.mlp_norm, eps)
            mlp_out = linear(self._silu_gate_up(x, layer), layer.down)
        if mlp_out is not None:
            h += mlp_out
        return self._logits(h, logits_indices)

    @staticmethod
    def _silu_gate_up(x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:  # [T, hidden] -> [T, I]
        if layer.gate_up_paired:
            assert isinstance(layer.gate_up, QuantizedWeight)
            return linear_silu(x, layer.gate_up)
        return silu_mul(linear(x, layer.gate_up))

    def _logits(self, h: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        h = rms_norm(h[logits_indices], self.norm, self.config.rms_norm_eps)
        return linear(h, self.lm_head).float()

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if isinstance(self.embed, QuantizedWeight):
            return self.embed.rows(input_ids)
        return F.embedding(input_ids, self.embed)

    def _attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   attn: AttentionMetadata) -> torch.Tensor:
        nd = attn.num_decode_tokens
        parts = []
        if nd:
            parts.append(kernels.paged_decode_attention(
                q[:nd], k_cache, v_cache, attn.decode_block_tables, attn.decode_seq_lens,
                scale=self.scale, backend=attn.backend))
        if nd < q.shape[0]:
            parts.append(kernels.paged_prefill_attention(
                q[nd:], k_cache, v_cache, attn.prefill_block_tables, attn.prefill_query_start_loc,
                attn.prefill_seq_lens, scale=self.scale, backend=attn.backend,
                max_query_len=attn.prefill_max_query_len))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
