"""``tandem serve``: a whole cluster from one YAML (or the built-in default), until Ctrl-C / SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Any

from cluster.config import ClusterConfig, ConfigError, load_config
from workers.protocol.cluster_keys import ROLES

# After SIGTERM the router gets its grace for in-flight streams; its own shutdown (cancelling what is
# left, closing Redis) then has this long before serve stops the workers and exits regardless.
SHUTDOWN_SLACK_S = 20.0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="start Ray workers, Redis and the OpenAI-compatible router")
    p.add_argument("-c", "--config", help="cluster YAML (default: the built-in local-cpu setup)")
    p.add_argument("--prefill", type=int, help="prefill workers")
    p.add_argument("--decode", type=int, help="decode workers")
    p.add_argument("--host", help="router address")
    p.add_argument("--port", type=int, help="router port")
    p.add_argument("--redis", help="external Redis URL (default: an embedded redis-server)")
    p.add_argument("--ray-address", help="join this Ray cluster instead of starting one")
    p.add_argument("--sim", metavar="PROFILE", help="run every worker as a timing model of this profile "
                   "(tandem profile's JSON): no weights, the profiled step times")
    p.add_argument("--api-key", action="append", help="require 'Authorization: Bearer KEY' on the API (repeatable; "
                   "also TANDEM_API_KEY, YAML router.api_keys)")
    p.add_argument("--admin-key", action="append", help="the key the /cluster/* endpoints need (repeatable; also "
                   "TANDEM_ADMIN_KEY, YAML router.admin_keys; default: the API key)")
    p.set_defaults(func=run)


def apply_flags(config: ClusterConfig, args: argparse.Namespace) -> ClusterConfig:
    """Command-line flags over the YAML, validated like the YAML."""
    from cluster.config import parse_config

    data = config.model_dump()
    for role in ROLES:
        n = getattr(args, role)
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


def run(args: argparse.Namespace) -> int:
    import uvicorn

    # ``kill -USR1 <pid>`` prints every thread's stack to stderr: how to see where a stuck serve is stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    from cluster.launcher import Launcher, say
    from router.app import create_app
    from router.listen import listening_socket
    from router.slo_window import SLOTargets
    from router.state import RouterConfig
    from router.worker_client import RayWorkerClient

    try:
        config = apply_flags(load_config(args.config), args)
        launcher = Launcher(config)
        launcher.check_model()
    except ConfigError as e:
        print(f"tandem serve: config error: {e}", file=sys.stderr)
        return 2
    try:
        launcher.start()
        auth = config.router.auth_config()
        if not auth.enabled and config.router.host not in ("127.0.0.1", "localhost", "::1"):
            say(f"warning: the router listens on {config.router.host} with no API key: anyone who reaches it may "
                "use and scale the cluster (--api-key, TANDEM_API_KEY or router.api_keys)")
        router = RouterConfig(launcher.redis_url, config.name, config.model.path, config.model.served_name,
                              config.router.policy_config(), config.router.approx_ttl_s, auth=auth,
                              max_failovers=config.router.max_failovers,
                              max_request_bytes=config.router.max_request_bytes,
                              client_stall_timeout_s=config.router.client_stall_timeout_s,
                              slo=SLOTargets(config.slo.ttft_ms / 1000, config.slo.tpot_ms / 1000))
        app = create_app(router, RayWorkerClient(config.ray.namespace))
        server = uvicorn.Server(uvicorn.Config(app, host=config.router.host, port=config.router.port,
                                               log_level="warning",
                                               timeout_graceful_shutdown=config.router.shutdown_grace_s))
        url = f"http://{config.router.host}:{config.router.port}"
        threading.Thread(target=_announce, args=(server, url, say), daemon=True).start()
        router_done = threading.Event()
        threading.Thread(target=bounded_shutdown, daemon=True, args=(
            server, router_done, config.router.shutdown_grace_s + SHUTDOWN_SLACK_S, launcher, say)).start()
        sock = listening_socket(config.router.host, config.router.port)
        try:
            server.run(sockets=[sock])  # returns on Ctrl-C / SIGTERM after a graceful shutdown ...
        except (KeyboardInterrupt, SystemExit) as e:
            # ... and then re-raises the signal, which Ray's driver handler turns into sys.exit(signum).
            if isinstance(e, SystemExit) and e.code not in (signal.SIGTERM, signal.SIGINT):
                raise
        finally:
            router_done.set()
            sock.close()
        return 0 if server.started else 1
    finally:
        say("stopping")
        launcher.stop()


def _announce(server: Any, url: str, say: Any) -> None:
    while not server.started and not server.should_exit:
        time.sleep(0.05)
    if server.started:
        say(f"ready: {url}  (OpenAI API under {url}/v1; Ctrl-C stops everything)")


def bounded_shutdown(server: Any, router_done: threading.Event, limit_s: float, launcher: Any, say: Any,
                      exit_process: Any = os._exit) -> None:
    """Once a shutdown begins, it ends within ``limit_s``: past that, the router's pending tasks and every
    thread's stack go to stderr (to find what hung), the workers and Redis are stopped, and the process
    exits. An operator's SIGTERM must never leave a serve (or its workers) running."""
    while not server.should_exit:
        if router_done.wait(0.2):
            return
    if router_done.wait(limit_s):
        return  # the normal path: the main thread stops the workers
    say(f"shutdown still not done after {limit_s:.0f} s; what is pending:")
    try:
        loop = server.servers[0].get_loop() if server.servers else None
        for task in asyncio.all_tasks(loop) if loop is not None else ():  # read from another thread: diagnostics only
            task.print_stack(file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - the dump is best effort; the exit is not
        print(f"(could not list the router's tasks: {e!r})", file=sys.stderr)
    faulthandler.dump_traceback(all_threads=True)
    say("stopping")
    launcher.stop()
    exit_process(0)
