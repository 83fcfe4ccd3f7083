"""A discrete-event simulation of a Tandem cluster on a timing profile: ``tandem plan``'s predictor.

    result = simulate(profile, SimSpec(rate=2.0, input_len=300, output_len=64, num_requests=600), prefill=1, decode=2)
    result.attainment(slo)   result.goodput(slo)

Workers step the way the engine does, each step taking ``profile.step_s`` of what it runs:
- a prefill worker takes queued prompts first come first served, up to the token budget and the chunk size
  a step, and hands each finished prompt (its first token) to its decode worker after the KV transfer;
- a decode worker admits requests while it has a batch slot and KV for their whole length, decodes every
  running request each step, and, without prefill workers, computes the prompts too (chunked, in the
  same steps as its decodes);
- the router sends each request to the decode worker with the least work and the prefill worker with the
  fewest queued prompt tokens (no prefix sharing: every prompt is new, as loadgen's are).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from router.slo_window import SLOTargets
from workers.engine.config import default_step_tokens
from workers.protocol.timing_profile import TimingProfile


@dataclass(frozen=True)
class SimSpec:
    rate: float
    input_len: int
    output_len: int
    num_requests: int = 600
    input_jitter: float = 0.0  # uniform +- share of input_len (loadgen's uniform:LO:HI)
    seed: int = 0
    max_num_batched_tokens: int | None = None  # None: the engine's default on the profile's device
    # Observed / profiled time of prompt and decode work where the engine serves (the corrections a running
    # cluster's autoscaler reports: Ray, the router and the client on the same cores cost time too).
    prefill_scale: float = 1.0
    decode_scale: float = 1.0


@dataclass
class _Req:
    arrival: float
    prompt: int
    output: int
    done_prompt: int = 0
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    decode: int = -1  # its decode worker, chosen at arrival (remote prefill lands there)


@dataclass
class _Worker:
    queue: deque[_Req] = field(default_factory=deque)  # waiting: prompts (prefill) or admission (decode)
    running: list[_Req] = field(default_factory=list)  # decode: in the batch
    prompting: list[_Req] = field(default_factory=list)  # decode with local prefill: prompts in progress
    kv_used: int = 0
    busy: bool = False

    def work(self) -> int:
        return len(self.queue) + len(self.running) + len(self.prompting)


@dataclass
class SimResult:
    requests: list[_Req]
    duration_s: float

    def ttfts(self) -> list[float]:
        return [r.first_token - r.arrival for r in self.requests if r.first_token is not None]

    def tpots(self) -> list[float]:
        """Of the requests with two tokens or more."""
        return [_tpot(r) for r in self.requests if r.tokens > 1]

    def met(self, slo: SLOTargets, r: _Req) -> bool:
        if r.first_token is None or r.last_token is None or r.tokens < r.output:
            return False
        return r.first_token - r.arrival <= slo.ttft_s and _tpot(r) <= slo.tpot_s

    def attainment(self, slo: SLOTargets) -> float:
        return sum(self.met(slo, r) for r in self.requests) / len(self.requests)

    def goodput(self, slo: SLOTargets) -> float:
        return sum(self.met(slo, r) for r in self.requests) / self.duration_s


def _tpot(r: _Req) -> float:
    if r.tokens < 2 or r.first_token is None or r.last_token is None:
        return 0.0
    return (r.last_token - r.first_token) / (r.tokens - 1)


def _prompt_chunks(prompts: Iterable[_Req], chunk: int, budget: int) -> list[tuple[_Req, int]]:
    """The next step's prompt chunks, first come first served, each up to ``chunk`` tokens, within ``budget``."""
    chunks = []
    for req in prompts:
        n = min(chunk, req.prompt - req.done_prompt, budget)
        if n <= 0:
            break
        chunks.append((req, n))
        budget -= n
    return chunks


def _poisson(spec: SimSpec, rng: random.Random) -> Iterator[tuple[float, int, int]]:
    t = 0.0
    for _ in range(spec.num_requests):
        t += rng.expovariate(spec.rate)
        jitter = rng.uniform(-spec.input_jitter, spec.input_jitter) if spec.input_jitter else 0.0
        yield t, round(spec.input_len * (1 + jitter)), spec.output_len


