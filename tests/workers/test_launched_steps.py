"""Decode steps launched without waiting (``Engine.step`` on a GPU: a CUDA-graph replay sampled by argmax), the
next step queued behind each before its tokens are read (follow-on steps). Here the graphs are eager forwards
over the graphs' own buffers (``EagerDecodeGraphs``), so the engine takes the launched path on CPU, its attention
the compiled CPU kernel where it builds (``CPU_ATTENTION``: interpreted Triton kernels made this module ~2 minutes;
test_decode_graphs.py reads the graphs' padding through them); ``test_engine_cuda.py`` runs real graphs."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TypeVar

import pytest

from tests.tiny_model import tiny_model
from tests.workers.test_decode_graphs import CPU_ATTENTION, EagerDecodeGraphs
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine, StepResult
from workers.engine.model_runner import LaunchedStep
from workers.engine.scheduler import SchedulerOutput
from workers.protocol.sampling_params import SamplingParams

T = TypeVar("T")


@pytest.fixture(scope="module")
def model_and_tokenizer(default_model_and_tokenizer):
    return tiny_model(seed=7, max_positions=512), default_model_and_tokenizer[1]


def make_engine(model_and_tokenizer, launched: bool, num_kv_blocks: int = 200, max_num_seqs: int = 8,
                ) -> tuple[Engine, list[bool]]:
    """An engine, and a list that grows by one for each step it launched: whether it was a follow-on step
    (planned before the step it follows was read, its inputs that step's tokens on the device)."""
    model, tokenizer = model_and_tokenizer
    config = EngineConfig(num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs, attention_backend=CPU_ATTENTION,
                          prefill_chunk_size=32)
    engine = Engine(config, model=model, tokenizer=tokenizer)
    launches: list[bool] = []
    if launched:
        graphs = EagerDecodeGraphs(model, engine.runner.kv_cache, block_size=16, max_batch=max_num_seqs,
                                   max_model_len=512, backend=CPU_ATTENTION)
        graphs.capture()
        engine.runner.decode_graphs = graphs
        launches = record_launches(engine, lambda out: out.fed_from is not None)
    return engine, launches


def record_launches(engine: Engine, record: Callable[[SchedulerOutput], T]) -> list[T]:
    """What ``record`` says of each step ``engine`` launches, in order (its runner's ``launch`` wrapped)."""
    seen: list[T] = []
    launch = engine.runner.launch

    def recorded(out: SchedulerOutput, fed_by: LaunchedStep | None = None) -> LaunchedStep:
        seen.append(record(out))
        return launch(out, fed_by)

    engine.runner.launch = recorded  # type: ignore[method-assign]
    return seen


def test_launched_steps_give_the_synchronous_outputs(model_and_tokenizer):
    """Requests that end by max_tokens, by a stop token id and by a stop string (found a step late there: the
    token sampled meanwhile is dropped) give the same tokens, text and finish reasons either way."""
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 60))] for _ in range(6)]
    plain = [SamplingParams(max_tokens=12 + 4 * i, temperature=0, ignore_eos=True) for i in range(6)]
    free = make_engine(model_and_tokenizer, launched=False)[0].generate(prompts, plain)
    # Finishes that come before max_tokens, taken from what the model writes.
    stop_id = free[1].token_ids[5]
    text = free[2].text  # a stop string of visible text from its second half
    stop_text = next(text[i : i + 3] for i in range(len(text) // 2, len(text) - 2) if text[i : i + 3].strip())
    params = list(plain)
    params[1] = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    params[2] = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop_text])
    expected = make_engine(model_and_tokenizer, launched=False)[0].generate(prompts, params)
    engine, launches = make_engine(model_and_tokenizer, launched=True)
    got = engine.generate(prompts, params)
    assert len(launches) >= 20, "the decode steps were launched"
    assert sum(launches) >= 15, "most were queued behind the step before them, fed its tokens on the device"
    assert [r.finish_reason for r in got] == [r.finish_reason for r in expected]
    assert got[1].finish_reason == got[2].finish_reason == "stop" and len(got[1].token_ids) < 30
    for a, b in zip(got, expected, strict=True):
        assert (a.token_ids, a.text) == (b.token_ids, b.text)
    assert engine.block_pool.num_used_blocks == 0 and not engine.has_unfinished


