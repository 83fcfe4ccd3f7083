"""Host time of an engine decode step with the model's forward taken away: what a CUDA-graph replay leaves on
the host (schedule, build the step's inputs and stage them in the graphs' buffers, sample, detokenize, stop
checks), measured on any machine.

    python tests/bench/bench_step_host.py [--batches 1,8,64] [--steps 300]

The step goes through ``DecodeGraphs``' staging as on a GPU, and its replay writes fixed logits rolled by one
place a step (so each request's tokens, and the text the detokenizer decodes, keep changing); the model has a
4,096-token vocabulary so that the argmax (GPU work on a GPU) stays small: the figures are the engine's Python
and the sampler's host work. The requests are plain greedy, so the steps are launched as on a GPU
(``Engine.step``): there the GPU computes a step while the host plans the next one (``schedule`` counts the
follow-on plan) and post-processes the last; here it all adds up. Target
context (issue 20): a GPU decode step at batch 64 within 1.5x of its kernels (~1.55 ms on an H100).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.engine_steps import PartTimer, prefill_all  # noqa: E402
from tests.tiny_model import tiny_model  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.decode_graphs import DecodeGraphs  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.model.open_model import open_model  # noqa: E402
from workers.model.tokenizer import Tokenizer  # noqa: E402
from workers.protocol.sampling_params import SamplingParams  # noqa: E402


class StagedGraphs(DecodeGraphs):
    """``DecodeGraphs`` whose replay of b rows writes ``logits``' first b rows, rolled one place further each
    replay: the staging is the real one, the model is not run."""

    def __init__(self, logits: torch.Tensor, *args: object, **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.fixed_logits = logits

    def capture(self) -> None:
        for b in self.sizes:
            out = torch.empty(b, self.fixed_logits.shape[1])
            self._graphs[b] = (_RollingReplay(self.fixed_logits[:b], out), out)  # type: ignore[assignment]


class _RollingReplay:
    def __init__(self, logits: torch.Tensor, out: torch.Tensor):
        self.logits, self.out, self.shift = logits, out, 0

    def replay(self) -> None:
        self.shift += 1
        self.out.copy_(self.logits.roll(self.shift, 1))


def measure(tokenizer: Tokenizer, batch: int, steps: int, prompt_len: int = 400) -> dict[str, float]:
    # A small vocabulary: the argmax over it is cheap here as it is on a GPU (ids < 4,096 are still the real
    # tokenizer's tokens, so detokenizing costs what it costs).
    # The first requests admitted decode while the last are prefilled (a step's token budget takes a few prompts):
    # every request's max_tokens leaves room for those tokens, so none finishes while the steps are timed.
    max_tokens = steps + 20 + prompt_len * batch // 256
    model = tiny_model(seed=1, vocab_size=4096, max_positions=prompt_len + max_tokens + 64)
    engine = Engine(EngineConfig(num_kv_blocks=batch * ((prompt_len + max_tokens) // 16 + 2) + 16,
                                 max_num_seqs=batch), model=model, tokenizer=tokenizer)
    rng = random.Random(0)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, 4000) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    prefill_all(engine)
    # Logits whose argmax differs by row and step: each request's text keeps growing with real tokens.
    logits = torch.randn(batch, model.config.vocab_size, generator=torch.Generator().manual_seed(0))
    runner = engine.runner
    runner.decode_graphs = StagedGraphs(logits, model, runner.kv_cache, block_size=engine.config.block_size,
                                        max_batch=batch, max_model_len=engine.max_model_len, backend="torch")
    runner.decode_graphs.capture()
    for _ in range(5):
        engine.step()
    # A step is launched (launch, then collect its tokens) or, past what a launch takes, run by execute.
    split = PartTimer({"schedule": (engine.scheduler, "schedule"),
                       "follow_on": (engine.scheduler, "schedule_follow_on"),
                       "replay": (runner.decode_graphs, "forward"),
                       "execute": (runner, "execute"), "launch": (runner, "launch"), "collect": (runner, "collect")})
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        result = engine.step()
        walls.append(time.perf_counter() - t0)
        assert result.is_decode_only and len(result.outputs) == batch, f"{len(result.outputs)} outputs, not {batch}"
    assert runner.decode_graphs.num_replays >= steps, "every measured step goes through the graphs' staging"
    per = {k: v / steps * 1e3 for k, v in split.seconds.items()}
    per["runner"] = per["execute"] + per["launch"] + per["collect"]
    per["schedule"] += per["follow_on"]
    step = statistics.median(walls) * 1e3
    return {"step_ms": step, "schedule_ms": per["schedule"], "stage_ms": per["replay"],
            "sample_ms": per["runner"] - per["replay"],
            "post_ms": statistics.mean(walls) * 1e3 - per["schedule"] - per["runner"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a decode worker's host thread; the argmax's threads would blur the split
    tokenizer = Tokenizer.load(open_model(None).source)  # the bundled model's: its decode cost is the real one
    print("| batch | host ms a step (median) | schedule | stage + replay | inputs + sample "
          "| postprocess (detokenize, stops) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for batch in (int(b) for b in args.batches.split(",")):
        r = measure(tokenizer, batch, args.steps)
        parts = " | ".join(f"{r[k]:.3f}" for k in ("step_ms", "schedule_ms", "stage_ms", "sample_ms", "post_ms"))
        print(f"| {batch} | {parts} |", flush=True)


if __name__ == "__main__":
    main()
