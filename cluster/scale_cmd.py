"""``tandem scale`` and ``tandem apply``: change the pools of a running cluster through a router.

    tandem scale decode=2 [--url URL] [--wait]     # one or both pools to a size
    tandem apply -c deploy/local-cpu.yaml [--wait] # the file's pool sizes and bounds

The router writes the new targets to Redis; the controller in ``tandem serve`` starts workers or
drains them (a drained worker finishes its in-flight requests before it exits). ``--wait`` follows
the pools until they match. ``apply`` changes pools only: any other difference between the file and
the running config is refused with the keys named (they need a restart).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import httpx

from cluster.admin_client import add_key_argument, auth_headers
from cluster.config import ConfigError, load_config
from workers.protocol.cluster_keys import ROLES

LIVE_KEYS = ("replicas", "min_replicas", "max_replicas")  # what a running cluster can change
# Keys often come from the environment or flags, not the file, and show only as **********: never compared.
SECRET_PATHS = ("router.api_keys", "router.admin_keys")


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("scale", help="resize the pools of a running cluster, e.g. decode=2")
    p.add_argument("sizes", nargs="+", metavar="ROLE=N", help="prefill=N and/or decode=M")
    _common(p)
    p.set_defaults(func=run_scale)
    p = sub.add_parser("apply", help="apply a cluster YAML's pool sizes to a running cluster")
    p.add_argument("-c", "--config", required=True, help="cluster YAML")
    _common(p)
    p.set_defaults(func=run_apply)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a router of the cluster")
    p.add_argument("--wait", action="store_true", help="return once the pools match (workers ready or drained)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds --wait waits at most")
    add_key_argument(p)


class CommandError(Exception):
    """One line for stderr; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def parse_sizes(sizes: list[str]) -> dict[str, dict[str, int]]:
    changes: dict[str, dict[str, int]] = {}
    for item in sizes:
        role, _, value = item.partition("=")
        if role not in ROLES or not value.isdigit():
            raise CommandError(f"expected prefill=N or decode=N (N >= 0), got {item!r}")
        changes[role] = {"replicas": int(value)}
    return changes


def live_changes(running: dict[str, Any], wanted: dict[str, Any]) -> tuple[dict[str, dict[str, int]], list[str]]:
    """The pool changes a running cluster takes, and every other key that differs (needs a restart)."""
    pools = {role: {k: wanted[role][k] for k in LIVE_KEYS} for role in ROLES}
    others = [f"{path} ({old!r} -> {new!r})" for path, old, new in _differences(running, wanted)
              if path not in SECRET_PATHS
              and not (path.split(".")[0] in ROLES and path.split(".")[-1] in LIVE_KEYS and path.count(".") == 1)]
    return pools, others


def _differences(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(a.keys() | b.keys())
                for d in _differences(a.get(k), b.get(k), f"{path}.{k}" if path else k)]
    return [] if a == b else [(path, a, b)]


def run_scale(args: argparse.Namespace) -> int:
    return _run("scale", args, lambda client: parse_sizes(args.sizes))


def run_apply(args: argparse.Namespace) -> int:
    def changes(client: httpx.Client) -> dict[str, dict[str, int]]:
        try:
            wanted = load_config(args.config)
        except ConfigError as e:
            raise CommandError(f"config error: {e}") from None
        pools, others = live_changes(_call(client, "GET", "/cluster/config"), wanted.model_dump(mode="json"))
        if others:
            raise CommandError("cannot change on a running cluster (restart tandem serve with this file): "
                               + ", ".join(others))
        return pools

    return _run("apply", args, changes)


def _run(name: str, args: argparse.Namespace, changes: Any) -> int:
    with httpx.Client(base_url=args.url.rstrip("/"), timeout=30, headers=auth_headers(args)) as client:
        try:
            targets = _call(client, "POST", "/cluster/scale", changes(client))["targets"]
            replicas = {role: targets[role]["replicas"] for role in ROLES if role in targets}
            print("targets: " + ", ".join(f"{role} {n}" for role, n in replicas.items()))
            if args.wait:
                _wait(client, replicas, args.timeout)
        except CommandError as e:
            print(f"tandem {name}: {e}", file=sys.stderr)
            return e.code
    return 0


def _call(client: httpx.Client, method: str, path: str, body: Any = None) -> Any:
    try:
        response = client.request(method, path, json=body)
    except httpx.HTTPError as e:
        raise CommandError(f"cannot reach a router at {client.base_url}: {e}") from None
    if response.is_error:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        raise CommandError(message, 2 if response.status_code < 500 else 1)
    return response.json()


def _wait(client: httpx.Client, targets: dict[str, int], timeout_s: float) -> None:
    """Print each change of the pools until the live workers match the targets."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        status = _call(client, "GET", "/cluster/status")
        line = ", ".join(f"{role} {status['pools'][role]}/{n}" for role, n in targets.items())
        busy = status["starting"] + status["draining"]
        line += f" (starting: {', '.join(status['starting']) or '-'}; draining: {', '.join(status['draining']) or '-'})"
        if line != last:
            print(line, flush=True)
            last = line
        if not busy and all(status["pools"][role] == n for role, n in targets.items()):
            return
        if time.monotonic() > deadline:
            raise CommandError(f"the pools did not match the targets within {timeout_s:.0f}s", 1)
        time.sleep(0.5)
