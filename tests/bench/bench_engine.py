"""Engine benchmark on this machine (default model, fp32, CPU): four figures, each beside its reference.

    .venv/bin/python tests/bench/bench_engine.py [--only throughput,decode,ttft,itl] [--json FILE]

1. offline throughput of 64 requests (prompts 128-512 tokens, outputs 16-256) against HF
   ``generate`` in static batches of 16 (target >= 2x HF's useful tokens/s);
2. one decode step at batch 32 against that step's matrix multiplies alone: the linear layers and
   attention's q.K^T and p.V over contiguous K/V (target <= 1.3x);
3. TTFT of a request whose 1,000-token prefix is cached against cold (target <= 0.25x);
4. the largest inter-token gap of 16 decoding requests while a 2,000-token prompt arrives, with
   and without chunked prefill, against their median gap (target <= 2.5x with chunking); measured
   on a second pass of the same scenario, after the process has met its shapes once.

Timings are medians of repeats; ratios are measured side by side in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kernels.bench import time_fn  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.protocol.sampling_params import SamplingParams  # noqa: E402

VOCAB_LO, VOCAB_HI = 100, 40000  # plain tokens, away from the special ones


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median_time(fn: Callable[[], object], repeats: int) -> float:
    return time_fn(fn, torch.device("cpu"), repeats, warmup=False)


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


class Bench:
    def __init__(self) -> None:
        log("loading the default model")
        self.base = Engine(EngineConfig(num_kv_blocks=16))
        self.results: dict[str, dict[str, float]] = {}

    def engine(self, **knobs: object) -> Engine:
        return Engine(EngineConfig(**knobs), model=self.base.model, tokenizer=self.base.tokenizer)  # type: ignore[arg-type]

    # 1 ---------------------------------------------------------------------------------------
    def throughput(self, num_requests: int = 64, hf_batch: int = 16) -> None:
        rng = random.Random(0)
        prompts = [random_prompt(rng, rng.randint(128, 512)) for _ in range(num_requests)]
        outs = [rng.randint(16, 256) for _ in range(num_requests)]
        useful = sum(outs)
        engine = self.engine(num_kv_blocks=4096, max_num_seqs=num_requests)
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in outs]
        log(f"throughput: tandem, {num_requests} requests, {useful} output tokens")
        t0 = time.perf_counter()
        results = engine.generate(prompts, params)
        tandem_s = time.perf_counter() - t0
        assert [len(r.token_ids) for r in results] == outs
        log(f"throughput: tandem {useful / tandem_s:.1f} tok/s; now HF generate, static batches of {hf_batch}")
        hf_s, hf_generated = self._hf_static_batches(prompts, outs, hf_batch)
        self.results["throughput"] = {
            "tandem_tok_s": useful / tandem_s, "hf_tok_s": useful / hf_s,
            "hf_generated_tok_s_incl_padding_waste": hf_generated / hf_s,
            "ratio": (useful / tandem_s) / (useful / hf_s), "target": 2.0,
            "tandem_s": tandem_s, "hf_s": hf_s,
        }

    def _hf_static_batches(self, prompts: list[list[int]], outs: list[int], batch: int) -> tuple[float, int]:
        from transformers import AutoModelForCausalLM

        from workers.model.loader import default_model_path

        path = default_model_path()
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        model.eval()
        pad = 0
        total_s, generated = 0.0, 0
        for start in range(0, len(prompts), batch):
            group, group_out = prompts[start : start + batch], outs[start : start + batch]
            width = max(len(p) for p in group)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            new = max(group_out)
            t0 = time.perf_counter()
            with torch.inference_mode():
                gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                     do_sample=False, pad_token_id=pad)
            total_s += time.perf_counter() - t0
            generated += (gen.shape[1] - width) * len(group)
            log(f"  HF batch {start // batch + 1}: {new} steps, {total_s:.1f}s so far")
        return total_s, generated

    # 2 ---------------------------------------------------------------------------------------
    def decode_step(self, batch: int = 32, contexts: tuple[int, ...] = (64, 256, 512)) -> None:
        """The step's matrix multiplies are the linear layers (weights: the same bytes at any context)
        and attention's two products per layer, q.K^T and p.V, here over K/V already laid out
        contiguously per layer: what paging, norms, RoPE, sampling and Python add on top is the overhead."""
        model = self.base.model
        cfg = model.config
        x = torch.randn(batch, cfg.hidden_size)
        inter = torch.randn(batch, cfg.intermediate_size)
        per_kv = cfg.num_heads // cfg.num_kv_heads
        q = torch.randn(batch, cfg.num_kv_heads, per_kv, cfg.head_dim)

        def linear_matmuls() -> None:
            for layer in model.layers:
                F.linear(x, layer.qkv, layer.qkv_bias)
                F.linear(x, layer.o_proj)
                F.linear(x, layer.gate_up)
                F.linear(inter, layer.down)
            F.linear(x, model.lm_head)

        rng = random.Random(1)
        for ctx in contexts:
            engine = self.engine(num_kv_blocks=batch * (ctx + 64) // 16 + 64, max_num_seqs=batch)
            for _ in range(batch):
                params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
                engine.add_request(random_prompt(rng, ctx), params)
            while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
                engine.step()
            length = ctx + 8  # the sequences' length halfway through the timed steps
            kv = [torch.randn(2, batch, cfg.num_kv_heads, length, cfg.head_dim) for _ in model.layers]

            def attention_matmuls(kv: list[torch.Tensor] = kv) -> None:
                for k_v in kv:  # one layer's K and V each: cold in cache, as in the step
                    torch.matmul(torch.matmul(q, k_v[0].transpose(-1, -2)), k_v[1])

            # Interleaved, so all three see the same background noise of this shared machine.
            step_times, lin_times, att_times = [], [], []
            for _ in range(15):
                step_times.append(median_time(engine.step, 1))
                lin_times.append(median_time(linear_matmuls, 1))
                att_times.append(median_time(attention_matmuls, 1))
            step_s, lin_s, att_s = (statistics.median(t) for t in (step_times, lin_times, att_times))
            self.results[f"decode_step_b{batch}_ctx{ctx}"] = {
                "step_ms": step_s * 1e3, "linear_matmul_ms": lin_s * 1e3, "attention_matmul_ms": att_s * 1e3,
                "matmul_ms": (lin_s + att_s) * 1e3, "ratio": step_s / (lin_s + att_s),
                "ratio_to_linear": step_s / lin_s, "target": 1.3}
            log(f"decode step b{batch} ctx{ctx}: {step_s * 1e3:.1f} ms vs matmuls {(lin_s + att_s) * 1e3:.1f} ms "
                f"(linear {lin_s * 1e3:.1f}, attention {att_s * 1e3:.1f})")

    # 3 ---------------------------------------------------------------------------------------
    def prefix_ttft(self, prefix_len: int = 1000, suffix_len: int = 24, repeats: int = 5) -> None:
        rng = random.Random(2)
        engine = self.engine(num_kv_blocks=1024)
        one = SamplingParams(max_tokens=1, temperature=0)

        def ttft(prompt: list[int]) -> float:
            t0 = time.perf_counter()
            engine.add_request(prompt, one)
            while engine.has_unfinished:
                engine.step()
            return time.perf_counter() - t0

        cold, warm = [], []
        for _ in range(repeats):
            prefix = random_prompt(rng, prefix_len)
            assert engine.block_pool.reset_prefix_cache()
            cold.append(ttft(prefix + random_prompt(rng, suffix_len)))  # also fills the cache
            warm.append(ttft(prefix + random_prompt(rng, suffix_len)))
        c, w = statistics.median(cold), statistics.median(warm)
        self.results["prefix_ttft"] = {"cold_ms": c * 1e3, "cached_ms": w * 1e3, "ratio": w / c, "target": 0.25}
        log(f"TTFT {prefix_len}-token prefix: cold {c * 1e3:.0f} ms, cached {w * 1e3:.0f} ms")

    # 4 ---------------------------------------------------------------------------------------
    def itl_under_long_prefill(self, num_decoding: int = 16, long_len: int = 2000, chunk: int = 32) -> None:
        for label, chunk_size in (("chunked", chunk), ("unchunked", None)):
            # One untimed pass first: the first time a process meets a shape, torch's CPU kernels set
            # themselves up (hundreds of ms); a server pays that once in its life, not per request.
            self._itl_run(num_decoding, long_len, chunk_size)
            gaps, long_ttft = self._itl_run(num_decoding, long_len, chunk_size)
            med, worst = statistics.median(gaps), max(gaps)
            self.results[f"itl_{label}"] = {
                "prefill_chunk_size": chunk_size or 0, "median_itl_ms": med * 1e3, "max_itl_ms": worst * 1e3,
                "ratio": worst / med, "target": 2.5 if chunk_size else float("nan"),
                "long_prompt_ttft_ms": long_ttft * 1e3}
            log(f"ITL {label}: median {med * 1e3:.0f} ms, max {worst * 1e3:.0f} ms")

    def _itl_run(self, num_decoding: int, long_len: int, chunk_size: int | None) -> tuple[list[float], float]:
        rng = random.Random(3)
        engine = self.engine(num_kv_blocks=(num_decoding * 400 + long_len) // 16 + 64, prefill_chunk_size=chunk_size)
        ids = [engine.add_request(random_prompt(rng, 128), SamplingParams(max_tokens=10_000 // 40, temperature=0,
                                                                         ignore_eos=True))
               for _ in range(num_decoding)]
        while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        last: dict[str, float] = {}
        gaps: list[float] = []
        long_id, long_added, long_ttft, steps_after = None, 0.0, 0.0, 0
        for step in range(10_000):
            if step == 5:
                long_added = time.perf_counter()
                long_id = engine.add_request(random_prompt(rng, long_len), SamplingParams(max_tokens=4, temperature=0))
            now_outputs = engine.step().outputs
            now = time.perf_counter()
            for out in now_outputs:
                if out.request_id in ids:
                    if out.request_id in last:
                        gaps.append(now - last[out.request_id])
                    last[out.request_id] = now
                elif out.request_id == long_id and not long_ttft:
                    long_ttft = now - long_added
            if long_ttft:
                steps_after += 1
                if steps_after > 5:
                    break
        for rid in ids:
            engine.abort(rid)
        return gaps, long_ttft


def print_table(results: dict[str, dict[str, float]]) -> None:
    print("| measurement | tandem | reference | ratio | target |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in results.items():
        if name == "throughput":
            row = (f"{r['tandem_tok_s']:.1f} tok/s", f"HF static b16 {r['hf_tok_s']:.1f} tok/s",
                   f"{r['ratio']:.2f}x", ">= 2x")
        elif name.startswith("decode_step"):
            row = (f"{r['step_ms']:.1f} ms/step",
                   f"matmuls {r['matmul_ms']:.1f} ms (linear {r['linear_matmul_ms']:.1f} + attention "
                   f"{r['attention_matmul_ms']:.1f}; the step is {r['ratio_to_linear']:.2f}x the linear ones)",
                   f"{r['ratio']:.2f}x", "<= 1.3x")
        elif name == "prefix_ttft":
            row = (f"cached {r['cached_ms']:.0f} ms", f"cold {r['cold_ms']:.0f} ms", f"{r['ratio']:.3f}x", "<= 0.25x")
        else:
            row = (f"max ITL {r['max_itl_ms']:.0f} ms (long prompt TTFT {r['long_prompt_ttft_ms']:.0f} ms)",
                   f"median ITL {r['median_itl_ms']:.0f} ms", f"{r['ratio']:.2f}x",
                   "<= 2.5x" if r["prefill_chunk_size"] else "(no chunking, for contrast)")
        print(f"| {name} | " + " | ".join(row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="throughput,decode,ttft,itl")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    bench = Bench()
    parts = {"throughput": bench.throughput, "decode": bench.decode_step, "ttft": bench.prefix_ttft,
             "itl": bench.itl_under_long_prefill}
    for name in args.only.split(","):
        parts[name]()
    print(f"torch threads: {torch.get_num_threads()}, {os.cpu_count()} CPUs")
    print_table(bench.results)
    if args.json:
        Path(args.json).write_text(json.dumps(bench.results, indent=1))


if __name__ == "__main__":
    main()
