"""The KV cache's element type (``EngineConfig.kv_cache_dtype``): int8 by default under GGUF weights on CPU
(each head row's values and scale: decode attention reads ~half fp16's bytes), the model's dtype elsewhere,
fp16 or fp32 where asked, and what is not built refused by name."""

from __future__ import annotations

import pytest
import torch

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.protocol.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "List three colours of the rainbow:", "Once upon a time, in a small village,"]


def test_auto_is_int8_under_gguf_weights_and_the_model_dtype_when_dense(make_engine, quantized_model) -> None:
    engine = make_engine()
    assert engine.runner.kv_cache.dtype == torch.int8
    assert "blocks of 16" in engine.kv_cache_description
    dense = make_engine(dense=True)
    assert dense.runner.kv_cache.dtype == torch.float32  # the HF-exact path keeps an fp32 cache
    # Same bytes, twice the tokens: the cache is sized in bytes.
    half = make_engine(num_kv_blocks=None, kv_cache_bytes=64 * 2**20, kv_cache_dtype="float16")
    full = make_engine(num_kv_blocks=None, kv_cache_bytes=64 * 2**20, kv_cache_dtype="float32")
    assert half.block_pool.num_blocks == 2 * full.block_pool.num_blocks
    # int8: a head row of 64 is 64 values and a 4-byte scale, 68 bytes against fp16's 128
    int8 = make_engine(num_kv_blocks=None, kv_cache_bytes=64 * 2**20, kv_cache_dtype="int8")
    assert int8.runner.kv_cache.dtype == torch.int8 and int8.runner.kv_cache.shape[-1] == 64 + 4
    assert int8.block_pool.num_blocks == pytest.approx(half.block_pool.num_blocks * 128 / 68, abs=1)


def test_fp16_cache_keeps_the_quantized_path_as_close_to_the_exact_one(make_engine, quantized_model) -> None:
    """Rounding K and V to fp16 (llama.cpp's default cache type too) moves each token's log probability by
    about as much as the GGUF path's 8-bit activations already do, in other directions: measured against the
    dense fp32 path (token-exact with HF), the quantized path on an fp16 cache is no further off than on an
    fp32 one. Teacher-forced: every engine scores the same texts (prompt + the exact path's continuation)."""
    dense = make_engine(dense=True, enable_prefix_caching=False)
    prompts = [dense.tokenizer.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    texts = [p + r.token_ids for p, r in zip(prompts, dense.generate(prompts, greedy), strict=True)]
    score = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)

    def logprobs(engine: Engine) -> torch.Tensor:
        results = engine.generate(texts, score)
        return torch.tensor([lp for r in results for lp, _ in (r.prompt_logprobs or [])[1:]])

    exact = logprobs(dense)
    off = {}
    for name in ("float16", "float32", "int8"):
        engine = make_engine(kv_cache_dtype=name, enable_prefix_caching=False)
        assert engine.runner.kv_cache.dtype == getattr(torch, name)
        off[name] = (logprobs(engine) - exact).abs()
    assert len(exact) > 200
    # Seen here (median, p90 nats off): fp16 cache 0.018, 0.093; fp32 0.021, 0.106; int8 0.024, 0.108. With the
    # compiled prefill attention (sums in another order: outputs ~1e-7 apart) fp16 0.021, 0.081; fp32 0.016,
    # 0.081; int8 0.018, 0.112: the p90 of these ~250 tokens moves by a few hundredths whenever an 8-bit
    # activation rounds the other way, so it gets that much room. A broken cache is off by nats.
    for name in ("float16", "int8"):
        assert off[name].median() <= 1.25 * off["float32"].median() + 0.005, (name, off)
        assert off[name].quantile(0.9) <= 1.25 * off["float32"].quantile(0.9) + 0.04, (name, off)


@pytest.mark.parametrize("name, message", [
    ("float8", "kv_cache_dtype must be auto or one of"),
    ("bfloat16", "kv_cache_dtype bfloat16 under float32 activations is not built"),
])
def test_what_is_not_built_is_refused_by_name(default_model_and_tokenizer, name: str, message: str) -> None:
    model, tokenizer = default_model_and_tokenizer
    with pytest.raises(ValueError, match=message):
        Engine(EngineConfig(num_kv_blocks=64, kv_cache_dtype=name), model=model, tokenizer=tokenizer)


def test_int8_needs_the_compiled_attention(default_model_and_tokenizer) -> None:
    model, tokenizer = default_model_and_tokenizer
    with pytest.raises(ValueError, match="kv_cache_dtype int8 is built for the compiled CPU attention only"):
        Engine(EngineConfig(num_kv_blocks=64, kv_cache_dtype="int8", attention_backend="torch"), model=model,
               tokenizer=tokenizer)


def test_fp16_under_fp32_needs_the_compiled_attention(default_model_and_tokenizer) -> None:
    model, tokenizer = default_model_and_tokenizer
    with pytest.raises(ValueError, match="only as float16 under float32 on the compiled CPU attention"):
        Engine(EngineConfig(num_kv_blocks=64, kv_cache_dtype="float16", attention_backend="torch"), model=model,
               tokenizer=tokenizer)
    # auto on the torch backend keeps the model's dtype rather than failing
    engine = Engine(EngineConfig(num_kv_blocks=64, attention_backend="torch"), model=model, tokenizer=tokenizer)
    assert engine.runner.kv_cache.dtype == torch.float32
