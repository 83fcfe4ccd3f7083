"""Architecture parameters of a Llama-family decoder, read from HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.protocol.errors import ModelLoadError

# HF architectures (config.json "architectures") and GGUF "general.architecture" values we run.
SUPPORTED_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_GGUF_ARCHITECTURES = {"llama", "mistral", "qwen2"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0) -> int:
        """K and V, every layer: 2 x layers x kv_heads x (head_dim x dtype bytes + scale bytes), where an int8
        cache's head row carries its scale (``kernels.kv_quant``)."""
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * dtype_bytes + scale_bytes)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        known = [SUPPORTED_HF_ARCHITECTURES[a] for a in archs if a in SUPPORTED_HF_ARCHITECTURES]
        if not known:
            raise ModelLoadError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_HF_ARCHITECTURES)}"
            )
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        # transformers >= 5 writes "rope_parameters" (theta + scaling); older files "rope_theta" + "rope_scaling".
        rope_params = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = rope_params
        return cls(
            architecture=known[0],
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rope_theta=float(cfg.get("rope_theta") or rope_params.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama may through attention_bias.
            attention_bias=known[0] == "qwen2" or bool(cfg.get("attention_bias", False)),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any], has_output_weight: bool) -> ModelConfig:
        arch = fields.get("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported GGUF architecture {arch!r}; supported: {sorted(SUPPORTED_GGUF_ARCHITECTURES)}"
            )

        def get(key: str, default: Any = None) -> Any:
            return fields.get(f"{arch}.{key}", default)

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        vocab = get("vocab_size") or len(fields.get("tokenizer.ggml.tokens", ()))
        scaling = None
        if get("rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        return cls(
            architecture=str(arch),
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=int(get("attention.key_length", hidden // num_heads)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length", 2048)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            tie_word_embeddings=not has_output_weight,
            attention_bias=arch == "qwen2",
            rope_scaling=scaling,
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
        )
