"""``tandem generate``: offline batch inference, one JSON line out per input line, in order."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from workers.protocol.errors import TandemError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="offline batch inference on the local engine")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help='JSONL file of {"prompt": "..."} or {"messages": [...]} lines ("-" for stdin)')
    src.add_argument("--prompt", help="one prompt")
    p.add_argument("--chat", action="store_true", help="apply the chat template to --prompt (as a user message)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.set_defaults(func=run)


def read_inputs(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.prompt is not None:
        if args.chat:
            return [{"messages": [{"role": "user", "content": args.prompt}]}]
        return [{"prompt": args.prompt}]
    stream = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    inputs = []
    with stream:
        for n, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{args.input}:{n}: not JSON: {e}") from e
            if not isinstance(item, dict) or not ({"prompt", "messages"} & item.keys()):
                raise SystemExit(f'{args.input}:{n}: expected {{"prompt": ...}} or {{"messages": [...]}}')
            inputs.append(item)
    return inputs


def run(args: argparse.Namespace) -> int:
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine
    from workers.protocol.sampling_params import SamplingParams

    inputs = read_inputs(args)
    try:  # bad sampling parameters are refused before the model loads
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, seed=args.seed)
        t0 = time.perf_counter()
        engine = Engine(EngineConfig(model=args.model, max_model_len=args.max_model_len))
        print(f"[tandem] model loaded in {time.perf_counter() - t0:.1f}s; {len(inputs)} inputs", file=sys.stderr)
        t0 = time.perf_counter()
        results = engine.generate(inputs, params)
    except TandemError as e:
        print(f"tandem generate: error: {e}", file=sys.stderr)
        return 2
    num_out = sum(len(r.token_ids) for r in results)
    elapsed = time.perf_counter() - t0
    for r in results:
        print(json.dumps({"text": r.text, "token_ids": r.token_ids, "prompt_token_ids": r.prompt_token_ids,
                          "finish_reason": r.finish_reason}, ensure_ascii=False))
    print(f"[tandem] {num_out} tokens in {elapsed:.1f}s ({num_out / max(elapsed, 1e-9):.1f} tok/s)", file=sys.stderr)
    return 0
