"""Build an engine's model from its config: device, dtype, and dense or GGUF-quantized weights."""

from __future__ import annotations

import torch

from kernels import cpu_kernel, quant_linear
from workers.engine.config import EngineConfig
from workers.model.llama import LlamaModel, Weight
from workers.model.loader import load_state_dict
from workers.model.open_model import open_model
from workers.model.quantized_weights import load_quantized
from workers.model.timing_model import TimingModel
from workers.model.tokenizer import Tokenizer
from workers.protocol.errors import ModelLoadError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}  # dtype, kv_cache_dtype
KV_CACHE_DTYPES = {**DTYPES, "int8": torch.int8}  # int8: kernels/kv_quant.py's rows, on the compiled CPU kernel


def load_model(config: EngineConfig) -> tuple[LlamaModel | TimingModel, Tokenizer]:
    if config.timing_profile is not None:  # no weights: the shape and the tokenizer
        opened = open_model(config.model)
        return TimingModel(opened.config, config.timing_profile), Tokenizer.load(opened.source)
    device, dtype = resolve_device_dtype(config)
    quantized = resolve_weight_format(config, device, dtype) == "gguf"
    opened = open_model(config.model)
    try:
        weights: dict[str, Weight] = dict(load_quantized(opened.source.path)) if quantized else {}
        weights.update(load_state_dict(opened.source, opened.config, skip=frozenset(weights)))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load weights from {opened.source.path}: {e}") from e
    return LlamaModel(opened.config, weights, device, dtype), Tokenizer.load(opened.source)


def resolve_device_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    device = torch.device("cuda" if config.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if config.device == "auto" else config.device))
    if config.dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    if config.dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {config.dtype!r}")
    return device, DTYPES[config.dtype]


def resolve_kv_cache_dtype(config: EngineConfig, model: LlamaModel | TimingModel,
                           attention_backend: str) -> torch.dtype:
    """The KV cache's element type (see ``EngineConfig.kv_cache_dtype``)."""
    compiled_stack = isinstance(model, LlamaModel) and model.decoder_stack is not None
    if config.kv_cache_dtype == "auto":  # int8 where the compiled CPU attention reads it (see EngineConfig)
        return torch.int8 if compiled_stack and attention_backend == "cpu" else model.dtype
    if config.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {sorted(KV_CACHE_DTYPES)}, "
                         f"got {config.kv_cache_dtype!r}")
    want = KV_CACHE_DTYPES[config.kv_cache_dtype]
    if want == torch.int8 and not isinstance(model, TimingModel):
        head_dim = model.config.head_dim
        if attention_backend != "cpu" or model.dtype != torch.float32 or head_dim not in cpu_kernel.HEAD_DIMS:
            raise ValueError(f"kv_cache_dtype int8 is built for the compiled CPU attention only (float32 on CPU, "
                             f"head_dim one of {cpu_kernel.HEAD_DIMS}); this engine has the {attention_backend} "
                             f"backend, {str(model.dtype).removeprefix('torch.')} and head_dim {head_dim}")
        return want
    # The CPU attention kernel reads fp16 rows under fp32 queries; every other path computes in the cache's dtype.
    narrower_ok = attention_backend == "cpu" and model.dtype == torch.float32 and want == torch.float16
    if want != model.dtype and not narrower_ok and not isinstance(model, TimingModel):
        raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype} under {str(model.dtype).removeprefix('torch.')} "
                         "activations is not built: a cache of another dtype than the model's runs only as float16 "
                         "under float32 on the compiled CPU attention (use auto)")
    return want


def resolve_cuda_graphs(config: EngineConfig, model: LlamaModel | TimingModel, attention_backend: str) -> bool:
    """Whether decode steps replay CUDA graphs (see ``EngineConfig.cuda_graphs``)."""
    on_gpu = isinstance(model, LlamaModel) and model.device.type == "cuda"
    if config.cuda_graphs is None:
        return on_gpu and attention_backend == "triton"
    if config.cuda_graphs and not on_gpu:
        where = "a timing model" if isinstance(model, TimingModel) else f"a model on {model.device.type}"
        raise ValueError(f"cuda_graphs: true needs a model on a CUDA device, not {where}")
    if config.cuda_graphs and attention_backend != "triton":
        raise ValueError(f"cuda_graphs: true replays the triton attention backend, not {attention_backend}")
    return config.cuda_graphs


def resolve_weight_format(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> str:
    """"gguf" or "dense" (see ``EngineConfig.weight_format``)."""
    fits = device.type == "cpu" and dtype == torch.float32
    if config.weight_format == "auto":
        return "gguf" if fits and quant_linear.supported() else "dense"
    if config.weight_format == "gguf":
        if not fits:
            raise ValueError(f"weight_format 'gguf' runs on CPU in float32, not {device.type} {dtype}")
        if not quant_linear.supported():
            raise ValueError(f"weight_format 'gguf' needs the compiled CPU kernels: {cpu_kernel.unavailable_reason()}")
        return "gguf"
    if config.weight_format != "dense":
        raise ValueError(f"weight_format must be auto, gguf or dense, got {config.weight_format!r}")
    return "dense"
