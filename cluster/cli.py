"""The ``tandem`` command line. Subcommands land here as the cluster grows (serve, scale, status...)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cluster import controller_cmd, generate_cmd, plan_cmd, profile_cmd, router_cmd, scale_cmd, serve_cmd, status_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    generate_cmd.add_parser(sub)
    serve_cmd.add_parser(sub)
    router_cmd.add_parser(sub)
    controller_cmd.add_parser(sub)
    status_cmd.add_parser(sub)
    profile_cmd.add_parser(sub)
    plan_cmd.add_parser(sub)
    scale_cmd.add_parsers(sub)
    sub.add_parser("loadgen", help="goodput under SLOs against any OpenAI-compatible server (see --help)",
                   add_help=False)
    sub.add_parser("soak", help="a long run with cancels and worker kills, then leak checks (see --help)",
                   add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["loadgen"]:  # loadgen stands alone and parses its own flags
        from loadgen.cli import main as loadgen_main

        return loadgen_main(argv[1:])
    if argv[:1] == ["soak"]:
        from loadgen.soak import main as soak_main

        return soak_main(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
