"""``tandem soak``: a long run that breaks things on purpose, then checks that nothing was lost or held.

    tandem soak --url http://127.0.0.1:8000 --num-requests 2000 --rate 4 --cancel-share 0.2 --out runs/soak
    tandem soak --url ... --kill-decode-every 30 --out runs/chaos

- **Cancels.** A seeded share of the requests is abandoned by the client at a random point: before the
  first token (0 to 1.5 s after sending: queued, prefilling, or while its KV moves to the decode worker)
  or mid-stream (after 1 to all-but-one of its tokens). The connection closes, as a user's would.
- **Kills.** Every ``--kill-decode-every`` seconds a random decode worker gets SIGKILL; the cluster's
  controller replaces it, and its streams go on elsewhere. One failure at a time: a kill waits until the
  pool is whole again. Needs the workers on this host.
- **Checks**, once the run is over and the cluster idle: no request failed (other than those cancelled on
  purpose), no KV block held on any worker, every block pool's invariants hold, and each worker's resident
  memory is within ``--rss-tolerance`` of what it was a tenth of the way into the run (workers that
  lived through both). ``report.json`` has every figure; the exit status is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from loadgen.cli import api_key, first_model
from loadgen.client import ClientConfig, open_session, send_streaming
from loadgen.metrics import RequestRecord, distribution
from loadgen.tokens import TokenText, load_tokenizer
from loadgen.worker_checks import ClusterWorkers, WorkerFacts
from loadgen.workload import LengthSpec, PlannedRequest, WorkloadSpec, build_workload

BEFORE_FIRST_TOKEN_MAX_S = 1.5


@dataclass(frozen=True)
class CancelPoint:
    after_tokens: int  # 0: before the first token, ``delay_s`` after sending
    delay_s: float = 0.0

    @property
    def kind(self) -> str:
        return "before_first_token" if self.after_tokens == 0 else "mid_stream"


def plan_cancels(workload: list[PlannedRequest], share: float, seed: int) -> list[CancelPoint | None]:
    """A third of the cancels before the first token, the rest mid-stream; the same seed, the same plan."""
    rng = random.Random(f"{seed}:cancel")
    plan: list[CancelPoint | None] = []
    for request in workload:
        if rng.random() >= share:
            plan.append(None)
        elif rng.random() < 1 / 3 or (request.max_tokens or 2) < 2:
            plan.append(CancelPoint(0, rng.uniform(0.0, BEFORE_FIRST_TOKEN_MAX_S)))
        else:
            plan.append(CancelPoint(rng.randint(1, (request.max_tokens or 64) - 1)))
    return plan


async def send_until(client: aiohttp.ClientSession, cfg: ClientConfig, request: PlannedRequest, record: RequestRecord,
                     cancel: CancelPoint | None, clock_zero: float) -> bool:
    """Send one request; with a cancel point, abandon it there. True when it was cancelled before its end."""
    messages = [{"role": "user", "content": request.turns[0]}]
    task = asyncio.create_task(send_streaming(client, cfg, record, messages, request.max_tokens, clock_zero))
    if cancel is None:
        await task
        return False
    deadline = time.perf_counter() + cancel.delay_s
    while not task.done():
        due = (len(record.token_times_s) >= cancel.after_tokens if cancel.after_tokens
               else time.perf_counter() >= deadline)
        if due:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            record.error = f"cancelled: on purpose ({cancel.kind}, after {len(record.token_times_s)} tokens)"
            record.end_s = time.perf_counter() - clock_zero
            return True
        await asyncio.sleep(0.005)
    return False


async def run_soak(cfg: ClientConfig, workload: list[PlannedRequest], cancels: list[CancelPoint | None],
                   workers: ClusterWorkers | None, kill_every_s: float, say: Any) -> dict[str, Any]:
    clock_zero = time.perf_counter()
    records = [RequestRecord(index=p.index, arrival_s=p.arrival_s or 0.0, input_tokens=p.input_tokens)
               for p in workload]
    cancelled = [False] * len(workload)
    kills: list[dict[str, Any]] = []
    baseline: dict[str, int] = {}

    async def chaos() -> None:
        assert workers is not None
        rng = random.Random(0)
        while True:
            await asyncio.sleep(kill_every_s)
            while not await asyncio.to_thread(pool_whole, workers, "decode"):  # one failure at a time
                await asyncio.sleep(0.5)
            live = await asyncio.to_thread(workers.ids, "decode")
            if live:
                victim = rng.choice(live)
                pid = await asyncio.to_thread(workers.kill, victim)
                kills.append({"at_s": round(time.perf_counter() - clock_zero, 1), "worker": victim, "pid": pid})
                say(f"killed {victim} (pid {pid}) with SIGKILL")

    async def one(i: int) -> None:
        delay = (workload[i].arrival_s or 0.0) - (time.perf_counter() - clock_zero)
        if delay > 0:
            await asyncio.sleep(delay)
        if workers is not None and i == len(workload) // 10:  # a tenth in: the baseline for memory
            read = await asyncio.to_thread(facts_of_all, workers)
            for _ in range(30):  # None: a kill landed as it read; read again once the cluster has seen it
                if read is not None:
                    break
                await asyncio.sleep(1.0)
                read = await asyncio.to_thread(facts_of_all, workers)
            if read is None:
                raise RuntimeError("no memory baseline: a worker died each time the soak read the pools")
            baseline.update({f.worker_id: f.rss_bytes for f in read})
        cancelled[i] = await send_until(client, cfg, workload[i], records[i], cancels[i], clock_zero)
        done = sum(r.end_s is not None for r in records)
        if done % max(1, len(workload) // 20) == 0:
            say(f"{done}/{len(workload)} done, {sum(cancelled)} cancelled on purpose, "
                f"{sum(not r.ok and not c for r, c in zip(records, cancelled, strict=True) if r.end_s)} failed")

    async with open_session(cfg) as client:
        killer = asyncio.create_task(chaos()) if workers is not None and kill_every_s > 0 else None
        try:
            await asyncio.gather(*(one(i) for i in range(len(workload))))
        finally:
            if killer is not None:
                killer.cancel()
                await asyncio.gather(killer, return_exceptions=True)
    duration = time.perf_counter() - clock_zero
    failed = [r for r, c in zip(records, cancelled, strict=True) if not c and not r.ok]
    kinds = [c.kind for c, was in zip(cancels, cancelled, strict=True) if c is not None and was]
    ok = [r for r in records if r.ok]
    return {"requests": len(records), "seconds": round(duration, 1), "completed": len(ok),
            "cancelled_on_purpose": {k: kinds.count(k) for k in ("before_first_token", "mid_stream")},
            "failed": len(failed), "failures": [r.error for r in failed[:10]], "kills": kills,
            "ttft_ms": distribution([r.ttft_ms for r in ok if r.ttft_ms is not None]),
            "tpot_ms": distribution([t for r in ok if (t := r.tpot_ms) is not None]),
            "rss_baseline": baseline}


def pool_whole(workers: ClusterWorkers, role: str) -> bool:
    """The pool has its target's workers serving, none starting (a killed one has been replaced)."""
    status = workers.status()
    serving = sum(w["healthy"] and w["role"] == role for w in status["workers"])
    return serving >= status["targets"].get(role, 0) and not status["starting"]


