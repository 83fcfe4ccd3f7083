"""A request resumed on another engine after the tokens a dead worker already sent goes on exactly as an
undisturbed run: greedy, seeded sampling with penalties, a stop string held back across the cut, a grammar."""

from __future__ import annotations

import json

import pytest

from workers.protocol.errors import InvalidRequestError
from workers.protocol.sampling_params import SamplingParams

PROMPT = {"messages": [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]}
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                      "age": {"type": "integer"}},
                     "required": ["name", "age"], "additionalProperties": False})


def run(engine, params: SamplingParams, resume: list[int] | None = None) -> list[tuple[int, str, str | None]]:  # type: ignore[no-untyped-def]
    """(token, text emitted with it, finish reason) for each output; resumed: only the new ones."""
    rid = engine.add_request(PROMPT, params, resume_token_ids=resume or ())
    outs = []
    while engine.has_unfinished:
        for out in engine.step().outputs:
            assert out.request_id == rid
            outs.append((out.new_token_ids[0], out.new_text, out.finish_reason))
    return outs


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.0),
    SamplingParams(max_tokens=24, temperature=1.0, seed=7, frequency_penalty=0.5, repetition_penalty=1.2,
                   presence_penalty=0.3, top_k=50),
    SamplingParams(max_tokens=32, temperature=0.8, seed=3, json_schema=SCHEMA),
], ids=["greedy", "seeded-penalties", "json-schema"])
def test_a_resumed_request_goes_on_as_if_undisturbed(make_engine, params) -> None:
    whole = run(make_engine(dense=True), params)
    assert len(whole) > 12
    for cut in (1, len(whole) // 2):
        done = [t for t, _, _ in whole[:cut]]
        rest = run(make_engine(dense=True), params, done)
        assert rest == whole[cut:], cut
    if params.json_schema is not None:
        json.loads("".join(text for _, text, _ in whole))


def test_text_held_back_for_a_stop_string_is_held_back_again(make_engine) -> None:
    probe = run(make_engine(dense=True), SamplingParams(max_tokens=30, temperature=0.0))
    text = "".join(t for _, t, _ in probe)
    at = len(text) // 2
    stop = text[at: at + 6] + "\u2603"  # the output reaches its first six characters, never all of it
    params = SamplingParams(max_tokens=30, temperature=0.0, stop=[stop])
    whole = run(make_engine(dense=True), params)
    assert "".join(t for _, t, _ in whole) == text  # held back while it might match, then let go
    # Cut right after tokens whose text was held back (emitted less than the probe run had by then).
    def emitted(outs: list[tuple[int, str, str | None]], i: int) -> int:
        return len("".join(t for _, t, _ in outs[: i + 1]))

    held = [i + 1 for i in range(len(whole) - 1) if emitted(whole, i) < emitted(probe, i)]
    assert held
    for cut in held[:3]:
        rest = run(make_engine(dense=True), params, [t for t, _, _ in whole[:cut]])
        assert rest == whole[cut:], cut


def test_resume_is_refused_where_it_cannot_be(make_engine) -> None:
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match="resumed"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=4), resume_token_ids=[1, 2, 3, 4])
    with pytest.raises(InvalidRequestError, match="resumed"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=4), resume_token_ids=[1], prefill_only=True)
    with pytest.raises(InvalidRequestError, match="resumed token ids"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=4), resume_token_ids=[10**9])
