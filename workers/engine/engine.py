"""The engine: add requests, step (schedule, run, postprocess), abort. One per worker.

    engine = Engine(EngineConfig())
    rid = engine.add_request(prompt="Hello", sampling_params=SamplingParams(max_tokens=8))
    while engine.has_unfinished:
        for out in engine.step().outputs: print(out.new_text, end="")
"""

from __future__ import annotations

import gc
import itertools
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import kernels
from kernels import kv_quant
from kernels.host_math import cdiv
from workers.engine import kv_sizing
from workers.engine.block_pool import BlockPool
from workers.engine.config import EngineConfig, default_step_tokens
from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.kv_sizing import kv_cache_size
from workers.engine.model_loading import load_model, resolve_cuda_graphs, resolve_kv_cache_dtype
from workers.engine.model_runner import LaunchedStep, ModelRunner
from workers.engine.request import Request, RequestStatus
from workers.engine.scheduler import KVReservation, SampledToken, Scheduler, SchedulerOutput
from workers.engine.structured_output import StructuredOutputs, accept
from workers.model.llama import LlamaModel
from workers.model.timing_model import TimingModel
from workers.model.tokenizer import Tokenizer
from workers.protocol.errors import CapacityError, InvalidRequestError, QueueFullError
from workers.protocol.kv_events import KVEvent
from workers.protocol.sampling_params import SamplingParams, check_fits

PromptInput = str | Sequence[int] | dict[str, Any]


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[float]
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # On the first output of a request that asked for them: prompt token i + 1's log probability and the
    # likeliest alternatives there.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    queue_seconds: float | None = None  # on a request's first output: its wait for admission


@dataclass(frozen=True)
class StepResult:
    """What one ``Engine.step`` did: everything a caller needs, so nothing is left to read afterwards."""

    outputs: list[RequestOutput]
    # remote_prefill requests whose prompt blocks were reserved (decode worker: ask a prefill worker now).
    reservations: list[KVReservation]
    # Requests shed after waiting past max_queue_time_s, each with its wait in seconds (they are gone).
    shed: list[tuple[str, float]]
    # Seconds each request admitted for the first time this step had waited in the queue.
    queue_seconds: list[float]
    # Changes to the prefix cache since the previous step (also those made between steps: commits, aborts).
    kv_events: list[KVEvent]
    num_tokens: int  # tokens the model ran; 0: nothing was run
    is_decode_only: bool  # every scheduled request ran one token (no prompt chunk)


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_awaiting_kv: int
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions_by_cause: dict[str, int]
    prefix_hit_tokens_total: int
    prefill_tokens_total: int
    prefix_query_tokens_total: int = 0


