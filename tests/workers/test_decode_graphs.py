"""``DecodeGraphs``' buffers and padding on CPU: its graphs replaced by eager forwards over the same static
buffers (what a replay computes), so the staging, padding and size choice are tested without a GPU
(``test_engine_cuda.py`` replays real graphs). Triton attention runs in the interpreter here, where a test reads
the buffers through it; whole engine runs use the compiled CPU attention (CPU_ATTENTION)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import cpu_kernel
from tests.tiny_model import tiny_model
from workers.engine.config import EngineConfig
from workers.engine.decode_graphs import DecodeGraphs, capture_sizes
from workers.engine.engine import CompletionResult, Engine
from workers.protocol.sampling_params import SamplingParams

# Whole engine runs attend with the compiled CPU kernel; where it does not build, with Triton's interpreter (slow),
# not torch's path: over it, padded steps gave other greedy tokens than eager ones (TANDEM_CPU_KERNEL=0).
CPU_ATTENTION = "cpu" if cpu_kernel.available() else "triton"


class _Replay:
    """Stands for a captured graph: replay runs the same forward over the same buffers into the same logits."""

    def __init__(self, run):
        self.run = run
        with torch.inference_mode():
            self.logits = run()

    def replay(self) -> None:
        with torch.inference_mode():
            self.logits.copy_(self.run())


class EagerDecodeGraphs(DecodeGraphs):
    def capture(self) -> None:
        for b in self.sizes:
            input_ids, positions, attn = self._inputs(b)
            rows = self._logit_rows[:b]
            fake = _Replay(lambda i=input_ids, p=positions, a=attn, r=rows: self.model.forward(
                i, p, self.kv_cache, a, r))
            self._graphs[b] = (fake, fake.logits)  # type: ignore[assignment]


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_capture_needs_a_cuda_device():
    model = tiny_model()
    graphs = DecodeGraphs(model, model.new_kv_cache(8, 16), block_size=16, max_batch=4, max_model_len=64,
                          backend="triton")
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, not cpu"):
        graphs.capture()


def shrinking_batch(seed: int, longest_prompt: int, first_max_tokens: int, vocab: int = 40000,
                    ) -> tuple[list[list[int]], list[SamplingParams]]:
    """13 requests that finish one by one (max_tokens 2 apart), greedy and seeded-sampled alternating, with
    logprobs: their decode steps pass through captured sizes and between them (13 padded to 16, 12, ... 1)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(3, longest_prompt))] for _ in range(13)]
    params = [SamplingParams(max_tokens=first_max_tokens + 2 * i, temperature=0 if i % 2 else 0.8, seed=i,
                             ignore_eos=True, logprobs=1) for i in range(13)]
    return prompts, params


def assert_same_outputs(got: list[CompletionResult], expected: list[CompletionResult]) -> None:
    for a, b in zip(got, expected, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


def test_padded_steps_give_eager_tokens_as_the_batch_shrinks(default_model_and_tokenizer):
    """Each padded step is written into the buffers over what the last one left there (longer tables,
    stale rows). The compiled CPU attention reads them (the interpreted Triton kernels took ~1 minute here); the
    Triton kernels' reading of padding is the test below."""
    model = tiny_model(seed=3, max_positions=512)
    tokenizer = default_model_and_tokenizer[1]
    prompts, params = shrinking_batch(4, 70, 3)
    results = {}
    for padded in (True, False):
        engine = Engine(EngineConfig(num_kv_blocks=200, max_num_seqs=16, attention_backend=CPU_ATTENTION,
                                     prefill_chunk_size=32), model=model, tokenizer=tokenizer)
        if padded:
            graphs = EagerDecodeGraphs(model, engine.runner.kv_cache, block_size=16, max_batch=16, max_model_len=512,
                                       backend=CPU_ATTENTION)
            graphs.capture()
            engine.runner.decode_graphs = graphs
        results[padded] = engine.generate(prompts, params)
    assert graphs.num_replays >= 20
    assert_same_outputs(results[True], results[False])


def test_padding_rows_write_nothing_and_the_copy_covers_the_used_rows():
    model = tiny_model(seed=1)
    kv_cache = model.new_kv_cache(16, 16)
    graphs = EagerDecodeGraphs(model, kv_cache, block_size=16, max_batch=8, max_model_len=128, backend="triton")
    graphs.capture()
    assert graphs.width == 8 and graphs.padded_size(3) == 4 and graphs.padded_size(9) is None
    assert graphs.fits(8, 8) and not graphs.fits(9, 1) and not graphs.fits(1, 9) and not graphs.fits(0, 1)
    logits = graphs.forward([5, 6, 7], [20, 3, 0], [5 * 16 + 4, 2 * 16 + 3, 9 * 16], [21, 4, 1],
                            [[1, 5], [2], [9]])
    assert logits.shape == (3, model.config.vocab_size) and torch.isfinite(logits).all()
    written = kv_cache[:, 0].abs().sum(dim=(0, 3, 4)) > 0  # [blocks, rows]: rows any layer's K was written to
    assert written.nonzero().tolist() == [[2, 3], [5, 4], [9, 0]]  # the three real slots, nothing for padding
    buf, m = graphs._device, 8
    assert buf[3 * m : 3 * m + 4].tolist() == [21, 4, 1, 1]  # the padding row reads one token
    assert buf[2 * m : 2 * m + 4].tolist()[3] == -1
    assert buf[4 * m : 4 * m + 2].tolist() == [1, 5] and buf[4 * m + 3 * 8].item() == 0


def test_block_table_rows_are_rewritten_only_where_they_changed():
    """Rows whose table the staging buffer already holds are skipped; a row that passes to another request,
    grows a block, or was padding in between (its first entry zeroed) is written again."""
    model = tiny_model(seed=1)
    graphs = EagerDecodeGraphs(model, model.new_kv_cache(16, 16), block_size=16, max_batch=4, max_model_len=128,
                               backend="triton")
    graphs.capture()
    m, w = 4, graphs.width

    def step(tables: list[list[int]]) -> list[list[int]]:
        n = len(tables)
        positions = [16 * len(t) - 1 for t in tables]
        graphs.forward([5] * n, positions, [-1] * n, [p + 1 for p in positions], tables)
        rows = graphs._device[4 * m :].view(m, w).tolist()
        return [row[: len(t)] for row, t in zip(rows, tables, strict=False)]

    assert step([[3, 4], [5], [8], [9]]) == [[3, 4], [5], [8], [9]]
    assert step([[3, 4], [5], [8], [9]]) == [[3, 4], [5], [8], [9]]  # unchanged: skipped, and still there
    # One grew a block; row 1 passed to another request.
    assert step([[3, 4, 6], [7], [8], [9]]) == [[3, 4, 6], [7], [8], [9]]
    assert step([[3, 4, 6], [7], [8]]) == [[3, 4, 6], [7], [8]]  # 3 rows run as 4: row 3 is padding
    assert graphs._device[4 * m + 3 * w].item() == 0  # it reads block 0
    assert step([[3, 4, 6], [7], [8], [9]])[3] == [9]  # written anew over the padding's 0
