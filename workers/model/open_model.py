"""The one recipe for a model path: resolve it, convert a GGUF once into the cache, read its config.

    model = open_model(None)                    # the bundled SmolLM2-135M
    Tokenizer.load(model.source); model.config.num_layers; model.name
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from workers.model.cache import prepared_source
from workers.model.config import ModelConfig
from workers.model.loader import ModelSource, load_model_config, resolve_model_source


class OpenedModel(NamedTuple):
    source: ModelSource  # an HF directory (a GGUF's cached conversion): weights, config, tokenizer
    name: str  # what clients call it by default: a GGUF's stem or the directory's name
    config: ModelConfig


def open_model(path: str | Path | None) -> OpenedModel:
    """``path``: a GGUF file, an HF directory, or None for the bundled default model."""
    original = resolve_model_source(path)
    name = original.path.name.split(".")[0] if original.kind == "gguf" else original.path.name
    source = prepared_source(original)
    return OpenedModel(source, name, load_model_config(source))
