"""A GGUF's quantized tensors kept as their blocks, by HF name, beside the dequantized conversion.

The model cache (``cache.py``) writes them once as ``quantized.safetensors``: uint8 tensors of the
GGUF's blocks row by row, with each tensor's format in the file's metadata. Q and K rows are
un-permuted as whole rows of blocks (llama.cpp's RoPE interleave permutes rows, never columns), so
the quantized weights line up with the dequantized ones exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kernels.quant_linear import BLOCK_BYTES, QuantizedWeight
from workers.model.config import ModelConfig
from workers.model.loader import QUANTIZED_FILE_NAME as FILE_NAME
from workers.model.loader import gguf_reader, hf_name, hf_row_order

_GGUF_FORMATS = {"Q4_1": "q4_1", "Q8_0": "q8_0"}  # GGML type name -> our format


def read_gguf_quantized(path: Path, config: ModelConfig) -> dict[str, tuple[str, torch.Tensor]]:
    """Every tensor of a supported quantized format: HF name -> (format, [N, row_bytes] uint8)."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for tensor in gguf_reader(path).tensors:
        name, fmt = hf_name(tensor.name), _GGUF_FORMATS.get(tensor.tensor_type.name)
        if name is None or fmt is None:
            continue
        data = hf_row_order(name, np.asarray(tensor.data, dtype=np.uint8), config)  # [N, K / 32 * block_bytes]
        out[name] = (fmt, torch.from_numpy(np.array(data)))
    return out


def save_quantized(tensors: dict[str, tuple[str, torch.Tensor]], directory: Path) -> None:
    from safetensors.torch import save_file

    save_file({name: data.contiguous() for name, (_, data) in tensors.items()}, str(directory / FILE_NAME),
              metadata={name: fmt for name, (fmt, _) in tensors.items()})


def load_quantized(directory: Path) -> dict[str, QuantizedWeight]:
    """The quantized weights saved beside a converted model; empty when it has none (an HF model)."""
    path = directory / FILE_NAME
    if not path.is_file():
        return {}
    from safetensors import safe_open

    out: dict[str, QuantizedWeight] = {}
    with safe_open(str(path), framework="pt") as f:
        formats = f.metadata() or {}
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            data = f.get_tensor(name)
            in_features = data.shape[1] // BLOCK_BYTES[formats[name]] * 32
            out[name] = QuantizedWeight(formats[name], data, in_features)
    return out
