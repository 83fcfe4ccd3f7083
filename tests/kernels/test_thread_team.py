"""The decode step's thread team (kernels/csrc/thread_team.h): its parallel_for splits a range into
at::parallel_for's chunks (so kernels give the same bits in a team and out of one), and an exception in any
thread's chunk comes back to the caller without leaving the team's threads waiting. Its prefetched loops split
as the workers prefetched them, and learn how much to give the leader."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels import cpu_kernel
from tests.threads import torch_threads


@pytest.fixture(scope="module", autouse=True)
def kernel_built() -> None:
    if not cpu_kernel.available():
        pytest.skip(f"the CPU kernels cannot be built here: {cpu_kernel.unavailable_reason()}")


@pytest.fixture
def threads(request: pytest.FixtureRequest):
    with torch_threads(request.param):
        yield request.param


def aten_chunks(n: int, grain: int, threads: int) -> list[int]:
    """at::parallel_for's split of [0, n) (ATen/ParallelOpenMP.h): inline up to the grain, else at most one
    chunk a thread and none smaller than the grain."""
    if n <= grain or threads == 1:
        return [0, n]
    tasks = min(threads, -(-n // grain))
    chunk = -(-n // tasks)
    return [x for b in range(0, n, chunk) for x in (b, min(n, b + chunk))]


@pytest.mark.parametrize("threads", [1, 2, 3], indirect=True)
@pytest.mark.parametrize(("n", "grain"), [(1, 1), (2, 1), (5, 1), (64, 4), (100, 16), (16, 16), (17, 16),
                                          (1000, 256)])
def test_team_chunks_are_aten_chunks(threads: int, n: int, grain: int) -> None:
    assert list(torch.ops.tandem_cpu.team_chunks(n, grain, -1)) == aten_chunks(n, grain, threads)


@pytest.mark.parametrize("threads", [2, 3], indirect=True)
def test_an_error_in_any_chunk_reaches_the_caller_and_the_team_goes_on(threads: int) -> None:
    chunks = aten_chunks(90, 1, threads)
    for begin in chunks[::2]:  # the leader's chunk, then each worker's
        with pytest.raises(RuntimeError, match=f"chunk at {begin} threw"):
            torch.ops.tandem_cpu.team_chunks(90, 1, begin)
        assert list(torch.ops.tandem_cpu.team_chunks(90, 1, -1)) == chunks


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_the_team_can_be_switched_off_for_a_b_runs(threads: int) -> None:
    assert torch.ops.tandem_cpu.set_step_team(False) is True
    try:
        assert list(torch.ops.tandem_cpu.team_chunks(64, 4, -1)) == aten_chunks(64, 4, threads)
    finally:
        assert torch.ops.tandem_cpu.set_step_team(True) is False


@pytest.mark.parametrize("threads", [1, 2, 3], indirect=True)
@pytest.mark.parametrize(("n", "grain"), [(1, 1), (5, 1), (8, 4), (64, 4), (72, 4), (120, 4), (384, 4), (100, 16),
                                          (17, 16)])
def test_each_worker_prefetches_the_rows_its_chunk_will_take(threads: int, n: int, grain: int) -> None:
    """A prefetch plan's shares (thread_team.h) are the chunks of the loop over that target, as the team splits it
    now: a worker pulls into its cache the rows it multiplies next, not its neighbour's."""
    torch.ops.tandem_cpu.reset_team_weights()
    weight = torch.ops.tandem_cpu.team_weight(3)
    shares = list(torch.ops.tandem_cpu.team_prefetch_shares(n, grain, threads, 3))
    assert shares == list(torch.ops.tandem_cpu.team_chunks(n, grain, -1, 3))
    assert shares == list(torch.ops.tandem_cpu.team_split(n, grain, threads, weight))


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize(("n", "grain"), [(1, 1), (5, 1), (8, 4), (120, 4), (384, 4), (100, 16), (17, 16)])
@pytest.mark.parametrize("weight", [0.2, 0.8, 1.0, 1.5])
def test_a_weighted_split_covers_the_range_in_whole_grains(threads: int, n: int, grain: int, weight: float) -> None:
    """The leader's share is cut at whole grains near weight : 1 against each worker's; every thread with a share
    gets at least a grain, and the shares cover the range once, in order."""
    bounds = list(torch.ops.tandem_cpu.team_split(n, grain, threads, weight))
    pairs = list(zip(bounds[::2], bounds[1::2], strict=True))
    assert pairs[0][0] == 0 and pairs[-1][1] == n and all(a[1] == b[0] for a, b in itertools.pairwise(pairs))
    tasks = min(threads, -(-n // grain))
    assert list(torch.ops.tandem_cpu.team_split(n, grain, threads, 0.0)) == aten_chunks(n, grain, tasks)
    if tasks < 2:
        return
    sizes = [end - begin for begin, end in pairs]
    assert sizes[0] % grain == 0 and min(sizes) >= 1, sizes
    if n >= 16 * grain * threads:  # room to cut near the weight: within a grain a share
        worker = (n - sizes[0]) / (tasks - 1)
        assert abs(sizes[0] - weight * worker) <= 2 * grain * (1 + weight), sizes


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_the_leader_s_share_moves_toward_the_faster_side(threads: int) -> None:
    """The team learns each key's split: with the worker's units three times as slow the leader waits, and its
    share grows; with its own slow, the worker finishes first, and its share shrinks."""
    torch.ops.tandem_cpu.reset_team_weights()
    start = torch.ops.tandem_cpu.team_weight(7)
    chunks = list(torch.ops.tandem_cpu.team_chunks(64, 1, -1, 7, 30, 2000, 1))
    assert torch.ops.tandem_cpu.team_weight(7) > start + 0.2
    assert chunks[1] - chunks[0] > chunks[3] - chunks[2], chunks  # the leader now takes more than the worker
    torch.ops.tandem_cpu.team_chunks(64, 1, -1, 9, 30, 2000, 0)
    assert torch.ops.tandem_cpu.team_weight(9) < start - 0.2
    torch.ops.tandem_cpu.reset_team_weights()


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_without_prefetching_a_prefetched_loop_splits_as_aten_does(threads: int) -> None:
    assert torch.ops.tandem_cpu.set_team_prefetch(False) is True
    try:
        assert list(torch.ops.tandem_cpu.team_chunks(120, 4, -1, 3)) == aten_chunks(120, 4, threads)
    finally:
        assert torch.ops.tandem_cpu.set_team_prefetch(True) is False


@pytest.mark.parametrize("threads", [1, 2, 3], indirect=True)
@pytest.mark.parametrize(("n", "grain"), [(1, 1), (5, 1), (8, 4), (120, 4), (6144, 4), (100, 16), (17, 16)])
def test_outside_a_team_a_prefetched_loop_is_shared_in_chunks_of_whole_grains(threads: int, n: int,
                                                                               grain: int) -> None:
    """Outside a team (the logits' matrix after the stack) the threads take a prefetched loop's chunks from a
    shared counter, so a thread the host slows hands its last ones to the other: the chunks cover the range once,
    every cut on a whole grain, in equal chunks, up to 8 a thread; one thread takes it whole."""
    assert torch.ops.tandem_cpu.set_step_team(False) is True
    try:
        bounds = list(torch.ops.tandem_cpu.team_chunks(n, grain, -1, 3))
    finally:
        assert torch.ops.tandem_cpu.set_step_team(True) is False
    pairs = list(zip(bounds[::2], bounds[1::2], strict=True))
    assert pairs[0][0] == 0 and pairs[-1][1] == n and all(a[1] == b[0] for a, b in itertools.pairwise(pairs))
    assert all(begin % grain == 0 for begin, _ in pairs), pairs
    if threads == 1:
        assert pairs == [(0, n)]
    else:
        sizes = [end - begin for begin, end in pairs]
        assert len(set(sizes[:-1])) <= 1 and sizes[-1] <= sizes[0], sizes  # equal chunks, the last the rest
        assert len(pairs) <= 8 * threads, pairs
        if n >= 8 * threads * grain:  # room for many: far more than one a thread
            assert len(pairs) > 4 * threads, pairs


@pytest.mark.parametrize("threads", [2, 3], indirect=True)
def test_outside_a_team_an_error_in_any_chunk_of_a_prefetched_loop_reaches_the_caller(threads: int) -> None:
    assert torch.ops.tandem_cpu.set_step_team(False) is True
    try:
        chunks = list(torch.ops.tandem_cpu.team_chunks(120, 4, -1, 3))
        for begin in chunks[::2]:
            with pytest.raises(RuntimeError, match=f"chunk at {begin} threw"):
                torch.ops.tandem_cpu.team_chunks(120, 4, begin, 3)
        assert list(torch.ops.tandem_cpu.team_chunks(120, 4, -1, 3)) == chunks
    finally:
        assert torch.ops.tandem_cpu.set_step_team(True) is False


@pytest.mark.parametrize("threads", [3], indirect=True)
def test_an_error_in_a_prefetched_loop_reaches_the_caller(threads: int) -> None:
    torch.ops.tandem_cpu.reset_team_weights()
    chunks = list(torch.ops.tandem_cpu.team_chunks(120, 4, -1, 3))
    for begin in chunks[::2]:
        torch.ops.tandem_cpu.reset_team_weights()  # the same split each time
        with pytest.raises(RuntimeError, match=f"chunk at {begin} threw"):
            torch.ops.tandem_cpu.team_chunks(120, 4, begin, 3)


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_the_workers_pull_in_every_line_of_a_kv_job_once(threads: int) -> None:
    """A KV job (thread_team.h): each listed block's used bytes, K's lines and V's, rounded up to whole lines, each
    pulled in by exactly one worker (worker t: blocks t - 1, t - 1 + (threads - 1), ...), none beyond."""
    block_bytes = 16 * 204  # 16 tokens of 3 int8 heads of 64 and their scales
    ids, used = [7, 2, 30, 5, 11], [block_bytes, block_bytes, 204, 5 * 204, block_bytes]
    got = torch.ops.tandem_cpu.team_kv_lines(ids, used, block_bytes, threads)
    lines = [tuple(got[i:i + 3]) for i in range(0, len(got), 3)]
    want = sorted((1 + n % (threads - 1), v, block * block_bytes + o)
                  for n, (block, size) in enumerate(zip(ids, used, strict=True))
                  for v in (0, 1) for o in range(0, size, 64))
    assert sorted(lines) == want
    assert len(set(lines)) == len(lines)
