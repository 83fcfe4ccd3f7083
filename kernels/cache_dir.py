"""Where Tandem keeps what it builds once per machine (converted models, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$TANDEM_CACHE_DIR``, else (unset or empty: never the working directory) ``~/.cache/tandem``."""
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")
