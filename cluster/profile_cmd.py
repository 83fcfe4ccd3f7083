"""``tandem profile``: measure this machine's engine (as a pool of the cluster YAML runs it) into a
timing profile for ``tandem serve --sim`` and ``tandem plan`` (``cluster/profiler.py`` says what is timed)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cluster.config import ConfigError, load_config


def add_parser(sub: Any) -> None:
    p = sub.add_parser("profile", help="measure this machine's engine into a timing profile (JSON)")
    p.add_argument("-c", "--config", default=None, help="cluster YAML whose pool is profiled (default: built-in)")
    p.add_argument("--role", choices=("decode", "prefill"), default="decode",
                   help="the pool whose engine settings and threads are used")
    p.add_argument("--out", default="profile.json", help="where the profile goes")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from cluster.profiler import measure_profile

    try:
        config = load_config(args.config)
    except ConfigError as e:
        print(f"tandem profile: {e}", file=sys.stderr)
        return 2
    resources = config.worker_resources(args.role)
    torch.set_num_threads(resources.engine_threads)  # what the pool's worker's engine thread runs on
    engine_config = config.engine_config(args.role)
    engine_config.max_queue_len = engine_config.max_queue_time_s = None  # offline: nothing is shed

    def say(line: str) -> None:
        print(f"[tandem profile] {line}", file=sys.stderr, flush=True)

    say(f"profiling the {args.role} pool's engine on {resources.engine_threads} threads")
    profile = measure_profile(engine_config, say)
    profile.save(args.out)
    say(f"wrote {args.out} in {profile.seconds_to_measure:.0f}s")
    return 0
