"""Measures one engine on this machine into a ``TimingProfile`` (``tandem profile``): minutes, not hours.

    profile = measure_profile(engine_config, say=print)

- prefill: one step computing N new prompt tokens after C cached ones (a prefix hit), for a few N and C;
- decode: one step of B requests decoding at a context of C tokens, for a few B and C; each request reads
  its own KV, as on a decode worker (one prompt is computed, and its KV is copied into every request's
  blocks the way a prefill worker's lands), so filling the batch costs one prefill;
- transfer: one KV transfer of a few sizes between two transports on this host.

Every point is the median of a few repeats, after one warm-up step.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch

from kernels.host_math import cdiv
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.model_loading import resolve_weight_format
from workers.protocol.sampling_params import SamplingParams
from workers.protocol.timing_profile import Curve, Grid, TimingProfile
from workers.transport.factory import make_transport

PREFILL_NEW = (16, 64, 128, 256, 512)
PREFILL_CONTEXT = (0, 512, 1024)
DECODE_BATCH = (1, 2, 4, 8, 16, 32, 64)
DECODE_CONTEXT = (128, 256, 512, 1024)
TRANSFER_BLOCKS = (1, 8, 32, 128)
REPEATS = 3


def measure_profile(config: EngineConfig, say: Callable[[str], None] = print) -> TimingProfile:
    started = time.monotonic()
    engine = Engine(config)
    vocab = engine.model.config.vocab_size
    say("warming up")
    _prompt_step(engine, _tokens(64, 0, vocab), 0)
    prefill = _measure_prefill(engine, vocab, say)
    decode = _measure_decode(engine, vocab, say)
    transfer = _measure_transfer(engine, say)
    return TimingProfile(
        device=_device_name(engine.model.device), model=config.model or "SmolLM2-135M-Instruct (bundled)",
        weight_format=resolve_weight_format(config, engine.model.device, engine.model.dtype),
        kv_bytes_per_token=engine.runner.kv_cache.nbytes // (engine.block_pool.num_blocks * config.block_size),
        block_size=config.block_size,
        kv_tokens_per_worker=engine.block_pool.num_blocks * config.block_size, max_num_seqs=config.max_num_seqs,
        prefill_chunk_size=config.prefill_chunk_size, prefill=prefill, decode=decode, transfer=transfer,
        transfer_backend="tcp", seconds_to_measure=round(time.monotonic() - started, 1))


def _measure_prefill(engine: Engine, vocab: int, say: Callable[[str], None]) -> Grid:
    chunk = engine.config.prefill_chunk_size or max(PREFILL_NEW)
    news = [n for n in PREFILL_NEW if n <= chunk]  # one step computes at most a chunk
    contexts = [c for c in PREFILL_CONTEXT if c + max(news) <= engine.max_model_len]
    zs: list[list[float]] = []
    for n in news:
        row = []
        for c in contexts:
            row.append(statistics.median(_prompt_step(engine, _tokens(c + n, 1000 * r + n, vocab), c)
                                         for r in range(REPEATS)))
        zs.append(row)
        say(f"prefill {n:>4} new tokens: " + ", ".join(f"{1000 * s:.1f} ms after {c}"
                                                       for s, c in zip(row, contexts, strict=True)))
    return Grid(xs=[float(n) for n in news], ys=[float(c) for c in contexts], zs=zs)


def _prompt_step(engine: Engine, prompt: list[int], cached: int) -> float:
    """Seconds of the one step that computes ``prompt`` after its first ``cached`` tokens (computed and
    cached beforehand, untimed)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    if cached:
        engine.generate([prompt[:cached]], params)
    engine.add_request(prompt, params)
    started = time.perf_counter()
    result = engine.step()
    seconds = time.perf_counter() - started
    assert result.outputs and result.outputs[0].finished, "the prompt did not finish in one step"
    return seconds


