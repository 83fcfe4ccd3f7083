"""Small random-weight Llama models built in code (no files), for fast engine and kernel tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from workers.model.config import ModelConfig
from workers.model.llama import LlamaModel


def tiny_config(vocab_size: int = 49152, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                num_layers: int = 2, max_positions: int = 2048) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=vocab_size, hidden_size=num_heads * head_dim,
        intermediate_size=2 * num_heads * head_dim, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rope_theta=10000.0,
        max_position_embeddings=max_positions, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )


def random_weights(cfg: ModelConfig, seed: int = 0, std: float = 0.5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std / shape[-1] ** 0.5

    # Untied: tied random embeddings would just predict the input token again. An lm_head of
    # std 2/sqrt(hidden) gives logits of std ~2: peaked, but not one-hot.
    out = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, hidden, generator=g),
           "lm_head.weight": torch.randn(cfg.vocab_size, hidden, generator=g) * 2 / hidden**0.5,
           "model.norm.weight": torch.ones(hidden)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": w(q, hidden), p + "self_attn.k_proj.weight": w(kv, hidden),
            p + "self_attn.v_proj.weight": w(kv, hidden), p + "self_attn.o_proj.weight": w(hidden, q),
            p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        }
    return out


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu", **cfg_knobs: int) -> LlamaModel:
    cfg = tiny_config(**cfg_knobs)
    return LlamaModel(cfg, random_weights(cfg, seed), torch.device(device), dtype)


def save_word_tokenizer(directory: str | Path, vocab_size: int) -> None:
    """A word-level HF tokenizer (token i is the word ``w<i>``) for random-weight model directories
    on machines without the bundled model's tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2").save_pretrained(
        str(directory))


def smollm2_shaped_hf_config(num_layers: int = 30) -> Any:
    """SmolLM2-135M's shapes (9 query heads over 3 KV heads, head_dim 64), with an untied head."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=num_layers,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                       rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=False, bos_token_id=1,
                       eos_token_id=2)


def save_random_hf_model(directory: str | Path, hf_config: Any, seed: int = 0) -> None:
    """An HF directory (safetensors + word-level tokenizer) of random weights drawn as ``random_weights``
    draws them: HF's own small init with a tied head just predicts the last token again."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "embed" in name:
                weight.normal_(0.0, 1.0)
            elif weight.dim() == 2:  # projections std 0.5/sqrt(fan_in); the head gives logits of std ~2
                weight.normal_(0.0, (2.0 if "lm_head" in name else 0.5) / weight.shape[1] ** 0.5)
    model.save_pretrained(str(directory))
    save_word_tokenizer(directory, hf_config.vocab_size)
