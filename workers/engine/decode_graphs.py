"""Decode steps replayed from CUDA graphs: one launch for the whole model instead of ~20 a layer.

A step of one token per request costs a GPU little (SmolLM2 at batch 64: ~3 ms of kernels) and the
host a lot: eager, every layer launches its matmuls, norms, RoPE, KV store and attention from Python
(~35 ms a step on an H100 host). As vLLM and SGLang do, the model's forward is captured once per
padded batch size over static input buffers, and a decode step replays the smallest graph that holds
its rows. Rows past the real ones are padding: token 0 at position 0, slot -1 (the KV store skips it),
one token of context read from block 0 (never written); their logits are not returned.

All inputs are int32 and travel in one host-to-device copy a step, from a pinned staging buffer laid
out as the device buffer is (B = largest batch, W = block table width, max_model_len / block_size):

    [ input_ids: B | positions: B | slots: B | seq_lens: B | block tables: B x W ]
      a step of b padded rows copies the first 4 B + b W entries

A step queued before the previous one's tokens are read (``Engine.step``'s follow-on steps) stages, in place
of its input ids, each row's index into the previous step's sampled tokens (or -1 - id, a row that joined
with its own token); a gather on the device puts the tokens in. A pinned buffer is rewritten only once the
last step's copy has left it (an event).

A block table row is written only up to the request's blocks; the kernel reads no further than its
sequence length, so what lies past it (an older step's ids) is never read. A row whose table is what the
staging buffer already holds there (the same request, no new block: nearly every decode step) is not
written again: at batch 64 the rows were ~45 us of a step's host time.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import torch

from kernels.host_math import cdiv
from workers.model.attention_metadata import AttentionMetadata
from workers.model.llama import LlamaModel


def capture_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes to capture, as vLLM picks them: 1, 2, 4, then every 8 up to ``max_batch``."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


class DecodeGraphs:
    """Captured forwards of ``model`` for decode-only steps of up to ``max_batch`` rows.

    ``forward`` returns a view of the graph's own logits buffer: valid until the next ``forward``.
    """

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, *, block_size: int, max_batch: int,
                 max_model_len: int, backend: str):
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.max_batch = b = max_batch
        self.width = cdiv(max_model_len, block_size)
        size = 4 * b + b * self.width
        # Pinned, so the copy is asynchronous (pageable memory would be staged, synchronously, by the driver).
        self._host = torch.zeros(size, dtype=torch.int32, pin_memory=model.device.type == "cuda")
        self._host_np = self._host.numpy()
        self._device = torch.zeros(size, dtype=torch.int32, device=model.device)
        self._host_np[2 * b : 3 * b] = -1  # slots: padding writes nothing
        self._host_np[3 * b : 4 * b] = 1  # seq_lens: padding reads one token
        self._device.copy_(self._host)
        # Recorded after each step's copy: the next step writes the pinned buffer only once it has left (a
        # step may be queued while the one before it still waits on the GPU: Engine.step's follow-on steps).
        self._copied = torch.cuda.Event() if model.device.type == "cuda" else None
        self._staged_tables: list[list[int] | None] = [None] * b  # each row's table as the host buffer holds it
        self._logit_rows = torch.arange(b, device=model.device)
        self.sizes = capture_sizes(max_batch)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    def _inputs(self, b: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The static buffers' first ``b`` rows, as the model's forward takes them."""
        m, dev = self.max_batch, self._device  # m: the layout's row count, as in forward()
        tables = dev[4 * m :].view(m, self.width)
        empty = torch.zeros(0, dtype=torch.int32, device=dev.device)
        attn = AttentionMetadata(
            slot_mapping=dev[2 * m : 2 * m + b], num_decode_tokens=b, decode_block_tables=tables[:b],
            decode_seq_lens=dev[3 * m : 3 * m + b], prefill_block_tables=tables[:0],
            prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=dev.device), prefill_seq_lens=empty,
            backend=self.backend, prefill_max_query_len=0)
        return dev[:b], dev[m : m + b], attn

    def capture(self) -> None:
        """Capture every size, largest first (the smaller ones reuse its memory pool). Each size runs once
        eagerly first, on a side stream: Triton compiles its kernels and cuBLAS picks its own there, not
        while a graph is being recorded."""
        if self.model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.model.device.type}")
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            input_ids, positions, attn = self._inputs(b)
            rows = self._logit_rows[:b]
            side = torch.cuda.Stream(self.model.device)
            side.wait_stream(torch.cuda.current_stream(self.model.device))
            with torch.cuda.stream(side):
                self.model.forward(input_ids, positions, self.kv_cache, attn, rows)
            torch.cuda.current_stream(self.model.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model.forward(input_ids, positions, self.kv_cache, attn, rows)
            self._graphs[b] = (graph, logits)
        torch.cuda.synchronize(self.model.device)
        print(f"[tandem] captured decode CUDA graphs for batch sizes {self.sizes} in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    def padded_size(self, num_rows: int) -> int | None:
        """The captured size that holds ``num_rows``; None past the largest."""
        return next((b for b in self.sizes if b >= num_rows), None)

    def graph(self, num_rows: int) -> torch.cuda.CUDAGraph:
        """The graph a step of ``num_rows`` replays (benchmarks time it alone)."""
        b = self.padded_size(num_rows)
        assert b is not None and b in self._graphs, f"no graph holds {num_rows} rows"
        return self._graphs[b][0]

    def fits(self, num_rows: int, widest_table: int) -> bool:
        return 0 < num_rows <= self.max_batch and widest_table <= self.width and bool(self._graphs)

    def forward(self, input_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
                seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]], *,
                feed: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n, vocab] (float32) of n decode rows; see ``fits`` for what is taken. With ``feed`` (a
        device tensor of token ids: the previous step's samples) an input id >= 0 is an index into it, and the
        tokens are gathered on the device, with no wait for the host to read them; -1 - id stands for id."""
        n = len(input_ids)
        b = self.padded_size(n)
        assert b is not None and self.fits(n, max(len(t) for t in block_tables)), "the caller checks fits()"
        if self._copied is not None:
            self._copied.synchronize()
        m, w, host = self.max_batch, self.width, self._host_np
        for offset, values, pad in ((0, input_ids, 0), (m, positions, 0), (2 * m, slots, -1), (3 * m, seq_lens, 1)):
            host[offset : offset + n] = values
            host[offset + n : offset + b] = pad
        base = 4 * m
        staged = self._staged_tables
        for i, table in enumerate(block_tables):
            if staged[i] != table:
                host[base + i * w : base + i * w + len(table)] = table
                staged[i] = list(table)
        host[base + n * w : base + b * w : w] = 0  # padding rows read block 0
        staged[n:b] = [None] * (b - n)
        end = base + b * w
        self._device[:end].copy_(self._host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if feed is not None:  # padding rows' index 0 reads a real token: they compute nothing kept
            ids = self._device[:b]
            if min(input_ids) >= 0:
                ids.copy_(feed.index_select(0, ids))
            else:  # rows with their own token, staged as -1 - id
                ids.copy_(torch.where(ids >= 0, feed.index_select(0, ids.clamp(min=0)), -1 - ids))
        graph, logits = self._graphs[b]
        graph.replay()
        self.num_replays += 1
        return logits[:n]
