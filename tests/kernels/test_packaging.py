"""The CPU kernels are compiled where they run, from the installed package: every source and header in
``kernels/csrc`` must be package data, or a non-editable install (the container image's ``pip install .``)
fails to build them."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_source_and_header_is_package_data() -> None:
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kernels"]
    csrc = ROOT / "kernels" / "csrc"
    shipped = {p for pattern in patterns for p in (ROOT / "kernels").glob(pattern)}
    files = {p for p in csrc.iterdir() if p.is_file()}
    assert files and files <= shipped, sorted(p.name for p in files - shipped)