@dataclass
class CompletionResult:
    """A whole finished request, from ``Engine.generate``."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, model: LlamaModel | TimingModel | None = None,
                 tokenizer: Tokenizer | None = None):
        """Load the configured model, or take an already built ``model`` and ``tokenizer`` (tests)."""
        self.config = config = config or EngineConfig()
        if model is None or tokenizer is None:
            model, tokenizer = load_model(config)
        self.model, self.tokenizer = model, tokenizer
        mcfg = model.config
        self.max_model_len = config.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"{mcfg.max_position_embeddings} positions")
        backend = kernels.resolve_backend(model.device, config.attention_backend)
        kv_dtype = resolve_kv_cache_dtype(config, model, backend)
        scale_bytes = kv_quant.SCALE_BYTES if kv_dtype == kv_quant.INT8 else 0
        bytes_per_block = mcfg.kv_bytes_per_token(kv_dtype.itemsize, scale_bytes) * config.block_size
        size = kv_cache_size(config, bytes_per_block, model.device)
        self.kv_cache_description = kv_sizing.describe(size, config.block_size, bytes_per_block)
        print(f"[tandem] {self.kv_cache_description}", file=sys.stderr, flush=True)
        num_blocks = size.num_blocks
        self.block_pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv_cache_manager = KVCacheManager(self.block_pool)
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else mcfg.eos_token_id
        budget = config.max_num_batched_tokens
        if budget is None:  # a timing model steps as the profiled machine would
            profile = config.timing_profile
            budget = default_step_tokens(profile.device_type if profile is not None else model.device.type)
        self.scheduler = Scheduler(config, self.kv_cache_manager, self.max_model_len, eos, budget)
        graph_batch = config.max_num_seqs if resolve_cuda_graphs(config, model, backend) else None
        self.runner = ModelRunner(model, num_blocks, config.block_size, backend, config.seed, eos, kv_dtype,
                                  cuda_graph_batch=graph_batch, max_model_len=self.max_model_len)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        # A launched step whose tokens the host has not read yet, and its schedule (``step``).
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        self.structured_outputs = StructuredOutputs(self.tokenizer.hf, model.config.vocab_size)
        self._ids = itertools.count()
        # torch + transformers leave ~350K tracked objects; a full GC pass over them stalls a step
        # by ~0.45 s on this CPU. Freezing them (as vLLM does) keeps later collections short.
        gc.collect()
        gc.freeze()

    # ---- requests ----
    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._in_flight is not None

    def tokenize(self, prompt: PromptInput) -> list[int]:
        """Token ids of a raw prompt (text or ids) or of ``{"messages": [...]}`` / ``{"prompt": ...}``."""
        if isinstance(prompt, dict):
            if "messages" in prompt:
                return self.tokenizer.apply_chat_template(prompt["messages"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise InvalidRequestError("an input needs 'prompt' or 'messages'")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(self, prompt: PromptInput, sampling_params: SamplingParams | None = None, *,
                    request_id: str | None = None, cache_salt: str | None = None,
                    prefill_only: bool = False, remote_prefill: bool = False,
                    resume_token_ids: Sequence[int] = ()) -> str:
        """Queue a request; returns its id.

        ``prefill_only`` (prefill worker): compute the prompt, sample the first token, finish, and hold
        the blocks until ``release_held`` (their KV is being sent). ``remote_prefill`` (decode worker):
        reserve blocks for the prompt (a step reports them in ``StepResult.reservations``), then wait for
        ``commit_remote_kv``. ``resume_token_ids``: output another worker already produced (it died
        mid-stream); the request goes on after them as a preempted one does, its text, stop strings,
        penalties, grammar and seeded random stream where they were, and its outputs give only new tokens.
        """
        params = sampling_params or SamplingParams()
        if params.prompt_logprobs is not None and (prefill_only or remote_prefill):
            raise InvalidRequestError("prompt_logprobs are computed where the request decodes, with its prompt: "
                                      "not on a prefill worker")
        if resume_token_ids and (prefill_only or remote_prefill or len(resume_token_ids) >= params.max_tokens):
            raise InvalidRequestError("a resumed request decodes here, with fewer tokens done than max_tokens")
        if prefill_only:  # one token, whatever the stop rules: the decode worker applies them
            # (min_tokens still holds EOS and the stop ids back from that token, as the sampler reads them)
            params = replace(params, max_tokens=1, stop=[], min_tokens=min(params.min_tokens, 1))
        token_ids = self.tokenize(prompt)
        self._check_fits(token_ids, params)
        num_waiting = len(self.scheduler.waiting)
        if self.config.max_queue_len is not None and num_waiting >= self.config.max_queue_len:
            raise QueueFullError(f"{num_waiting} requests are already waiting here (max_queue_len); try again "
                                 "shortly")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.scheduler.requests or rid in self.scheduler.held:
            raise InvalidRequestError(f"request id {rid!r} is already running")
        request = Request(rid, token_ids, params, cache_salt=cache_salt,
                          hold_blocks_on_finish=prefill_only, remote_prefill=remote_prefill)
        if params.has_grammar:  # a prefill worker's first token obeys it too
            request.grammar = self.structured_outputs.matcher(params)
        detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params.stop, params.skip_special_tokens)
        if resume_token_ids:
            self._resume(request, detokenizer, list(resume_token_ids))
        self._detokenizers[rid] = detokenizer
        self.scheduler.add_request(request)
        return rid

    def _resume(self, request: Request, detokenizer: IncrementalDetokenizer, done: list[int]) -> None:
        """Put a request where it stood after ``done``: the text already emitted (fed token by token, as it
        was then, so what was held back for a stop string is held back again), its grammar past them, and
        one random draw skipped per token (a seeded request samples the tokens an undisturbed run would)."""
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in done):
            raise InvalidRequestError(f"resumed token ids must be in [0, {vocab})")
        for token_id in done:
            request.append_output_token(token_id, None)
            detokenizer.add_tokens([token_id])
            accept(request.grammar, token_id)
            self.runner.skip_sample(request)

    def _check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})")
        check_fits(len(token_ids), params.max_tokens, self.max_model_len)
        total = len(token_ids) + params.max_tokens
        if cdiv(total, self.block_pool.block_size) > self.block_pool.num_blocks:
            raise CapacityError(
                f"prompt + max_tokens = {total} tokens can never fit this engine's KV pool of "
                f"{self.block_pool.num_blocks * self.block_pool.block_size} tokens")

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it is unknown or already finished."""
        request = self.scheduler.abort_request(request_id)
        self._forget(request_id)
        return request is not None

    def _forget(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)
        self.runner.release(request_id)

    # ---- disaggregated prefill ----
    def commit_remote_kv(self, request_id: str, token_id: int, logprob: float | None,
                         top_logprobs: list[tuple[int, float]] | None = None) -> RequestOutput | None:
        """The prompt's KV is in the reserved blocks: add the prefill worker's first token, join the batch.

        None if the request was aborted meanwhile.
        """
        request = self.scheduler.commit_remote_kv(request_id, SampledToken(token_id, logprob, top_logprobs))
        if request is None:
            return None
        # The first draw of a sampled request's stream happened on the prefill worker; skip it here,
        # so the tokens match a single engine's with the same seed. Its grammar moves past that token too.
        self.runner.skip_sample(request)
        accept(request.grammar, token_id)
        return self._postprocess(request)

    def held_block_ids(self, request_id: str) -> list[int]:
        """Blocks of a finished ``prefill_only`` request, held until ``release_held``."""
        if request_id not in self.scheduler.held:
            raise KeyError(request_id)
        return self.kv_cache_manager.block_ids(request_id)

    def release_held(self, request_id: str) -> bool:
        """Let a prefill-only request's blocks go (they stay as evictable prefix cache)."""
        return self.scheduler.release_held(request_id) is not None

    def stats(self) -> EngineStats:
        sched = self.scheduler
        return EngineStats(
            num_waiting=len(sched.waiting), num_running=len(sched.running), num_awaiting_kv=len(sched.awaiting_kv),
            kv_blocks_used=self.block_pool.num_used_blocks, kv_blocks_total=self.block_pool.num_blocks,
            preemptions_by_cause=dict(sched.preemptions_by_cause),
            prefix_hit_tokens_total=sched.num_prefix_hit_tokens_total,
            prefill_tokens_total=sched.num_prefill_tokens_total,
            prefix_query_tokens_total=sched.num_prefix_query_tokens_total,
        )

    def num_queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute (a load figure for routers; walks every request, so not per step)."""
        sched = self.scheduler
        return (sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
                + sum(r.num_tokens - r.num_computed_tokens - 1 for r in sched.running))

    # ---- one iteration ----
    def step(self) -> StepResult:
        """Schedule, run the model, postprocess; returns what the step did.

        On a GPU, a decode step the runner can launch without waiting (replayed from a CUDA graph, sampled by
        argmax) is left running when ``step`` returns, and the next ``step`` queues the step after it before
        reading its tokens, as SGLang's overlap scheduler does: the GPU goes from one step to the next while
        the host reads, updates and post-processes the earlier one (detokenize, stop strings, outputs). The
        follow-on step (``Scheduler.schedule_follow_on``) takes its input tokens on the device; a request the
        earlier token ends by EOS, a stop id or a stop string gets one token more there, dropped
        (``update_from_output`` skips a finished request), so outputs are the same token for token; a request
        committed since joins it with its own token. Where the next step needs a full schedule (a request
        may be admitted, one has prompt left, the pool is short) the earlier step is read first, and its
        post-processing overlaps the next step where that one is launched."""
        deferred: list[Request] = []
        if self._in_flight is not None:
            prev_sched, prev = self._in_flight
            self._in_flight = None
            follow = self.scheduler.schedule_follow_on(prev_sched)
            if follow is not None and self.runner.can_launch(follow):
                self._in_flight = (follow, self.runner.launch(follow, fed_by=prev))
                updated = self.scheduler.update_from_output(prev_sched, self.runner.collect(prev))
                outputs = [self._postprocess(r) for r in updated]  # while the GPU runs the follow-on step
                return StepResult(outputs, [], [], [], self.block_pool.take_events(), follow.num_batched_tokens,
                                  True)
            deferred = self.scheduler.update_from_output(prev_sched, self.runner.collect(prev))
        sched = self.scheduler.schedule()
        now = time.monotonic()
        for request in sched.shed:
            self._forget(request.request_id)
        if self.runner.can_launch(sched):
            self._in_flight = (sched, self.runner.launch(sched))
            outputs = [self._postprocess(r) for r in deferred]  # while the GPU runs this step
        else:
            outputs = [self._postprocess(r) for r in deferred]
            if sched.chunks:
                sampled = self.runner.execute(sched)
                outputs += [self._postprocess(r) for r in self.scheduler.update_from_output(sched, sampled)]
        return StepResult(outputs, sched.kv_reserved, [(r.request_id, now - r.arrival_time) for r in sched.shed],
                          sched.queue_seconds, self.block_pool.take_events(), sched.num_batched_tokens,
                          sched.is_decode_only)

    def _postprocess(self, request: Request) -> RequestOutput:
        # Every running request passes here every step: locals over repeated attribute and property reads.
        rid = request.request_id
        detok = self._detokenizers[rid]
        new_token_ids = request.output_token_ids[-1:]
        new_text = detok.add_tokens(new_token_ids)
        if detok.stop_reason is not None:
            if request.status.is_finished:
                request.status = RequestStatus.FINISHED_STOPPED  # a stop string beats max_tokens
            else:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
            request.stop_reason = detok.stop_reason
        finished = request.status.is_finished
        if finished:
            new_text += detok.flush()
            self._forget(rid)
        params = request.sampling_params
        num_output_tokens = len(request.output_token_ids)
        first = num_output_tokens == 1
        return RequestOutput(
            request_id=rid,
            new_token_ids=new_token_ids,
            new_text=new_text,
            new_logprobs=request.output_logprobs[-1:] if params.logprobs else [],
            finished=finished,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=num_output_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            new_top_logprobs=request.output_top_logprobs[-1:] if params.top_logprobs else [],
            prompt_logprobs=(list(request.prompt_logprobs) if first and params.prompt_logprobs is not None
                             else None),
            queue_seconds=request.queue_seconds if first else None,
        )

    # ---- offline convenience ----
    def generate(self, prompts: Sequence[PromptInput], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None) -> list[CompletionResult]:
        """Run every prompt to completion in one continuous batch; results in input order."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        results: dict[str, CompletionResult] = {
            rid: CompletionResult("", [], [], None) for rid in ids}
        for rid in ids:
            results[rid].prompt_token_ids = list(self.scheduler.requests[rid].prompt_token_ids)
        while self.has_unfinished:
            for out in self.step().outputs:
                res = results[out.request_id]
                res.text += out.new_text
                res.token_ids.extend(out.new_token_ids)
                res.logprobs.extend(out.new_logprobs)
                res.top_logprobs.extend(out.new_top_logprobs)
                if out.prompt_logprobs is not None:
                    res.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    res.finish_reason = out.finish_reason
        return [results[rid] for rid in ids]
