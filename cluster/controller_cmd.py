"""``tandem controller``: the pools without a router. It joins a running Ray cluster and Redis, starts the
prefill and decode workers, and keeps them at their targets (``tandem scale``, the autoscaler) until SIGTERM;
``tandem router`` processes serve the requests. On Kubernetes it runs in the Ray head pod (helm/tandem)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from cluster.config import ConfigError, load_config
from cluster.router_cmd import check
from cluster.serve_cmd import add_common_flags, apply_flags, print_resolved


def add_parser(sub: Any) -> None:
    p = sub.add_parser("controller", help="start and keep the prefill and decode pools (no router) on a running "
                       "Ray cluster and Redis")
    add_common_flags(p)
    p.add_argument("--prefill", type=int, help="prefill workers")
    p.add_argument("--decode", type=int, help="decode workers")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cluster.launcher import Launcher, say

    try:
        config = apply_flags(load_config(args.config), args)
        check(config)
        launcher = Launcher(config)
        launcher.check_model()
    except ConfigError as e:
        print(f"tandem controller: config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        return print_resolved(config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        launcher.start()
        say("controller ready: the pools follow their targets (SIGTERM stops them)")
        stop.wait()
        return 0
    finally:
        say("stopping")
        launcher.stop()
