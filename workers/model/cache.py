"""Convert a GGUF model once into an HF-style directory, so later starts load in about a second.

Parsing the GGUF, dequantizing it and converting its tokenizer takes ~20 s on a small CPU; the
converted directory (config.json, model.safetensors, tokenizer files) loads through the plain HF
path; ``quantized.safetensors`` beside it keeps the GGUF's quantized blocks for the quantized path.
The cache key is the file's path, size and mtime; the directory is written to a temporary name and
renamed, so a crash never leaves a half-converted model behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from kernels.cache_dir import cache_root
from workers.model.config import ModelConfig
from workers.model.loader import ModelSource, load_model_config, load_state_dict
from workers.model.quantized_weights import read_gguf_quantized, save_quantized

_HF_ARCH_NAMES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_FORMAT_VERSION = "2"  # 2: quantized.safetensors beside the dequantized weights


def prepared_source(source: ModelSource) -> ModelSource:
    """An HF-directory source for ``source``: itself if it already is one, else the cached conversion."""
    if source.kind == "hf":
        return source
    stat = source.path.stat()
    key = hashlib.sha256(f"{_FORMAT_VERSION}:{source.path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    target = cache_root() / "models" / f"{source.path.stem}-{key.hexdigest()[:16]}"
    if not (target / "config.json").is_file():
        _convert(source, target)
    return ModelSource("hf", target)


def _convert(source: ModelSource, target: Path) -> None:
    from safetensors.torch import save_file

    from workers.model.tokenizer import Tokenizer

    config = load_model_config(source)
    weights = load_state_dict(source, config)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
        save_quantized(read_gguf_quantized(source.path, config), tmp)
        (tmp / "config.json").write_text(json.dumps(hf_config_dict(config), indent=1))
        Tokenizer.load(source).hf.save_pretrained(str(tmp))
        os.replace(tmp, target)
    except OSError:
        if (target / "config.json").is_file():  # another process converted it first
            shutil.rmtree(tmp, ignore_errors=True)
            return
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def hf_config_dict(config: ModelConfig) -> dict[str, object]:
    """``config`` in HF's config.json vocabulary (what ``ModelConfig.from_hf_config`` reads)."""
    return {
        "architectures": [_HF_ARCH_NAMES[config.architecture]],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "torch_dtype": "float32",
    }
