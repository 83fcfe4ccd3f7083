"""Acceptance: greedy outputs equal HF transformers' token for token, in every scheduling mode.

HF runs the same GGUF file in fp32 (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``).
"""

from __future__ import annotations

import pytest
import torch

from kernels.host_math import cdiv
from tests.workers.conftest import NUM_NEW
from workers.model.attention_metadata import AttentionMetadata
from workers.protocol.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0)

pytestmark = pytest.mark.slow


def test_prompts_span_5_to_1500_tokens(prompt_ids):
    lengths = sorted(len(ids) for ids in prompt_ids)
    assert len(lengths) >= 8 and lengths[0] <= 8 and lengths[-1] >= 1400, lengths


def test_tokenization_and_chat_template_match_hf(hf_reference, prompts, prompt_ids):
    _, hf_tok = hf_reference
    for prompt, ids in zip(prompts, prompt_ids, strict=True):
        if isinstance(prompt, dict):
            text = hf_tok.apply_chat_template(prompt["messages"], tokenize=False, add_generation_prompt=True)
            expected = hf_tok.encode(text, add_special_tokens=False)
        else:
            expected = hf_tok.encode(prompt)
        assert ids == expected


def test_prefill_logits_match_hf(hf_reference, make_engine, prompt_ids):
    hf_model, _ = hf_reference
    model = make_engine(dense=True).model
    for ids in prompt_ids[:7:2]:
        with torch.inference_mode():
            expected = hf_model(torch.tensor([ids])).logits[0]
        got = full_prefill_logits(model, ids)
        assert (got - expected).abs().max().item() < 1e-3


def test_one_at_a_time(make_engine, prompt_ids, hf_outputs):
    engine = make_engine(dense=True)
    for ids, expected in zip(prompt_ids, hf_outputs, strict=True):
        assert engine.generate([ids], GREEDY)[0].token_ids == expected


def test_continuous_batch_with_staggered_arrivals(make_engine, prompt_ids, hf_outputs):
    engine = make_engine(dense=True, max_num_batched_tokens=2048)
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompt_ids))
    step = 0
    while pending or engine.has_unfinished:
        if pending and step % 2 == 0:  # a new arrival every other step, while others decode
            i, ids = pending.pop(0)
            got[engine.add_request(ids, GREEDY, request_id=str(i))] = []
        for out in engine.step().outputs:
            got[out.request_id].extend(out.new_token_ids)
        step += 1
    assert [got[str(i)] for i in range(len(prompt_ids))] == hf_outputs
    assert engine.block_pool.num_used_blocks == 0


def test_chunked_prefill_at_64_tokens(make_engine, prompt_ids, hf_outputs):
    engine = make_engine(dense=True, prefill_chunk_size=64)
    results = engine.generate(prompt_ids, GREEDY)
    assert [r.token_ids for r in results] == hf_outputs


def test_after_prefix_cache_filled(make_engine, prompt_ids, hf_outputs):
    engine = make_engine(dense=True)
    engine.generate(prompt_ids, GREEDY)  # fills the prefix cache
    ids = [engine.add_request(p, GREEDY) for p in prompt_ids]
    got = {rid: [] for rid in ids}
    cached = {}
    while engine.has_unfinished:
        for out in engine.step().outputs:
            got[out.request_id].extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
    assert [got[r] for r in ids] == hf_outputs
    # every prompt of at least two blocks found its full blocks cached
    for rid, p in zip(ids, prompt_ids, strict=True):
        assert cached[rid] == ((len(p) - 1) // 16) * 16


def full_prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prompt prefilled into a fresh paged cache (on the model's device)."""
    cfg, n, bs, dev = model.config, len(ids), 16, model.device
    num_blocks = cdiv(n, bs)
    kv = torch.zeros(cfg.num_layers, 2, num_blocks, bs, cfg.num_kv_heads, cfg.head_dim, device=dev, dtype=model.dtype)
    empty = torch.zeros(0, 1, dtype=torch.int32, device=dev)
    md = AttentionMetadata(
        slot_mapping=torch.arange(n, device=dev),
        num_decode_tokens=0, decode_block_tables=empty, decode_seq_lens=empty[:, 0],
        prefill_block_tables=torch.arange(num_blocks, dtype=torch.int32, device=dev)[None],
        prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        prefill_seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
    )
    positions = torch.arange(n, device=dev)
    return model.forward(torch.tensor(ids, device=dev), positions, kv, md, positions)
