"""Turns a scheduled step into tensors, runs the model over the paged KV cache, samples.

The only place in the engine that touches tensors (scheduler and block pool are plain Python).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import NamedTuple

import torch

import kernels
from kernels.fused_ops import argmax_rows
from workers.engine.decode_graphs import DecodeGraphs
from workers.engine.request import Request
from workers.engine.sampler import draw, sample, top_logprobs
from workers.engine.scheduler import SampledToken, ScheduledChunk, SchedulerOutput
from workers.engine.structured_output import accept
from workers.model.attention_metadata import AttentionMetadata
from workers.model.compute_starts import compute_starts
from workers.model.llama import LlamaModel
from workers.model.timing_model import TimingModel


class LaunchedStep(NamedTuple):
    """A decode step queued on the GPU whose tokens the host has not read yet (``ModelRunner.launch``)."""

    tokens: torch.Tensor  # [rows] int64 on the device, in the scheduler's chunk order
    # Their copy in pinned host memory, and an event recorded after the copy (on a CPU: the tokens, None).
    # ``tokens.tolist()`` would copy on the stream, after whatever was queued since: the next step too.
    host_tokens: torch.Tensor
    copied: torch.cuda.Event | None


class StepInputs(NamedTuple):
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    logit_rows: list[int]  # rows whose logits give the sampled tokens
    prompt_rows: list[int]  # after them: prompt positions whose logits give prompt logprobs
    prompt_spans: list[tuple[Request, int, int]]  # (request, first prompt position, count)


class ModelRunner:
    def __init__(self, model: LlamaModel | TimingModel, num_blocks: int, block_size: int,
                 attention_backend: str | None = None, seed: int = 0, eos_token_id: int | None = None,
                 kv_dtype: torch.dtype | None = None, cuda_graph_batch: int | None = None,
                 max_model_len: int | None = None):
        """``cuda_graph_batch``: capture decode steps of up to that many rows in CUDA graphs (a CUDA
        ``LlamaModel``; ``max_model_len`` sizes their block tables)."""
        self.model = model
        self.eos_token_id = eos_token_id  # held back by min_tokens
        self.device = model.device
        self.block_size = block_size
        # Resolved now: a bad name fails at start, and the CPU kernel is built (once per machine) before
        # the first request rather than during it.
        self.attention_backend = kernels.resolve_backend(self.device, attention_backend)
        # One tensor for all layers: [layers, K/V, blocks, block_size, kv_heads, head_dim].
        self.kv_cache = model.new_kv_cache(num_blocks, block_size, kv_dtype)
        self._rng = random.Random(seed)
        self._generators: dict[str, torch.Generator] = {}
        # A decode-only step's prefill metadata, made once: three fewer tensors from lists a step (~8 us).
        self._no_prefill = (torch.zeros(0, 0, device=self.device, dtype=torch.int32),
                            torch.zeros(1, device=self.device, dtype=torch.int32),
                            torch.zeros(0, device=self.device, dtype=torch.int32))
        self.decode_graphs: DecodeGraphs | None = None
        if cuda_graph_batch is not None:
            assert isinstance(model, LlamaModel) and max_model_len is not None
            self.decode_graphs = DecodeGraphs(model, self.kv_cache, block_size=block_size, max_batch=cuda_graph_batch,
                                              max_model_len=max_model_len, backend=self.attention_backend)
            self.decode_graphs.capture()

    def execute(self, out: SchedulerOutput) -> list[SampledToken | None]:
        """Run one step; returns, per scheduled chunk in order, its sampled token or None."""
        chunks = out.chunks
        order = sorted(range(len(chunks)), key=lambda i: chunks[i].num_new_tokens != 1)  # decodes first
        rows = [chunks[i] for i in order]
        samples = [c.samples for c in rows]
        inputs = self._step_inputs(rows, samples)
        logits = self._forward(rows, inputs, out.is_decode_only)
        logit_rows, prompt_spans = inputs.logit_rows, inputs.prompt_spans
        if prompt_spans:
            _add_prompt_logprobs(logits[len(logit_rows):], prompt_spans)
            logits = logits[: len(logit_rows)]
        sampling = [c.request for c, row_samples in zip(rows, samples, strict=True) if row_samples]
        if all(r.plain_greedy for r in sampling):  # what sample() does for them, without its per-row lists
            token_ids: list[int] = argmax_rows(logits).tolist()
            logprobs: list[float | None] = [None] * len(sampling)
            tops: list[list[tuple[int, float]] | None] = [None] * len(sampling)
        else:
            params = [r.sampling_params for r in sampling]
            token_ids, logprobs = sample(
                logits, params, [self._generator(r) for r in sampling],
                [r.prompt_token_ids for r in sampling], [r.output_token_ids for r in sampling], self.eos_token_id,
                [r.grammar for r in sampling],
            )
            for request, token_id in zip(sampling, token_ids, strict=True):
                accept(request.grammar, token_id)
            tops = top_logprobs(logits, params)
        results: list[SampledToken | None] = [None] * len(chunks)
        sampled = iter(zip(token_ids, logprobs, tops, strict=True))
        for i, row_samples in zip(order, samples, strict=True):
            if row_samples:
                results[i] = SampledToken(*next(sampled))
        return results

    def can_launch(self, out: SchedulerOutput) -> bool:
        """Whether ``launch`` takes the step: decode rows only, replayed from a captured graph, sampled by
        argmax alone (``Request.plain_greedy``): nothing the host must do between the forward and the token."""
        graphs = self.decode_graphs
        chunks = out.chunks
        return (graphs is not None and bool(chunks) and out.is_decode_only
                and all(c.request.plain_greedy and c.samples for c in chunks)
                and graphs.fits(len(chunks), max(len(c.block_ids) for c in chunks)))

    def launch(self, out: SchedulerOutput, fed_by: LaunchedStep | None = None) -> LaunchedStep:
        """Queue a step that ``can_launch`` took (forward and argmax) and return without waiting for it; the
        host reads its tokens with ``collect``. On a GPU the host is free meanwhile.

        A step planned by ``Scheduler.schedule_follow_on`` takes its input tokens from ``fed_by``, the step
        before it, on the device: such a row's position is one past what its request has computed (the
        previous step's token is not in the request yet); a row that joined since brings its own token."""
        graphs = self.decode_graphs
        assert graphs is not None
        rows = out.chunks  # decode rows only, each sampled: already in the order the graph takes them
        feed = None
        if out.fed_from is None:
            inputs = self._step_inputs(rows, [True] * len(rows))
            input_ids, positions, slots = inputs.input_ids, inputs.positions, inputs.slots
        else:
            assert fed_by is not None, "a follow-on step needs the step it follows"
            feed, bs = fed_by.tokens, self.block_size
            input_ids, positions = [], []
            for chunk, row in zip(rows, out.fed_from, strict=True):
                computed = chunk.request.num_computed_tokens
                if row >= 0:  # the last step's token, one past what the request holds
                    input_ids.append(row)
                    positions.append(computed + 1)
                else:  # joined since: its own next token, staged as -1 - id (DecodeGraphs.forward)
                    input_ids.append(-1 - chunk.request.token_ids[computed])
                    positions.append(computed)
            slots = [c.block_ids[p // bs] * bs + p % bs for c, p in zip(rows, positions, strict=True)]
        compute_starts()  # (workers/model/compute_starts.py)
        logits = graphs.forward(input_ids, positions, slots, [p + 1 for p in positions], [c.block_ids for c in rows],
                                feed=feed)
        tokens = argmax_rows(logits)  # queued behind the replay, before the next one reuses its logits
        if not tokens.is_cuda:
            return LaunchedStep(tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)  # (torch caches pinned blocks)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return LaunchedStep(tokens, host, copied)

    @staticmethod
    def collect(step: LaunchedStep) -> list[SampledToken | None]:
        """The tokens of a launched step, per chunk (waits for the GPU to finish that step, not later ones)."""
        if step.copied is not None:
            step.copied.synchronize()
        return [SampledToken(t, None) for t in step.host_tokens.tolist()]

    def _step_inputs(self, rows: Sequence[ScheduledChunk], samples: Sequence[bool]) -> StepInputs:
        """The model's inputs for ``rows`` (decodes first), and where their logits are read."""
        inputs = StepInputs([], [], [], [], [], [])
        input_ids, positions, slots = inputs.input_ids, inputs.positions, inputs.slots
        bs = self.block_size
        for chunk, row_samples in zip(rows, samples, strict=True):
            req, n, table = chunk.request, chunk.num_new_tokens, chunk.block_ids
            start = req.num_computed_tokens
            if n == 1:  # a decode row (most rows, every step): no ranges or slices
                input_ids.append(req.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(req.token_ids[start : start + n])
                pos = range(start, start + n)
                positions.extend(pos)
                slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if row_samples:
                inputs.logit_rows.append(len(input_ids) - 1)
            if req.needs_prompt_logits:  # position p's logits give prompt token p + 1's log probability
                lo, hi = max(start, len(req.prompt_logprobs)), min(start + n, req.num_prompt_tokens - 1)
                if hi > lo:
                    inputs.prompt_spans.append((req, lo, hi - lo))
                    first_row = len(input_ids) - n + lo - start
                    inputs.prompt_rows.extend(range(first_row, first_row + hi - lo))
        return inputs

    def _forward(self, rows: Sequence[ScheduledChunk], inputs: StepInputs, is_decode_only: bool) -> torch.Tensor:
        """Logits of ``logit_rows`` then ``prompt_rows``: a captured CUDA graph where one holds the step, else
        the model launched eagerly."""
        dev = self.device
        graphs = self.decode_graphs
        if (graphs is not None and is_decode_only and not inputs.prompt_rows
                and graphs.fits(len(rows), max(len(c.block_ids) for c in rows))):
            compute_starts()  # (workers/model/compute_starts.py)
            logits = graphs.forward(inputs.input_ids, inputs.positions, inputs.slots,
                                    [p + 1 for p in inputs.positions], [c.block_ids for c in rows])
            if len(inputs.logit_rows) < len(rows):  # a one-token prompt chunk that does not reach its end
                logits = logits[torch.tensor(inputs.logit_rows, device=dev, dtype=torch.long)]
            return logits
        return self.model.forward(
            torch.tensor(inputs.input_ids, device=dev), torch.tensor(inputs.positions, device=dev), self.kv_cache,
            self._attention_metadata(rows, inputs.slots),
            torch.tensor(inputs.logit_rows + inputs.prompt_rows, device=dev, dtype=torch.long),
        )

    def _attention_metadata(self, rows: Sequence[ScheduledChunk], slots: list[int]) -> AttentionMetadata:
        dev = self.device
        num_decodes = sum(1 for c in rows if c.num_new_tokens == 1)
        seq_lens = [c.request.num_computed_tokens + c.num_new_tokens for c in rows]
        q_lens = [c.num_new_tokens for c in rows[num_decodes:]]
        if q_lens:
            qsl = [0]
            for n in q_lens:
                qsl.append(qsl[-1] + n)
            prefill = (_pad_tables([c.block_ids for c in rows[num_decodes:]], dev),
                       torch.tensor(qsl, device=dev, dtype=torch.int32),
                       torch.tensor(seq_lens[num_decodes:], device=dev, dtype=torch.int32))
        else:
            prefill = self._no_prefill
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev, dtype=torch.long),
            num_decode_tokens=num_decodes,
            decode_block_tables=_pad_tables([c.block_ids for c in rows[:num_decodes]], dev),
            decode_seq_lens=torch.tensor(seq_lens[:num_decodes], device=dev, dtype=torch.int32),
            prefill_block_tables=prefill[0],
            prefill_query_start_loc=prefill[1],
            prefill_seq_lens=prefill[2],
            backend=self.attention_backend,
            prefill_max_query_len=max(q_lens, default=0),
        )

    def _generator(self, request: Request) -> torch.Generator | None:
        params = request.sampling_params
        if params.is_greedy:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[request.request_id] = gen
        return gen

    def skip_sample(self, request: Request) -> None:
        """Advance a sampled request's generator past one draw made elsewhere (its first token)."""
        gen = self._generator(request)
        if gen is not None:
            draw(gen, self.device)

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator (a preempted one keeps it: its stream continues)."""
        self._generators.pop(request_id, None)


def _add_prompt_logprobs(logits: torch.Tensor, spans: Sequence[tuple[Request, int, int]]) -> None:
    """Each span's prompt tokens' log probabilities (the model's own log-softmax) and alternatives."""
    row = 0
    for request, first, count in spans:
        k = request.sampling_params.prompt_logprobs or 0
        log_probs = torch.log_softmax(logits[row : row + count], dim=-1)
        targets = torch.tensor(request.prompt_token_ids[first + 1 : first + 1 + count], device=logits.device)
        chosen = log_probs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in chosen]
        if k:
            values, ids = log_probs.topk(k, dim=-1)
            tops = [list(zip(t, v, strict=True)) for t, v in zip(ids.tolist(), values.tolist(), strict=True)]
        request.prompt_logprobs.extend(zip(chosen, tops, strict=True))
        row += count


def _pad_tables(tables: Sequence[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, device=device, dtype=torch.int32).view(len(tables), width)
