"""``tandem serve``: a whole cluster from one YAML (or the built-in default), until Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import yaml

from cluster.config import ClusterConfig, ConfigError, load_config
from workers.protocol.cluster_keys import ROLES


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="start Ray workers, Redis and the OpenAI-compatible router")
    add_common_flags(p)
    p.add_argument("--prefill", type=int, help="prefill workers")
    p.add_argument("--decode", type=int, help="decode workers")
    p.add_argument("--sim", metavar="PROFILE", help="run every worker as a timing model of this profile "
                   "(tandem profile's JSON): no weights, the profiled step times")
    p.set_defaults(func=run)


def add_common_flags(p: argparse.ArgumentParser) -> None:
    """The flags ``serve``, ``router`` and ``controller`` share."""
    p.add_argument("-c", "--config", help="cluster YAML (default: the built-in local-cpu setup)")
    p.add_argument("--dry-run", action="store_true", help="check the config (and the model it names), print it "
                   "resolved, and exit: 0 if it is good, 2 with the one-line error if not")
    p.add_argument("--host", help="router address")
    p.add_argument("--port", type=int, help="router port")
    p.add_argument("--redis", help="external Redis URL (default: an embedded redis-server)")
    p.add_argument("--ray-address", help="join this Ray cluster instead of starting one")
    p.add_argument("--api-key", action="append", help="require 'Authorization: Bearer KEY' on the API (repeatable; "
                   "also TANDEM_API_KEY, YAML router.api_keys)")
    p.add_argument("--admin-key", action="append", help="the key the /cluster/* endpoints need (repeatable; also "
                   "TANDEM_ADMIN_KEY, YAML router.admin_keys; default: the API key)")


def print_resolved(config: ClusterConfig) -> int:
    """--dry-run's output: the config as it would run, every default filled in (keys masked)."""
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def apply_flags(config: ClusterConfig, args: argparse.Namespace) -> ClusterConfig:
    """Command-line flags over the YAML, validated like the YAML."""
    from cluster.config import parse_config

    data = config.model_dump()
    for role in ROLES:
        n = getattr(args, role, None)
        if n is not None:
            pool = data[role]
            pool["replicas"] = n
            pool["min_replicas"] = min(pool["min_replicas"], n)
            pool["max_replicas"] = max(pool["max_replicas"], n, 1)
    for flag, section, key in (("host", "router", "host"), ("port", "router", "port"), ("redis", "redis", "url"),
                               ("ray_address", "ray", "address")):
        if getattr(args, flag) is not None:
            data[section][key] = getattr(args, flag)
    if getattr(args, "sim", None) is not None:
        data["sim_profile"] = args.sim
    for flag, env, key in (("api_key", "TANDEM_API_KEY", "api_keys"), ("admin_key", "TANDEM_ADMIN_KEY", "admin_keys")):
        data["router"][key] = [*data["router"][key], *(getattr(args, flag, None) or []),
                               *([os.environ[env]] if os.environ.get(env) else [])]
    return parse_config(data)


def pinned_instruction_set() -> None:
    """A misspelt TANDEM_CPU_ISA stops ``tandem serve`` here, in one line, not in every worker it starts."""
    from kernels import cpu_kernel

    try:
        cpu_kernel.pinned_instruction_set()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    from cluster.launcher import Launcher, say
    from cluster.router_runner import run_router

    try:
        config = apply_flags(load_config(args.config), args)
        launcher = Launcher(config)
        launcher.check_model()
        pinned_instruction_set()
    except ConfigError as e:
        print(f"tandem serve: config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        return print_resolved(config)
    try:
        launcher.start()
        return run_router(config, launcher.redis_url, launcher, say, "Ctrl-C stops everything")
    finally:
        say("stopping")
        launcher.stop()