def facts_of_all(workers: ClusterWorkers) -> list[WorkerFacts] | None:
    """Every serving worker's facts; None if one died as it was asked (a kill the cluster has not yet seen)."""
    import ray

    try:
        return [workers.facts(w) for w in workers.ids()]
    except (ray.exceptions.RayActorError, ValueError):  # ValueError: get_actor of one already gone
        return None


def settle(workers: ClusterWorkers, wanted: dict[str, int], timeout_s: float, say: Any) -> list[WorkerFacts]:
    """Wait until the pools are back to ``wanted`` and nothing runs or waits; then every worker's facts. A
    worker killed just before (still listed healthy) is waited out until its replacement serves."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = workers.status()
        busy = sum(w["num_running"] + w["num_waiting"] for w in status["workers"])
        late = time.monotonic() > deadline
        if status["pools"] == wanted and not busy and not status["starting"] or late:
            facts = facts_of_all(workers)
            if facts is not None:
                break
            if late:
                raise RuntimeError(f"a worker died as the soak read the pools' state, and they did not settle "
                                   f"within {timeout_s:.0f} s")
        time.sleep(0.5)
    if any(f.blocks_held for f in facts):  # a freed request's blocks go back within a step or two
        time.sleep(2.0)
        facts = facts_of_all(workers) or facts
    say(f"settled: pools {workers.status()['pools']}")
    return facts


def checks(result: dict[str, Any], facts: list[WorkerFacts], tolerance: float) -> dict[str, Any]:
    baseline: dict[str, int] = result.pop("rss_baseline")
    memory: list[dict[str, Any]] = [{"worker": f.worker_id, "rss_mb_baseline": round(baseline[f.worker_id] / 2**20, 1),
               "rss_mb_after": round(f.rss_bytes / 2**20, 1),
               "growth": round(f.rss_bytes / baseline[f.worker_id] - 1, 4)}
              for f in facts if f.worker_id in baseline]
    result["workers_after"] = [asdict(f) for f in facts]
    result["memory"] = memory
    result["checks"] = {"no_failed_requests": result["failed"] == 0,
                        "no_blocks_held": all(f.blocks_held == 0 for f in facts),
                        "block_pools_intact": all(f.integrity_ok for f in facts),
                        "rss_flat": all(m["growth"] <= tolerance for m in memory)}
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="a Tandem router, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None)
    p.add_argument("--api-key", default=None, help="default: $TANDEM_API_KEY, else $OPENAI_API_KEY")
    p.add_argument("--api", default="chat", choices=["chat", "completions"])
    p.add_argument("--rate", type=float, default=2.0, help="requests/s (Poisson arrivals)")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--input-len", default="uniform:32:256")
    p.add_argument("--output-len", default="uniform:8:64")
    p.add_argument("--cancel-share", type=float, default=0.2, help="share of requests the client abandons")
    p.add_argument("--kill-decode-every", type=float, default=0.0, metavar="S",
                   help="SIGKILL a random decode worker every S seconds (0: never)")
    p.add_argument("--rss-tolerance", type=float, default=0.10, help="allowed growth of a worker's memory")
    p.add_argument("--settle-timeout", type=float, default=180.0, help="seconds to wait for an idle cluster")
    p.add_argument("--tokenizer", default=None, help='as tandem loadgen\'s (default: the bundled model)')
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ray-address", default="auto", help="the cluster's Ray (default: the one on this host)")
    p.add_argument("--out", required=True, help="report directory")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0.0 <= args.cancel_share <= 1.0:
        print("tandem soak: error: --cancel-share must be in [0, 1]", file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(f"[soak] {line}", file=sys.stderr, flush=True)

    key = api_key(args)
    spec = WorkloadSpec(num_requests=args.num_requests, input_len=LengthSpec.parse(args.input_len),
                        output_len=LengthSpec.parse(args.output_len), rate=args.rate, seed=args.seed)
    workload = build_workload(spec, TokenText(load_tokenizer(args.tokenizer)))
    cancels = plan_cancels(workload, args.cancel_share, args.seed)
    cfg = ClientConfig(args.url, args.model or first_model(args.url, key), args.api, args.timeout, api_key=key)
    workers = ClusterWorkers(args.url, key, ray_address=args.ray_address)
    wanted = workers.status()["pools"]
    say(f"{len(workload)} requests at {args.rate:g}/s, {sum(c is not None for c in cancels)} to cancel"
        + (f", a decode worker killed every {args.kill_decode_every:g}s" if args.kill_decode_every else "")
        + f"; pools {wanted}")
    result = asyncio.run(run_soak(cfg, workload, cancels, workers, args.kill_decode_every, say))
    result = checks(result, settle(workers, wanted, args.settle_timeout, say), args.rss_tolerance)
    result["config"] = {k: v for k, v in vars(args).items() if k != "api_key"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("requests", "completed", "cancelled_on_purpose", "failed", "kills",
                                              "memory", "checks")}, indent=1))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
