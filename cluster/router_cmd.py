"""``tandem router``: one router alone, joining a running cluster: its Ray cluster (``ray.address``) and its
Redis (``redis.url``), where ``tandem controller`` (or ``tandem serve``) runs the pools. Run several behind a
load balancer; they share what they know through Redis."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cluster.config import ClusterConfig, ConfigError, load_config
from cluster.serve_cmd import add_common_flags, apply_flags, print_resolved


def add_parser(sub: Any) -> None:
    p = sub.add_parser("router", help="an OpenAI-compatible router alone, joining a running Ray cluster and Redis")
    add_common_flags(p)
    p.set_defaults(func=run)


def check(config: ClusterConfig) -> None:
    if config.redis.url is None:
        raise ConfigError("redis.url is required: a router alone shares the cluster's state through the Redis "
                          "its controller uses (--redis or the YAML's redis.url)")


def run(args: argparse.Namespace) -> int:
    from cluster.launcher import RayConnection, say

    try:
        config = apply_flags(load_config(args.config), args)
        check(config)
    except ConfigError as e:
        print(f"tandem router: config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        return print_resolved(config)
    from cluster.router_runner import run_router

    ray_connection = RayConnection(config.ray.address or "auto", config.ray.namespace)
    try:
        ray_connection.start()
        assert config.redis.url is not None
        return run_router(config, config.redis.url, ray_connection, say, "Ctrl-C stops this router")
    finally:
        say("stopping")
        ray_connection.stop()
