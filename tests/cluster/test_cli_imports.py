"""The operator commands (``tandem scale``, ``status``, ``apply``) start in well under a second: parsing the CLI
and the cluster YAML must not import torch, Ray or Triton (torch alone took ~1.5 s of a 2.8 s ``tandem scale``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_cli_and_config_import_no_torch_ray_or_triton():
    code = ("import sys, cluster.cli, cluster.config; cluster.cli.build_parser(); "
            "print(sorted(m for m in ('torch', 'ray', 'triton') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
