"""The engine on a CUDA GPU (Triton attention and KV stores throughout) against HF transformers on the
same GPU. Skipped where there is no CUDA device.

The model has SmolLM2-135M's shapes (30 layers, 9 query heads over 3 KV heads, head_dim 64) with
random weights, saved as an HF directory with a word-level tokenizer built in code, so the test needs
no files and no hub (``tests.tiny_model.save_random_hf_model``).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.tiny_model import save_random_hf_model, smollm2_shaped_hf_config
from tests.workers.test_decode_graphs import assert_same_outputs, shrinking_batch
from tests.workers.test_engine_vs_hf import full_prefill_logits
from tests.workers.test_launched_steps import hand_off_while_decoding, record_launches
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.protocol.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NUM_NEW = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("smollm2-shaped")
    save_random_hf_model(path, smollm2_shaped_hf_config())
    return path


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).cuda().eval()


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    shared = [rng.randrange(100, 40000) for _ in range(300)]
    lengths = [5, 16, 17, 100, 700]
    # the last two share a 300-token prefix: the second one hits the prefix cache
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths] + [shared + [7, 8, 9], shared + [10]]


def hf_greedy(hf_model, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW,
                                do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_fp32_greedy_tokens_equal_hf_on_the_gpu(model_dir, hf_model, prompts, cuda_graphs):
    """Batched, chunked (64-token chunks) and with a prefix-cache hit: token for token HF's, with decode
    steps replayed from CUDA graphs (padded to captured sizes) and launched eagerly."""
    torch.backends.cuda.matmul.allow_tf32 = False
    engine = Engine(EngineConfig(model=str(model_dir), device="cuda", dtype="float32", num_kv_blocks=512,
                                 prefill_chunk_size=64, max_num_seqs=16, cuda_graphs=cuda_graphs))
    assert engine.runner.attention_backend == "triton"
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
    got = [r.token_ids for r in engine.generate(prompts, params)]
    assert got == [hf_greedy(hf_model, p) for p in prompts]
    assert engine.block_pool.check_integrity()
    graphs = engine.runner.decode_graphs
    assert (graphs is not None and graphs.num_replays >= NUM_NEW // 2) if cuda_graphs else graphs is None
    hit = engine.generate([prompts[-1]], params)[0].token_ids  # now all of it is cached but the last block
    assert hit == got[-1]


def test_bf16_logits_track_fp32_hf(model_dir, hf_model, prompts):
    """The production dtype: bf16 prefill logits stay close to HF's fp32 ones and agree on the argmax."""
    engine = Engine(EngineConfig(model=str(model_dir), num_kv_blocks=64))
    assert engine.model.dtype == torch.bfloat16 and engine.model.device.type == "cuda"
    assert engine.scheduler.token_budget == 8192  # the CUDA default (a CPU engine's is 1,024)
    ids = prompts[4]  # 700 tokens
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids], device="cuda")).logits[0].float()
    got = full_prefill_logits(engine.model, ids).float()
    spread = expected.std().item()
    assert (got - expected).abs().mean().item() < 0.05 * spread
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


def test_graph_steps_give_eager_logprobs_as_the_batch_shrinks(model_dir):
    """Requests finish one by one, so decode batches pass through captured sizes and between them; sampled
    requests draw the same numbers."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts, params = shrinking_batch(3, 90, 4)
    results = {}
    for graphs in (True, False):
        engine = Engine(EngineConfig(model=str(model_dir), device="cuda", dtype="float32", num_kv_blocks=256,
                                     max_num_seqs=16, cuda_graphs=graphs))
        results[graphs] = engine.generate(prompts, params)
    assert engine.runner.decode_graphs is None
    assert_same_outputs(results[True], results[False])


def test_decode_graph_buffers_pad_past_the_real_rows(model_dir):
    """Padding rows write no KV (slot -1) and read one token of block 0; a table as wide as max_model_len
    fits, a wider one and more rows than captured do not."""
    engine = Engine(EngineConfig(model=str(model_dir), device="cuda", num_kv_blocks=64, max_num_seqs=8,
                                 max_model_len=256))
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    assert graphs.fits(8, 16) and not graphs.fits(9, 1) and not graphs.fits(1, 17)
    before = engine.runner.kv_cache.clone()
    logits = graphs.forward([5, 6, 7], [0, 0, 0], [-1, -1, -1], [1, 1, 1], [[3], [4], [5]])
    assert logits.shape == (3, engine.model.config.vocab_size) and torch.isfinite(logits).all()
    assert torch.equal(engine.runner.kv_cache, before)  # every slot -1: nothing written
    lens = graphs._device[3 * 8 : 4 * 8].tolist()
    assert lens == [1, 1, 1, 1, 1, 1, 1, 1]


def test_follow_on_graph_steps_give_eager_tokens_with_early_stops(model_dir):
    """Plain greedy rows, so decode steps are queued behind the step before them, fed its tokens on the GPU
    (``Engine.step``). Requests ending by a stop id, a stop string and max_tokens, each at its own step, give
    the eager engine's tokens, text and finish reasons."""
    torch.backends.cuda.matmul.allow_tf32 = False
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 120))] for _ in range(12)]
    plain = [SamplingParams(max_tokens=8 + 3 * i, temperature=0, ignore_eos=True) for i in range(12)]

    def engine(graphs: bool) -> Engine:
        return Engine(EngineConfig(model=str(model_dir), device="cuda", dtype="float32", num_kv_blocks=256,
                                   max_num_seqs=16, cuda_graphs=graphs))

    eager = engine(False)
    free = eager.generate(prompts, plain)
    text = free[2].text
    stop_text = next(text[i : i + 3] for i in range(len(text) // 2, len(text) - 2) if text[i : i + 3].strip())
    params = list(plain)
    params[1] = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[free[1].token_ids[4]])
    params[2] = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop_text])
    expected = eager.generate(prompts, params)
    graphed = engine(True)
    fed = record_launches(graphed, lambda out: out.fed_from is not None)
    got = graphed.generate(prompts, params)
    assert sum(fed) >= 20, "decode steps followed on from the step before them"
    assert got[1].finish_reason == got[2].finish_reason == "stop" and len(got[1].token_ids) < 40
    for a, b in zip(got, expected, strict=True):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert graphed.block_pool.num_used_blocks == 0 and graphed.block_pool.check_integrity()


def test_requests_committed_to_a_graphed_decode_engine_join_follow_on_steps(model_dir):
    """Disaggregated on the GPU: requests prefilled by one engine and committed to a decode engine while its
    graph steps run join a follow-on step with their own first token; every request's tokens are an eager
    single engine's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    rng = random.Random(6)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(20, 90))] for _ in range(4)]
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True) for _ in prompts]

    def engine(graphs: bool) -> Engine:
        return Engine(EngineConfig(model=str(model_dir), device="cuda", dtype="float32", num_kv_blocks=256,
                                   max_num_seqs=8, cuda_graphs=graphs))

    expected = [r.token_ids for r in engine(False).generate(prompts, params)]
    decode = engine(True)
    got, joined_rows = hand_off_while_decoding(engine(False), decode, prompts, params)
    assert got == expected
    assert sum(1 for n in joined_rows if n) >= 3, "the later requests joined follow-on steps"
    assert decode.block_pool.num_used_blocks == 0
