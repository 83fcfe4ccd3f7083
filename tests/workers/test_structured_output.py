"""Structured outputs in the engine: every sampled output parses and validates against its schema
(jsonschema), batched with free-text requests; bad schemas and impossible combinations are refused."""

from __future__ import annotations

import json

import jsonschema
import pytest

from workers.protocol.errors import InvalidRequestError
from workers.protocol.sampling_params import SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}


def chat_prompt(engine, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_twenty_sampled_outputs_parse_and_validate(make_engine) -> None:
    engine = make_engine()
    prompt = chat_prompt(engine, "Describe a person as JSON with name, age, colour and tags.")
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=s, json_schema=json.dumps(PERSON))
              for s in range(20)]
    free = SamplingParams(max_tokens=20, temperature=0.0)  # a free-text row in the same batches
    results = engine.generate([prompt] * 20 + [prompt], [*params, free])
    for result in results[:20]:
        assert result.finish_reason == "stop", result.text  # the grammar closed the object, then EOS
        jsonschema.validate(json.loads(result.text), PERSON)
    assert len({r.text for r in results[:20]}) > 10  # sampled, not one forced answer
    # Masks stay on their own rows: the free row reads as it does beside the same rows unconstrained (the
    # same batch shapes, so the same arithmetic), and is not JSON.
    unconstrained = [SamplingParams(max_tokens=120, temperature=1.0, seed=s) for s in range(20)]
    beside_free = engine.generate([prompt] * 21, [*unconstrained, free])[20].text
    assert results[20].text == beside_free and not results[20].text.lstrip().startswith("{")


def test_json_object_is_an_object(make_engine) -> None:
    engine = make_engine()
    prompt = chat_prompt(engine, "Give me a JSON object with the name and colour of the sea.")
    result = engine.generate([prompt], SamplingParams(max_tokens=200, temperature=0.0,
                                                      json_schema='{"type": "object"}'))[0]
    assert result.finish_reason == "stop" and isinstance(json.loads(result.text), dict)


@pytest.mark.parametrize(("schema", "message"), [
    ("{not json", "not JSON"),
    ("[1, 2]", "must be a JSON object"),
    (json.dumps({"type": "object", "properties": {"a": {"type": "no-such-type"}}}), "cannot be compiled"),
])
def test_bad_schemas_are_refused(make_engine, schema: str, message: str) -> None:
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request("hi", SamplingParams(json_schema=schema))


def test_a_schema_with_ignore_eos_or_min_tokens_is_refused() -> None:
    for knobs in ({"ignore_eos": True}, {"min_tokens": 2}):
        with pytest.raises(InvalidRequestError, match="response_format cannot be combined"):
            SamplingParams(json_schema='{"type": "object"}', **knobs)
