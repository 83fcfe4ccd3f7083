"""The embedded Redis of ``tandem serve``: a real server, and never an orphan."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from cluster.embedded_redis import EmbeddedRedis

ROOT = str(Path(__file__).resolve().parents[2])


def test_serves_and_stops():
    with EmbeddedRedis() as url:
        client = redis.Redis.from_url(url)
        client.set("k", b"v")
        assert client.get("k") == b"v"
    with pytest.raises(redis.ConnectionError):
        client.ping()


def test_a_killed_parent_takes_its_redis_server_along():
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from cluster.embedded_redis import EmbeddedRedis; "
            "r = EmbeddedRedis(); print(r.process.pid, flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", code, ROOT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    os.kill(pid, 0)  # running
    parent.send_signal(signal.SIGKILL)  # no chance to clean up
    parent.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}"), "redis-server outlived the process that started it"
