"""Llama (with llama3 RoPE scaling), Mistral and Qwen2 (QKV bias) from HF directories (safetensors),
each compared with HF transformers' own implementation of the same random weights."""

from __future__ import annotations

import pytest
import torch

from tests.workers.test_engine_vs_hf import full_prefill_logits
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.protocol.sampling_params import SamplingParams

COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2)


def hf_configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    return {
        "llama-rope-llama3": LlamaConfig(**COMMON, tie_word_embeddings=False, rope_theta=50000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
        "mistral": MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=True, use_sliding_window=False),
    }


@pytest.mark.parametrize("arch", ["llama-rope-llama3", "mistral", "qwen2"])
def test_hf_directory_model_matches_hf(arch, tmp_path, default_model_and_tokenizer):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(hf_configs()[arch], dtype=torch.float32).eval()
    if arch == "qwen2":  # biases start at zero; make them matter
        for layer in hf_model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    hf_model.save_pretrained(tmp_path)
    default_model_and_tokenizer[1].hf.save_pretrained(tmp_path)

    engine = Engine(EngineConfig(model=str(tmp_path), num_kv_blocks=64))
    ids = [1] + list(range(300, 400))  # past original_max_position_embeddings, so llama3 scaling matters
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids])).logits[0]
        hf_greedy = hf_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    assert (full_prefill_logits(engine.model, ids) - expected).abs().max().item() < 1e-4
    got = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0))[0].token_ids
    assert got == hf_greedy[: len(got)] and len(got) >= 1
