"""Knobs of one engine (one prefill or decode worker). ``cluster/config.py`` composes these."""

from __future__ import annotations

from dataclasses import dataclass

from workers.protocol.timing_profile import TimingProfile

# A step's token budget where none is set. On CPU a prompt token costs ~1 ms of two cores (SmolLM2-135M), so
# 8,192 tokens made steps of several seconds: a burst of prompts was prefilled in one step, none got its first
# token before the last did, and every running stream stalled for the whole step. 1,024 keeps a step near a
# second: prompts finish first come first served, decodes run between the chunks. Served closed loop on 2 cores
# (12 clients, prompts 200-500 tokens; 2026-11-27): the burst's first tokens 6.5 s each against 1.6-5.9 s in
# turn, a stream's longest stall 6.1 s against 1.2 s, 81% within TTFT 2 s / TPOT 100 ms against 77%, the same
# tokens/s; Poisson arrivals at 1 req/s alike either way. In one process (tests/bench/bench_step_budget.py) the
# burst also drains sooner (4.3 against 5.1 s: a step of ~4,200 prompt tokens runs slower a token). 512 serves a
# burst a little sooner still, but costs closed-loop tokens/s (175-186 against 182-199) for its extra steps. A GPU
# prefills 8,192 tokens in tens of ms.
DEFAULT_STEP_TOKENS = {"cpu": 1024, "cuda": 8192}


def default_step_tokens(device_type: str) -> int:
    """``max_num_batched_tokens`` where the config leaves it None, for a ``torch.device``'s type."""
    return DEFAULT_STEP_TOKENS.get(device_type, DEFAULT_STEP_TOKENS["cpu"])


@dataclass
class EngineConfig:
    # GGUF file or HF directory (config.json + safetensors); None: the bundled SmolLM2-135M.
    model: str | None = None
    # "auto": float32 on CPU, bfloat16 on CUDA.
    dtype: str = "auto"
    # A GGUF model's matrices: "gguf" keeps its Q4_1/Q8_0 blocks and multiplies them with the compiled
    # CPU kernel (a decode step reads ~96 MB of SmolLM2 instead of ~540 MB), "dense" dequantizes them to
    # `dtype` (the path that is token-exact against HF); "auto": "gguf" on CPU in float32 where the
    # kernel builds, else "dense". A model without quantized tensors (an HF directory) is always dense.
    weight_format: str = "auto"
    # Element type of the KV cache: "float32", "float16", "bfloat16" or "int8" (each head row's values and
    # their scale, kernels/kv_quant.py); "auto": int8 where decode runs the compiled CPU layer stack over GGUF
    # blocks (that path rounds activations to 8 bits already, so it is not token-exact with HF either way;
    # served on 2 cores, int8 against float16: TPOT p50 36 against 56 ms at 1.2 req/s), else `dtype` (the
    # dense path stays token-exact). A cache narrower than `dtype` runs only there (fp16 or int8 under fp32).
    kv_cache_dtype: str = "auto"
    # "auto": CUDA when available, else CPU.
    device: str = "auto"
    # None: the model's maximum positions.
    max_model_len: int | None = None
    block_size: int = 16
    # KV pool size: a block count wins over bytes, bytes over the memory share below.
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    # Share of the memory free at start (host memory on CPU, GPU memory after the weights on CUDA) that
    # the KV cache takes when no size is given; None: 0.1 on CPU (workers share the host), 0.8 on CUDA.
    kv_cache_memory_fraction: float | None = None
    max_num_seqs: int = 64
    # Token budget of one engine step (decodes + prefill chunks); None: ``default_step_tokens`` of the device.
    max_num_batched_tokens: int | None = None
    # Most prompt tokens one request may prefill in one step (chunked prefill); None: no cap.
    prefill_chunk_size: int | None = 512
    enable_prefix_caching: bool = True
    # Serving bounds (a cluster's pools set them; None: unbounded, as offline ``generate`` wants):
    # requests waiting for admission (KV blocks, a batch slot) beyond which a new one is shed, and the
    # seconds a request may wait for admission before it is shed.
    max_queue_len: int | None = None
    max_queue_time_s: float | None = None
    # Decode-only steps replayed from CUDA graphs captured at padded batch sizes up to max_num_seqs (one
    # launch a step instead of ~20 a layer; workers/engine/decode_graphs.py). None: on for a CUDA model with
    # the triton backend; true elsewhere is an error; false: every step launched eagerly.
    cuda_graphs: bool | None = None
    # Attention backend for kernels.dispatch: None picks Triton on CUDA, torch elsewhere.
    attention_backend: str | None = None
    # Seed of the generator used by requests that bring none.
    seed: int = 0
    # A timing-model worker (``tandem serve --sim``): no weights, every step takes the time this profile
    # predicts (workers/model/timing_model.py); the tokenizer and model shape still come from ``model``.
    timing_profile: TimingProfile | None = None
