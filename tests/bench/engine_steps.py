"""What the engine benches share: bringing a batch to its decode steps, and timing parts of a step."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from kernels import cpu_kernel
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine


def step_bench_options(doc: str | None, *, rounds: int = 3, steps: int = 30,
                       switches: dict[str, str] | None = None) -> argparse.Namespace:
    """The command line every engine-step bench takes: --rounds, --steps (each a median's samples) and --threads
    (default: every CPU), with the bench's docstring as its help; ``switches``: a bench's own on/off flags (name:
    help)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    for name, help_text in (switches or {}).items():
        parser.add_argument(f"--{name}", action="store_true", help=help_text)
    return parser.parse_args()


def compiled_cpu_engine(threads: int) -> Engine:
    """The default model's engine on ``threads`` threads, its GGUF weights on the compiled CPU kernels (no prefix
    cache: every prompt is new); exits with the reason where the kernels do not build."""
    torch.set_num_threads(threads)
    if not cpu_kernel.available():
        sys.exit(f"the compiled CPU kernels are unavailable: {cpu_kernel.unavailable_reason()}")
    return Engine(EngineConfig(weight_format="gguf", num_kv_blocks=1024, enable_prefix_caching=False))


def prefill_all(engine: Engine) -> None:
    """Step until every request is admitted and a step runs decodes alone."""
    while True:
        result = engine.step()
        if result.num_tokens == 0:
            raise RuntimeError("a step ran nothing: the requests cannot all be admitted (KV blocks, max_num_seqs)")
        if not engine.scheduler.waiting and result.is_decode_only:
            return


class PartTimer:
    """Host seconds spent inside named methods (``{name: (object, method name)}``), summed over calls; each
    method is replaced on its object by a timed wrapper."""

    def __init__(self, parts: dict[str, tuple[Any, str]]):
        self.seconds = dict.fromkeys(parts, 0.0)
        for name, (owner, attr) in parts.items():
            setattr(owner, attr, self._timed(name, getattr(owner, attr)))

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - t0
            return out
        return timed
