"""Drive a workload against a server: open loop (arrival schedule) or closed loop (concurrency).

Records are appended to a caller-owned list as requests start, so an interrupted run (Ctrl-C)
still has every request it sent; those cut off are marked ``cancelled``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from loadgen.client import ClientConfig, open_session, send_streaming
from loadgen.metrics import RequestRecord, distribution
from loadgen.workload import PlannedRequest

ProgressFn = Callable[[list[RequestRecord], int], None]


async def run_workload(cfg: ClientConfig, workload: list[PlannedRequest], records: list[RequestRecord], *,
                       concurrency: int | None = None, duration_s: float | None = None,
                       progress: ProgressFn | None = None) -> float:
    """Run until every conversation is done or ``duration_s`` has passed; returns the run's seconds."""
    clock_zero = time.perf_counter()
    total = sum(len(p.turns) for p in workload)
    async with open_session(cfg) as client:

        async def conversation(plan: PlannedRequest, arrival_s: float) -> None:
            history: list[dict[str, str]] = [{"role": "system", "content": plan.system}] if plan.system else []
            for turn, user_text in enumerate(plan.turns):
                history.append({"role": "user", "content": user_text})
                record = RequestRecord(index=len(records), arrival_s=arrival_s,
                                       input_tokens=plan.input_tokens if turn == 0 else 0)
                records.append(record)
                try:
                    answer = await send_streaming(client, cfg, record, list(history), plan.max_tokens, clock_zero)
                except asyncio.CancelledError:
                    record.error = record.error or "cancelled: the run was interrupted"
                    raise
                if progress:
                    progress(records, total)
                if not record.ok:
                    return  # a broken conversation stops; its later turns are never sent
                history.append({"role": "assistant", "content": answer})
                arrival_s = time.perf_counter() - clock_zero  # the next turn arrives when this one ends

        def expired() -> bool:
            return duration_s is not None and time.perf_counter() - clock_zero >= duration_s

        tasks: list[asyncio.Task[None]] = []
        try:
            if concurrency:
                queue: asyncio.Queue[PlannedRequest] = asyncio.Queue()
                for plan in workload:
                    queue.put_nowait(plan)

                async def worker() -> None:
                    while not queue.empty() and not expired():
                        await conversation(queue.get_nowait(), time.perf_counter() - clock_zero)

                tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
            else:
                for plan in workload:
                    assert plan.arrival_s is not None
                    delay = plan.arrival_s - (time.perf_counter() - clock_zero)
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if expired():
                        break
                    tasks.append(asyncio.create_task(conversation(plan, plan.arrival_s)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return time.perf_counter() - clock_zero


def progress_line(records: list[RequestRecord], total: int) -> str:
    done = [r for r in records if r.end_s is not None]
    ok = [r for r in done if r.ok]
    ttft = distribution([r.ttft_ms for r in ok if r.ttft_ms is not None])
    tpot = distribution([t for r in ok if (t := r.tpot_ms) is not None])

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    return (f"{len(done)}/{total} done, {len(done) - len(ok)} errors | TTFT p50 {fmt(ttft['p50'])} "
            f"p90 {fmt(ttft['p90'])} ms | TPOT p50 {fmt(tpot['p50'])} p90 {fmt(tpot['p90'])} ms")


class LiveProgress:
    """A rich progress bar with the running TTFT/TPOT percentiles and error count."""

    def __init__(self, total: int, enabled: bool = True):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.enabled = enabled
        self.progress = Progress(BarColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                 disable=not enabled, transient=False)
        self.task = self.progress.add_task("starting", total=total)

    def __enter__(self) -> LiveProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def __call__(self, records: list[RequestRecord], total: int) -> None:
        done = sum(r.end_s is not None for r in records)
        self.progress.update(self.task, completed=done, total=total, description=progress_line(records, total))
