"""``tandem status``: pools and per-worker load of a running cluster, from its router."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import httpx

from cluster.admin_client import add_key_argument, auth_headers


def add_parser(sub: Any) -> None:
    p = sub.add_parser("status", help="pools and workers of a running cluster")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a router of the cluster")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_key_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        response = httpx.get(f"{args.url.rstrip('/')}/cluster/status", timeout=10, headers=auth_headers(args))
        response.raise_for_status()
    except httpx.HTTPError as e:
        print(f"tandem status: cannot reach a router at {args.url}: {e}", file=sys.stderr)
        return 2
    status = response.json()
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    pools = ", ".join(f"{n} {role}" for role, n in status["pools"].items())
    print(f"cluster {status['cluster']}, model {status['model']}: {pools}")
    print(f"{'worker':<16} {'role':<8} {'health':<8} {'running':>7} {'waiting':>7} {'KV used/total':>15} "
          f"{'hit tokens':>11}")
    for w in status["workers"]:
        kv = f"{w['kv_blocks_used']}/{w['kv_blocks_total']}"
        print(f"{w['id']:<16} {w['role']:<8} {'ok' if w['healthy'] else 'stale':<8} {w['num_running']:>7} "
              f"{w['num_waiting']:>7} {kv:>15} {w['prefix_cache_hit_tokens']:>11}")
    _print_slo(status.get("slo"))
    _print_autoscaler(status.get("autoscaler"))
    return 0


def _print_slo(slo: dict[str, Any] | None) -> None:
    if not slo:
        return
    window = slo.get("cluster") or slo["router"]
    attainment = "-" if window["attainment"] is None else f"{window['attainment']:.1%}"
    print(f"SLO TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms; last {window['window_s']:g} s: "
          f"{window['arrival_rps']:g} req/s in, attainment {attainment}, goodput {window['goodput_rps']:g} req/s, "
          f"mean TTFT {window['mean_ttft_ms']} ms, TPOT {window['mean_tpot_ms']} ms, "
          f"queue {window['mean_queue_ms']} ms")


def _print_autoscaler(scaler: dict[str, Any] | None) -> None:
    if not scaler:
        return
    corrections = scaler["corrections"]
    print(f"autoscaler every {scaler['interval_s']:g} s: needs {scaler['needed'] or '-'}, corrections TTFT "
          f"x{corrections['ttft']}, TPOT x{corrections['tpot']}")
    for d in scaler["decisions"][-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(d["at"]))
        print(f"  {when} {d['role']} {d['from']} -> {d['to']}: {d['reason']}")
