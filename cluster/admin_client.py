"""The key the ``tandem status`` / ``scale`` / ``apply`` commands send to a router that wants one."""

from __future__ import annotations

import argparse
import os


def add_key_argument(p: argparse.ArgumentParser) -> None:
    # No default shown: --help must never print a key taken from the environment.
    p.add_argument("--api-key", default=None,
                   help="the router's admin key (default: $TANDEM_ADMIN_KEY, else $TANDEM_API_KEY)")


def auth_headers(args: argparse.Namespace) -> dict[str, str]:
    key = args.api_key or os.environ.get("TANDEM_ADMIN_KEY") or os.environ.get("TANDEM_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}
