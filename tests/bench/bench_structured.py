"""What structured output costs a decode step: batch 16, every row under a JSON schema, against the same
batch in free text, side by side in one run.

    .venv/bin/python tests/bench/bench_structured.py [--steps 20] [--rounds 3]

Both batches sample at temperature 1.0 from the same chat prompt, 16 requests at once, prefix cache off
(caches cold). A step is timed only while all 16 rows decode (the schema's rows end at EOS once their
object closes, so only the first ``--steps`` decode steps count). Target (issue 23): <= 1.10x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402
from workers.protocol.sampling_params import SamplingParams  # noqa: E402

BATCH = 16
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer"},
                                           "hobbies": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "hobbies"], "additionalProperties": False}


def decode_steps(engine: Engine, prompt: list[int], schema: str | None, steps: int, seed: int) -> list[float]:
    for i in range(BATCH):
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 40, temperature=1.0, seed=seed + i,
                                                  json_schema=schema))
    times: list[float] = []
    while engine.has_unfinished and len(times) < steps:
        t0 = time.perf_counter()
        result = engine.step()
        if result.is_decode_only and result.num_tokens == BATCH:
            times.append(time.perf_counter() - t0)
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    engine = Engine(EngineConfig(num_kv_blocks=512, enable_prefix_caching=False))
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}])
    schema = json.dumps(SCHEMA)
    decode_steps(engine, prompt, schema, 2, 0)  # warm-up: compiles the grammar once (cached after)
    free, structured = [], []
    for r in range(args.rounds):  # interleaved, so the machine's noise falls on both
        free += decode_steps(engine, prompt, None, args.steps, 100 * r)
        structured += decode_steps(engine, prompt, schema, args.steps, 100 * r)
    f, s = statistics.median(free), statistics.median(structured)
    print(f"batch {BATCH}, {len(free)} / {len(structured)} decode steps: free text {f * 1e3:.1f} ms, "
          f"json_schema {s * 1e3:.1f} ms a step (medians); ratio {s / f:.3f} (target <= 1.10)")


if __name__ == "__main__":
    main()
