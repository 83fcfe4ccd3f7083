"""What structured output costs a decode step: batch 16, every row under a JSON schema, and every row under
the grammar of a chat with tools (tool_choice auto: free text with calls held to their schemas), against the
same batch in free text, side by side in one run.

    .venv/bin/python tests/bench/bench_structured.py [--steps 20] [--rounds 7]

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


def tools_tag() -> str:
    """The structural tag the router gives a chat that offers two tools (tool_choice auto)."""
    from router.schemas import ChatCompletionRequest
    from router.tool_calls import tool_plan

    weather = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
               "required": ["city"]}
    tools = [{"type": "function", "function": {"name": name, "parameters": weather}} for name in ("get_weather", "f")]
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 "tools": tools})
    plan = tool_plan(body, type("Hermes", (), {"tool_call_format": "hermes"})())  # type: ignore[arg-type]
    assert plan is not None
    return plan.structural_tag


def decode_steps(engine: Engine, prompt: list[int], grammar: dict[str, str], steps: int, seed: int) -> list[float]:
    for i in range(BATCH):
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 40, temperature=1.0, seed=seed + i, **grammar))
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
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    engine = Engine(EngineConfig(num_kv_blocks=512, enable_prefix_caching=False))
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}])
    grammars = {"free text": {}, "json_schema": {"json_schema": json.dumps(SCHEMA)},
                "tools (auto)": {"structural_tag": tools_tag()}}
    for grammar in grammars.values():
        decode_steps(engine, prompt, grammar, 2, 0)  # warm-up: compiles each grammar once (cached after)
    times: dict[str, list[float]] = {name: [] for name in grammars}
    ratios: dict[str, list[float]] = {name: [] for name in grammars}
    for r in range(args.rounds):  # interleaved, so the machine's noise falls on all; ratios paired by round
        medians = {}
        for name, grammar in grammars.items():
            steps = decode_steps(engine, prompt, grammar, args.steps, 100 * r)
            times[name] += steps
            medians[name] = statistics.median(steps)
        for name in grammars:
            ratios[name].append(medians[name] / medians["free text"])
    free = statistics.median(times["free text"])
    print(f"batch {BATCH}, {len(times['free text'])} free-text decode steps: {free * 1e3:.1f} ms a step (median)")
    for name in list(grammars)[1:]:
        t = statistics.median(times[name])
        print(f"  {name}: {t * 1e3:.1f} ms a step over {len(times[name])} steps; ratio of medians {t / free:.3f}, "
              f"median of {args.rounds} paired rounds {statistics.median(ratios[name]):.3f} (target <= 1.10)")

if __name__ == "__main__":
    main()