def simulate(profile: TimingProfile, spec: SimSpec, prefill: int, decode: int,
             trace: Sequence[tuple[float, int, int]] | None = None) -> SimResult:
    """``trace``: the requests' (arrival s, prompt tokens, output tokens), e.g. a loadgen run's, in place of
    the spec's Poisson arrivals and lengths (its rate, lengths and count then go unused)."""
    rng = random.Random(spec.seed)
    events: list[tuple[float, int, str, int, object]] = []  # (time, tiebreak, kind, worker, payload)
    order = itertools.count()
    prefills = [_Worker() for _ in range(prefill)]
    decodes = [_Worker() for _ in range(decode)]
    chunk = profile.prefill_chunk_size or 1 << 30
    budget = (spec.max_num_batched_tokens if spec.max_num_batched_tokens is not None
              else default_step_tokens(profile.device_type))
    kv_capacity = profile.kv_tokens_per_worker
    requests = []
    for arrival, prompt, output in trace if trace is not None else _poisson(spec, rng):
        req = _Req(arrival, max(1, prompt), max(1, output))
        requests.append(req)
        heapq.heappush(events, (arrival, next(order), "arrive", -1, req))

    def push(at: float, kind: str, worker: int, payload: object = None) -> None:
        heapq.heappush(events, (at, next(order), kind, worker, payload))

    def start_decode(i: int, now: float) -> None:
        w = decodes[i]
        if w.busy:
            return
        while w.queue and len(w.running) + len(w.prompting) < profile.max_num_seqs \
                and w.kv_used + w.queue[0].prompt + w.queue[0].output <= kv_capacity:
            req = w.queue.popleft()
            w.kv_used += req.prompt + req.output
            (w.running if req.first_token is not None else w.prompting).append(req)
        if not w.running and not w.prompting:
            return
        contexts = [r.prompt + r.tokens for r in w.running]
        chunks = _prompt_chunks(w.prompting, chunk, budget - len(contexts))
        w.busy = True
        step = (profile.step_s(contexts, []) * spec.decode_scale
                + profile.step_s([], [(n, r.done_prompt) for r, n in chunks]) * spec.prefill_scale)
        push(now + step, "decode_step", i, chunks)

    def start_prefill(i: int, now: float) -> None:
        w = prefills[i]
        if w.busy or not w.queue:
            return
        chunks = _prompt_chunks(w.queue, chunk, budget)
        w.busy = True
        step = profile.step_s([], [(n, r.done_prompt) for r, n in chunks]) * spec.prefill_scale
        push(now + step, "prefill_step", i, chunks)

    end = 0.0
    while events:
        now, _, kind, i, payload = heapq.heappop(events)
        end = now
        if kind == "arrive":
            req = payload  # type: ignore[assignment]
            d = min(range(decode), key=lambda k: decodes[k].work())
            if prefill:
                p = min(range(prefill), key=lambda k: sum(r.prompt - r.done_prompt for r in prefills[k].queue))
                prefills[p].queue.append(req)
                req.decode = d
                start_prefill(p, now)
            else:
                decodes[d].queue.append(req)
                start_decode(d, now)
        elif kind == "prefill_step":
            w = prefills[i]
            w.busy = False
            for req, n in payload:  # type: ignore[attr-defined]
                req.done_prompt += n
                if req.done_prompt >= req.prompt:
                    w.queue.remove(req)
                    push(now + profile.transfer_tokens_s(req.prompt), "landed", req.decode, req)
            start_prefill(i, now)
        elif kind == "landed":
            req = payload  # type: ignore[assignment]
            req.first_token = req.last_token = now
            req.tokens = 1
            if req.tokens >= req.output:
                continue
            decodes[i].queue.append(req)
            start_decode(i, now)
        elif kind == "decode_step":
            w = decodes[i]
            w.busy = False
            for req in list(w.running):
                req.tokens += 1
                req.last_token = now
                if req.tokens >= req.output:
                    w.running.remove(req)
                    w.kv_used -= req.prompt + req.output
            for req, n in payload:  # type: ignore[attr-defined]
                req.done_prompt += n
                if req.done_prompt >= req.prompt:  # its first token comes with this step
                    w.prompting.remove(req)
                    req.first_token = req.last_token = now
                    req.tokens = 1
                    if req.tokens >= req.output:
                        w.kv_used -= req.prompt + req.output
                    else:
                        w.running.append(req)
            start_decode(i, now)
    return SimResult(requests, max(end, 1e-9))  # from the start, as loadgen times a run
