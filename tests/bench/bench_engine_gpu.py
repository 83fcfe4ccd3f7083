"""Engine benchmark on a CUDA GPU: the engine (bf16, Triton kernels) beside HF transformers (bf16, SDPA).

    python tests/bench/bench_engine_gpu.py [--requests 256] [--layers 30]

The model has SmolLM2-135M's shapes with random weights (``tests.tiny_model.save_random_hf_model``):
no files needed. Figures, each beside its reference in the same process:

1. offline throughput: N requests (prompts 128-512 tokens, outputs 16-256, greedy, ignore_eos)
   against HF ``generate`` in static batches of 64 (useful tokens/s; target >= 2x, as on CPU);
2. one decode step at batch 64, context 512: wall time and the GPU time of its kernels (the gap is
   host overhead: Python and kernel launches);
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

from tests.tiny_model import save_random_hf_model, smollm2_shaped_hf_config  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.protocol.sampling_params import SamplingParams  # noqa: E402

T = TypeVar("T")
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
    engine = engine_for(max_num_seqs=num_requests, num_kv_blocks=(num_requests * 800) // 16)
    engine.generate(prompts[:8], params[:8])  # warm-up: Triton compiles, cuBLAS picks kernels
    tandem_s, results = synced(lambda: engine.generate(prompts, params))
    assert [len(r.token_ids) for r in results] == outs
    log(f"throughput: tandem {sum(outs) / tandem_s:.0f} tok/s; now HF static batches of {hf_batch}")
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
    return {"tandem_tok_s": useful / tandem_s, "hf_tok_s": useful / hf_s, "ratio": hf_s / tandem_s}


def decode_step(engine_for: EngineFactory, batch: int = 64, ctx: int = 512, steps: int = 30) -> dict[str, float]:
    rng = random.Random(1)
    engine = engine_for(max_num_seqs=batch, num_kv_blocks=batch * (ctx + steps + 64) // 16 + 64)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, 40000) for _ in range(ctx)],
                           SamplingParams(max_tokens=1024, temperature=0, ignore_eos=True))
    while engine.scheduler.waiting or not engine.step().is_decode_only:
        pass
    for _ in range(3):
        engine.step()
    walls = [synced(engine.step)[0] for _ in range(steps)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    gpu_us = sum(e.self_device_time_total for e in prof.key_averages()) / 5
    return {"step_ms": statistics.median(walls) * 1e3, "gpu_ms": gpu_us / 1e3}


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
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_engine_gpu needs a CUDA GPU")
    from transformers import AutoModelForCausalLM

    directory = tempfile.mkdtemp(prefix="tandem-bench-")
    save_random_hf_model(directory, smollm2_shaped_hf_config(args.layers))
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).cuda().eval()
    base = Engine(EngineConfig(model=directory, num_kv_blocks=16))
    log(f"model: {args.layers} layers, {base.model.dtype} on {torch.cuda.get_device_name()}")

    def engine_for(**knobs: object) -> Engine:
        return Engine(EngineConfig(**knobs), model=base.model, tokenizer=base.tokenizer)  # type: ignore[arg-type]

    t = throughput(engine_for, hf, args.requests)
    d = decode_step(engine_for)
    f = ttft(engine_for, hf)
    print("| measurement | tandem | reference | ratio |")
    print("| --- | --- | --- | --- |")
    print(f"| throughput, {args.requests} requests | {t['tandem_tok_s']:.0f} tok/s | HF static b64 "
          f"{t['hf_tok_s']:.0f} tok/s | {t['ratio']:.2f}x |")
    print(f"| decode step b64 ctx512 | {d['step_ms']:.2f} ms wall | GPU kernels {d['gpu_ms']:.2f} ms | "
          f"{d['step_ms'] / d['gpu_ms']:.2f}x |")
    print(f"| TTFT 1,000 tokens | {f['tandem_ms']:.1f} ms | HF forward {f['hf_forward_ms']:.1f} ms | "
          f"{f['ratio']:.2f}x |")


if __name__ == "__main__":
    main()
