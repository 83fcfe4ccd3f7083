"""Run one OpenAI-compatible router until Ctrl-C / SIGTERM: what ``tandem serve`` (beside its pools) and
``tandem router`` (alone, joining a running cluster) share."""

from __future__ import annotations

import asyncio
import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Any, Protocol

from cluster.config import ClusterConfig

# After SIGTERM the router gets its grace for in-flight streams; its own shutdown (cancelling what is
# left, closing Redis) then has this long before the process stops what it started and exits regardless.
SHUTDOWN_SLACK_S = 20.0


class Stoppable(Protocol):
    def stop(self) -> None: ...


def run_router(config: ClusterConfig, redis_url: str, owned: Stoppable, say: Any, done_hint: str) -> int:
    """Serve the router on ``config.router``'s address; ``owned`` (the workers, or the Ray connection) is
    stopped by the caller after a normal shutdown, or by the shutdown watchdog when shutdown hangs."""
    import uvicorn

    from router.app import create_app
    from router.listen import listening_socket
    from router.slo_window import SLOTargets
    from router.state import RouterConfig
    from router.worker_client import RayWorkerClient

    # ``kill -USR1 <pid>`` prints every thread's stack to stderr: how to see where a stuck process is stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    auth = config.router.auth_config()
    if not auth.enabled and config.router.host not in ("127.0.0.1", "localhost", "::1"):
        say(f"warning: the router listens on {config.router.host} with no API key: anyone who reaches it may "
            "use and scale the cluster (--api-key, TANDEM_API_KEY or router.api_keys)")
    router = RouterConfig(redis_url, config.name, config.model.path, config.model.served_name,
                          config.router.policy_config(), config.router.approx_ttl_s, auth=auth,
                          max_failovers=config.router.max_failovers,
                          max_request_bytes=config.router.max_request_bytes,
                          client_stall_timeout_s=config.router.client_stall_timeout_s,
                          slo=SLOTargets(config.slo.ttft_ms / 1000, config.slo.tpot_ms / 1000))
    app = create_app(router, RayWorkerClient(config.ray.namespace))
    server = uvicorn.Server(uvicorn.Config(app, host=config.router.host, port=config.router.port, log_level="warning",
                                           timeout_graceful_shutdown=config.router.shutdown_grace_s))
    url = f"http://{config.router.host}:{config.router.port}"
    threading.Thread(target=_announce, args=(server, url, done_hint, say), daemon=True).start()
    router_done = threading.Event()
    threading.Thread(target=bounded_shutdown, daemon=True, args=(
        server, router_done, config.router.shutdown_grace_s + SHUTDOWN_SLACK_S, owned, say)).start()
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


def _announce(server: Any, url: str, done_hint: str, say: Any) -> None:
    while not server.started and not server.should_exit:
        time.sleep(0.05)
    if server.started:
        say(f"ready: {url}  (OpenAI API under {url}/v1; {done_hint})")


def bounded_shutdown(server: Any, router_done: threading.Event, limit_s: float, owned: Stoppable, say: Any,
                     exit_process: Any = os._exit) -> None:
    """Once a shutdown begins, it ends within ``limit_s``: past that, the router's pending tasks and every
    thread's stack go to stderr (to find what hung), what the process started is stopped, and the process
    exits. An operator's SIGTERM must never leave a router (or its workers) running."""
    while not server.should_exit:
        if router_done.wait(0.2):
            return
    if router_done.wait(limit_s):
        return  # the normal path: the main thread stops what it started
    say(f"shutdown still not done after {limit_s:.0f} s; what is pending:")
    try:
        loop = server.servers[0].get_loop() if server.servers else None
        for task in asyncio.all_tasks(loop) if loop is not None else ():  # read from another thread: diagnostics only
            task.print_stack(file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - the dump is best effort; the exit is not
        print(f"(could not list the router's tasks: {e!r})", file=sys.stderr)
    faulthandler.dump_traceback(all_threads=True)
    say("stopping")
    owned.stop()
    exit_process(0)