def run_with_arrivals(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    """Each request's tokens, the requests arriving in three waves (the next once the engine has given as many
    outputs as it has requests): steps that follow on from a launched one meet requests that joined."""
    tokens: dict[str, list[int]] = {}
    waves = [(0, 2), (2, 4), (4, len(prompts))]
    num_outputs = 0
    for first, end in waves:
        for i in range(first, end):
            tokens[engine.add_request(prompts[i], params[i], request_id=f"r{i}")] = []
        while engine.has_unfinished and num_outputs < 2 * len(tokens):
            for out in engine.step().outputs:
                tokens[out.request_id] += out.new_token_ids
                num_outputs += 1
    while engine.has_unfinished:
        for out in engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids
    return tokens


def test_follow_on_steps_meet_arrivals_a_full_batch_and_a_short_pool(model_and_tokenizer):
    """Requests joining mid-run take a full schedule; so does a short pool (8 blocks for 3 requests of up to
    4: preemptions), while requests waiting behind a full batch (3 running of 7) do not stop follow-on steps.
    The tokens are those of synchronous steps, and every block comes back."""
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(20, 40))] for _ in range(7)]
    params = [SamplingParams(max_tokens=rng.randint(8, 24), temperature=0, ignore_eos=True) for _ in prompts]
    expected = run_with_arrivals(make_engine(model_and_tokenizer, False, 8, 3)[0], prompts, params)
    engine, launches = make_engine(model_and_tokenizer, True, 8, 3)
    got = run_with_arrivals(engine, prompts, params)
    assert got == expected
    assert [len(got[f"r{i}"]) for i in range(7)] == [p.max_tokens for p in params]
    assert sum(launches) >= 10 and len(launches) - sum(launches) >= 2, "both kinds of launch were taken"
    assert engine.scheduler.preemptions_by_cause["decode"] > 0, "the pool ran short"
    assert engine.block_pool.num_used_blocks == 0 and not engine.has_unfinished


def hand_off_while_decoding(prefill: Engine, decode: Engine, prompts: list[list[int]], params: list[SamplingParams],
                            ) -> tuple[list[list[int]], list[int]]:
    """Each request's tokens, prefilled on ``prefill`` and committed to ``decode`` one after another while
    ``decode`` steps on (its KV copied block by block, as a transport would), and per launched step how many
    of its rows joined with their own token since the step before (``decode``'s launches are counted)."""
    joined_rows = record_launches(decode, lambda out: (out.fed_from or []).count(-1))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}

    def step() -> StepResult:
        result = decode.step()
        for out in result.outputs:
            tokens[out.request_id] += out.new_token_ids
        return result

    for i, (prompt, sampling) in enumerate(zip(prompts, params, strict=True)):
        rid = f"r{i}"
        decode.add_request(prompt, sampling, request_id=rid, remote_prefill=True)
        reservation = None
        while reservation is None:  # the step that reserves the blocks also runs the batch
            reservation = next((r for r in step().reservations if r.request_id == rid), None)
        prefill.add_request(prompt, sampling, request_id=rid, prefill_only=True)
        (first,) = [out for _ in range(8) if prefill.has_unfinished for out in prefill.step().outputs]
        skip = reservation.num_cached_tokens // decode.block_pool.block_size
        for src, dst in zip(prefill.held_block_ids(rid)[skip:], reservation.block_ids[skip:], strict=True):
            decode.runner.kv_cache[:, :, dst] = prefill.runner.kv_cache[:, :, src]
        assert prefill.release_held(rid)
        committed = decode.commit_remote_kv(rid, first.new_token_ids[0], None)
        assert committed is not None
        tokens[rid] += committed.new_token_ids
        for _ in range(3):
            step()
    while decode.has_unfinished:
        step()
    return [tokens[f"r{i}"] for i in range(len(prompts))], joined_rows


def test_requests_committed_from_a_prefill_engine_join_follow_on_steps(model_and_tokenizer):
    """Disaggregated: a decode engine whose steps follow on takes three requests from a prefill engine, the
    second and third committed while its steps run. They join a follow-on step with their own first token
    (staged beside the gathered ones), and each request's tokens are a single engine's."""
    rng = random.Random(4)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(20, 40))] for _ in range(3)]
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True) for _ in prompts]
    expected = [r.token_ids for r in make_engine(model_and_tokenizer, False)[0].generate(prompts, params)]
    decode = make_engine(model_and_tokenizer, True)[0]
    got, joined_rows = hand_off_while_decoding(make_engine(model_and_tokenizer, False)[0], decode, prompts, params)
    assert got == expected
    assert sum(1 for n in joined_rows if n) >= 2, "the later requests joined follow-on steps"
    assert decode.block_pool.num_used_blocks == 0


def test_a_request_aborted_while_its_step_runs_gives_no_more_outputs(model_and_tokenizer):
    engine, launches = make_engine(model_and_tokenizer, launched=True)
    ids = [engine.add_request([300 + i, 400, 500], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
           for i in range(3)]
    while not launches:
        engine.step()
    assert engine._in_flight, "a launched step is left running for the next step to read"
    assert engine.abort(ids[1])
    counts = dict.fromkeys(ids, 0)
    while engine.has_unfinished:
        for out in engine.step().outputs:
            counts[out.request_id] += 1
            assert out.request_id != ids[1], "no output after the abort"
    assert counts[ids[0]] == counts[ids[2]] > 0
    assert engine.block_pool.num_used_blocks == 0


def test_a_step_with_more_than_argmax_to_do_runs_synchronously(model_and_tokenizer):
    """One row asking for logprobs keeps the whole step synchronous (the host reads more than the tokens)."""
    engine, launches = make_engine(model_and_tokenizer, launched=True)
    engine.generate([[300, 400, 500], [301, 401]], [SamplingParams(max_tokens=8, temperature=0),
                                                  SamplingParams(max_tokens=8, temperature=0, logprobs=True)])
    assert not launches
