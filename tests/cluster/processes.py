"""Stopping the processes the cluster tests start: SIGTERM, as a user or Kubernetes would, and on a
hang the stacks of the stuck process in its log before it is killed (``tandem serve`` prints them
on SIGUSR1)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import httpx


class Stopped(NamedTuple):
    rc: int | None  # None: it did not exit within the timeout (then it was killed)
    orphans: bool  # processes of its group outlived it by 30 s (then they were killed)


def start_serve(log: Path, *args: str) -> subprocess.Popen[bytes]:
    """``tandem serve ARGS`` in its own process group, its output in ``log``."""
    return subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", *args], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})


def wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"not ready in {timeout_s:.0f} s"
        time.sleep(0.5)


def process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(proc: subprocess.Popen[bytes], timeout_s: float = 90, dump_stacks: bool = False) -> Stopped:
    """SIGTERM the group leader, wait for it and then for the rest of its group. Nothing of the group
    is left running afterwards, whatever happened."""
    proc.send_signal(signal.SIGTERM)
    rc: int | None
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
        if dump_stacks:  # into its log, for the failure message
            proc.send_signal(signal.SIGUSR1)
            time.sleep(3)
    deadline = time.monotonic() + 30
    while rc is not None and process_group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    orphans = rc is not None and process_group_alive(proc.pid)
    if process_group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    return Stopped(rc, orphans)