def _measure_decode(engine: Engine, vocab: int, say: Callable[[str], None]) -> Grid:
    batches = [b for b in DECODE_BATCH if b <= engine.config.max_num_seqs]
    contexts = [c for c in DECODE_CONTEXT if c + REPEATS + 8 <= engine.max_model_len]
    zs = [[0.0] * len(contexts) for _ in batches]
    for j, context in enumerate(contexts):
        source = _held_prompt(engine, context - 1, vocab)
        for i, batch in enumerate(batches):
            # A batch whose KV does not fit at this context never runs on a worker; its figure (read only by
            # the simulation's interpolation) goes on the line through the two batches below it.
            zs[i][j] = (_decode_step(engine, source, batch, context, vocab) if _fits(engine, batch, context)
                        else _extrapolate(batches[:i], [row[j] for row in zs[:i]], batch))
        engine.release_held(source[0])
        say(f"decode at {context:>4} tokens of context: " + ", ".join(
            f"{1000 * zs[i][j]:.1f} ms at batch {b}" + ("" if _fits(engine, b, context) else " (extrapolated)")
            for i, b in enumerate(batches)))
    return Grid(xs=[float(b) for b in batches], ys=[float(c) for c in contexts], zs=zs)


def _fits(engine: Engine, batch: int, context: int) -> bool:
    blocks = cdiv(context + REPEATS + 8, engine.config.block_size)
    return (batch + 1) * blocks <= engine.block_pool.num_blocks


def _extrapolate(xs: list[int], ys: list[float], x: int) -> float:
    if len(xs) < 2:
        return ys[-1] * x / xs[-1]
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return ys[-1] + max(slope, 0.0) * (x - xs[-1])


def _held_prompt(engine: Engine, num_tokens: int, vocab: int) -> tuple[str, list[int]]:
    """A prompt computed once and held (a prefill worker's request): its request id and KV blocks."""
    rid = engine.add_request(_tokens(num_tokens, 13 * num_tokens, vocab),
                             SamplingParams(max_tokens=1, ignore_eos=True), prefill_only=True)
    while rid not in engine.scheduler.held:
        engine.step()
    return rid, engine.held_block_ids(rid)


def _decode_step(engine: Engine, source: tuple[str, list[int]], batch: int, context: int, vocab: int) -> float:
    """Median seconds of a decode step of ``batch`` requests at a ``context``-token prompt, each reading its own
    KV as on a decode worker: the prompts are distinct and their KV lands as a prefill worker's does (a copy
    of ``source``'s blocks, committed). Shared prompt blocks would be read from the CPU's caches, not memory,
    and time the attention of a large batch at a fraction of what serving it costs."""
    params = SamplingParams(max_tokens=REPEATS + 8, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(_tokens(context - 1, 7919 * (batch * 64 + i) + context, vocab), params,
                              remote_prefill=True) for i in range(batch)]
    reserved = engine.step().reservations
    assert len(reserved) == batch, "not every request got its blocks"
    cache, src = engine.runner.kv_cache, torch.tensor(source[1])
    for reservation in reserved:
        cache[:, :, torch.tensor(reservation.block_ids[: len(source[1])])] = cache[:, :, src]
        engine.commit_remote_kv(reservation.request_id, token_id=1000, logprob=None)
    times = []
    for _ in range(REPEATS + 2):
        started = time.perf_counter()
        result = engine.step()
        times.append(time.perf_counter() - started)
        assert result.is_decode_only and len(result.outputs) == batch, "not a whole decode step"
    for rid in ids:
        engine.abort(rid)
    return statistics.median(times[1:])


def _measure_transfer(engine: Engine, say: Callable[[str], None]) -> Curve:
    cache = engine.runner.kv_cache
    blocks = min(max(TRANSFER_BLOCKS), cache.shape[2] // 2)
    source, sink = make_transport("tcp"), make_transport("tcp")
    sink_cache = torch.zeros_like(cache[:, :, : blocks])
    try:
        source.register(cache)
        sink.register(sink_cache)
        xs, ys = [], []
        for n in (b for b in TRANSFER_BLOCKS if b <= blocks):
            runs = [source.write_blocks(sink.address(), list(range(n)), list(range(n)), f"profile-{n}-{r}", 30.0)
                    for r in range(REPEATS)]
            xs.append(float(runs[0].num_bytes))
            ys.append(statistics.median(r.seconds for r in runs))
            say(f"transfer {n:>4} blocks ({runs[0].num_bytes / 1e6:.1f} MB): {1000 * ys[-1]:.2f} ms")
    finally:
        source.close()
        sink.close()
    return Curve(xs=xs, ys=ys)


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    """``n`` ordinary token ids (no special ones), different for each seed: no accidental prefix hits."""
    span = min(vocab, 40000) - 1000
    return [1000 + (seed * 7919 + i * 104729) % span for i in range(n)]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {platform.machine()}, {torch.get_num_threads()} threads"
