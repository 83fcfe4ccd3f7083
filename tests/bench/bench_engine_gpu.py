"""Engine benchmark on a CUDA GPU: the engine (bf16, Triton kernels) beside HF transformers (bf16, SDPA).

    python tests/bench/bench_engine_gpu.py [--requests 256] [--layers 30] [--parts decode,ttft,throughput]
        [--decode-rounds 1]

The model has SmolLM2-135M's shapes with random weights (``tests.tiny_model.save_random_hf_model``):
no files needed. Figures, each beside its reference in the same process:

1. offline throughput: N requests (prompts 128-512 tokens, outputs 16-256, greedy, ignore_eos)
   against HF ``generate`` in static batches of 64 (useful tokens/s; target >= 2x, as on CPU);
2. one decode step at batch 64, context 512, replayed from CUDA graphs and launched eagerly: wall time
   and the GPU time of its kernels (the gap is host overhead: Python and kernel launches; target: wall
   <= 1.5x the kernels), with the graph step's host time split into schedule, run and the rest (run: a
   synchronous step's execute, or a launched one's launch and collect, which waits for the GPU while the
   host has post-processed the previous step: ``Engine.step``), timed one step at a time (synchronized
   before and after it) and back to back (as a worker runs them: the next step is queued before the last
   one's tokens are read); the graph step ``--decode-rounds`` times;
3. TTFT of a 1,000-token prompt: the engine's prefill step against HF's forward of the same prompt.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.engine_steps import PartTimer, prefill_all  # noqa: E402
from tests.tiny_model import save_random_hf_model, smollm2_shaped_hf_config  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.protocol.sampling_params import SamplingParams  # noqa: E402

T = TypeVar("T")
PARTS = {"decode", "ttft", "throughput"}
EngineFactory = Callable[..., Engine]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def synced(fn: Callable[[], T]) -> tuple[float, T]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def throughput(engine_for: EngineFactory, hf: Any, num_requests: int, hf_batch: int = 64) -> dict[str, float]:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(128, 512))] for _ in range(num_requests)]
    outs = [rng.randint(16, 256) for _ in range(num_requests)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in outs]
    seconds = {}
    for graphs in (False, True):
        engine = engine_for(max_num_seqs=num_requests, num_kv_blocks=(num_requests * 800) // 16, cuda_graphs=graphs)
        engine.generate(prompts[:8], params[:8])  # warm-up: Triton compiles, cuBLAS picks kernels
        seconds[graphs], results = synced(lambda: engine.generate(prompts, params))  # noqa: B023
        assert [len(r.token_ids) for r in results] == outs
        log(f"throughput, cuda_graphs={graphs}: tandem {sum(outs) / seconds[graphs]:.0f} tok/s")
    tandem_s = seconds[True]
    log(f"now HF static batches of {hf_batch}")
    hf_s = 0.0
    for start in range(0, num_requests, hf_batch):
        group, new = prompts[start : start + hf_batch], max(outs[start : start + hf_batch])
        width = max(len(p) for p in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device="cuda")
        with torch.inference_mode():
            s, _ = synced(partial(hf.generate, input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False, pad_token_id=0))
        hf_s += s
    useful = sum(outs)
    return {"tandem_tok_s": useful / tandem_s, "eager_tok_s": useful / seconds[False], "hf_tok_s": useful / hf_s,
            "ratio": hf_s / tandem_s}


def decode_step(engine_for: EngineFactory, cuda_graphs: bool, batch: int = 64, ctx: int = 512,
                steps: int = 30) -> dict[str, float]:
    """Wall time of a decode step and the GPU time of its kernels. Eager: the profiler's kernel times.
    Graphs: CUDA events around back-to-back replays of the step's graph (the profiler is not run while
    graphs replay: CUPTI and graph replay together hang or fault on some CUDA versions)."""
    rng = random.Random(1)
    engine = engine_for(max_num_seqs=batch, num_kv_blocks=batch * (ctx + 2 * steps + 64) // 16 + 64,
                        cuda_graphs=cuda_graphs)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, 40000) for _ in range(ctx)],
                           SamplingParams(max_tokens=1024, temperature=0, ignore_eos=True))
    prefill_all(engine)
    for _ in range(3):
        engine.step()
    runner = engine.runner
    parts_timed = {"schedule": (engine.scheduler, "schedule"), "follow_on": (engine.scheduler, "schedule_follow_on"),
                   "execute": (runner, "execute"),
                   "launch": (runner, "launch"), "collect": (runner, "collect")}
    # (An engine without launched steps, an older commit run side by side, has no launch or collect.)
    timer = PartTimer({k: v for k, v in parts_timed.items() if hasattr(*v)})
    walls = [synced(engine.step)[0] for _ in range(steps)]
    parts = dict.fromkeys(parts_timed, 0.0) | timer.seconds
    # A launched step (graphs, argmax) is launch + collect, which waits for the GPU; a synchronous one execute.
    parts["run"] = parts["execute"] + parts["launch"] + parts["collect"]
    parts["schedule"] += parts["follow_on"]
    # Back to back, as a worker's loop runs them: a step may leave its kernels running into the next one.
    stream_s, _ = synced(lambda: [engine.step() for _ in range(steps)])
    graphs = engine.runner.decode_graphs
    if cuda_graphs:
        assert graphs is not None and graphs.num_replays >= steps, "decode steps must replay graphs"
        gpu_ms, kernels = replay_gpu_ms(graphs.graph(batch)), float("nan")
    else:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        gpu_ms = sum(e.self_device_time_total for e in events) / 5 / 1e3
        kernels = sum(e.count for e in events if e.self_device_time_total > 0) / 5
    return {"step_ms": statistics.median(walls) * 1e3, "stream_ms": stream_s / steps * 1e3, "gpu_ms": gpu_ms,
            "kernels_per_step": kernels,
            **{f"{k}_ms": parts[k] / steps * 1e3 for k in ("schedule", "run", "execute", "launch", "collect")}}


def replay_gpu_ms(graph: torch.cuda.CUDAGraph, repeats: int = 20) -> float:
    """GPU milliseconds of one replay, from events around ``repeats`` replays queued back to back (the last
    step's inputs again: its KV rows are rewritten with the same values)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def ttft(engine_for: EngineFactory, hf: Any, length: int = 1000, repeats: int = 10) -> dict[str, float]:
    rng = random.Random(2)
    engine = engine_for(enable_prefix_caching=False, num_kv_blocks=256)
    params = SamplingParams(max_tokens=1, temperature=0)

    def one() -> None:
        engine.generate([[rng.randrange(100, 40000) for _ in range(length)]], params)

    one()
    tandem = statistics.median(synced(one)[0] for _ in range(repeats))
    ids = torch.tensor([[rng.randrange(100, 40000) for _ in range(length)]], device="cuda")
    with torch.inference_mode():
        hf(ids)
        hf_s = statistics.median(synced(lambda: hf(ids))[0] for _ in range(repeats))
    return {"tandem_ms": tandem * 1e3, "hf_forward_ms": hf_s * 1e3, "ratio": tandem / hf_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--parts", default="decode,ttft,throughput",
                        help="which measurements to run (decode: the step against its kernels, a few rounds)")
    parser.add_argument("--decode-rounds", type=int, default=1, help="decode-step measurements of each kind")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= PARTS:
        parser.error(f"--parts: unknown {sorted(parts - PARTS)}; choose among {sorted(PARTS)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_engine_gpu needs a CUDA GPU")
    from transformers import AutoModelForCausalLM

    directory = tempfile.mkdtemp(prefix="tandem-bench-")
    save_random_hf_model(directory, smollm2_shaped_hf_config(args.layers))
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).cuda().eval()
    base = Engine(EngineConfig(model=directory, num_kv_blocks=16, cuda_graphs=False))
    log(f"model: {args.layers} layers, {base.model.dtype} on {torch.cuda.get_device_name()}")

    def engine_for(**knobs: object) -> Engine:
        return Engine(EngineConfig(**knobs), model=base.model, tokenizer=base.tokenizer)  # type: ignore[arg-type]

    print("| measurement | tandem | reference | ratio |")
    print("| --- | --- | --- | --- |")
    if "decode" in parts:
        # Eager first: the profiler runs there, before any graph is captured in this process.
        eager = decode_step(engine_for, False)
        log(f"decode step b64 ctx512, cuda_graphs=False: {eager}")
        print_decode_row("eager", eager, f"kernels (profiler), {eager['kernels_per_step']:.0f} a step")
        ratios: dict[str, list[float]] = {"step_ms": [], "stream_ms": []}
        for round_ in range(args.decode_rounds):
            graphs = decode_step(engine_for, True)
            log(f"decode step b64 ctx512, cuda_graphs=True, round {round_ + 1}: {graphs}")
            print_decode_row("CUDA graphs", graphs, "graph replay (events)")
            for key, values in ratios.items():
                values.append(graphs[key] / graphs["gpu_ms"])
        for key, how in (("step_ms", "one step, synchronized around it"), ("stream_ms", "back to back")):
            print(f"| decode step b64 ctx512, CUDA graphs, {args.decode_rounds} rounds, {how} | median wall / GPU "
                  f"| | {statistics.median(ratios[key]):.2f}x (rounds: "
                  f"{', '.join(f'{r:.2f}' for r in ratios[key])}) |")
    if "ttft" in parts:
        f = ttft(engine_for, hf)
        print(f"| TTFT 1,000 tokens | {f['tandem_ms']:.1f} ms | HF forward {f['hf_forward_ms']:.1f} ms | "
              f"{f['ratio']:.2f}x |")
    if "throughput" in parts:
        t = throughput(engine_for, hf, args.requests)
        print(f"| throughput, {args.requests} requests | {t['tandem_tok_s']:.0f} tok/s (eager "
              f"{t['eager_tok_s']:.0f}) | HF static b64 {t['hf_tok_s']:.0f} tok/s | {t['ratio']:.2f}x |")


def print_decode_row(how: str, r: dict[str, float], gpu: str) -> None:
    print(f"| decode step b64 ctx512, {how} | {r['step_ms']:.2f} ms wall (schedule {r['schedule_ms']:.2f}, "
          f"run {r['run_ms']:.2f}: execute {r['execute_ms']:.2f}, launch {r['launch_ms']:.2f}, collect "
          f"{r['collect_ms']:.2f}); back to back {r['stream_ms']:.2f} ms a step | GPU {gpu}: {r['gpu_ms']:.2f} ms | "
          f"{r['step_ms'] / r['gpu_ms']:.2f}x, back to back {r['stream_ms'] / r['gpu_ms']:.2f}x (target <= 1.5x) |",
          flush=True)

if __name__ == "__main__":
    main()
