"""The ``tandem`` command line. Subcommands land here as the cluster grows (serve, scale, status...)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cluster import generate_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    generate_cmd.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
