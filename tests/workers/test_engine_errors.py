"""Clear typed errors for bad requests and bad model paths; nothing held after failures."""

from __future__ import annotations

import json

import pytest

from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.protocol.errors import CapacityError, InvalidRequestError, ModelLoadError
from workers.protocol.sampling_params import SamplingParams


def test_prompt_longer_than_max_model_len(make_engine):
    engine = make_engine(max_model_len=64)
    with pytest.raises(InvalidRequestError, match="exceeds max_model_len 64"):
        engine.add_request(list(range(100, 160)), SamplingParams(max_tokens=8))
    assert not engine.has_unfinished


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_max_tokens_must_be_positive(make_engine, max_tokens):
    with pytest.raises(InvalidRequestError, match="max_tokens must be at least 1"):
        make_engine().add_request("hi", SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize("fields, match", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"min_p": 2}, "min_p"),
    ({"top_k": -5}, "top_k"),
    ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params(fields, match):
    """Refused where they are built: no engine or worker ever holds invalid parameters."""
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**fields)


def test_empty_prompt_bad_ids_and_bad_messages(make_engine):
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request([])
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request([10**9])
    with pytest.raises(InvalidRequestError, match="role"):
        engine.add_request({"messages": [{"role": "wizard", "content": "x"}]})
    with pytest.raises(InvalidRequestError, match="non-empty"):
        engine.add_request({"messages": []})


def test_request_that_can_never_fit_the_pool(make_engine):
    engine = make_engine(num_kv_blocks=4)
    with pytest.raises(CapacityError, match="can never fit"):
        engine.add_request(list(range(100, 150)), SamplingParams(max_tokens=30))


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        Engine(EngineConfig(model=str(tmp_path / "nope.gguf")))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        Engine(EngineConfig(model=str(tmp_path)))


def test_not_a_gguf_file(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"definitely not gguf" * 10)
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        Engine(EngineConfig(model=str(junk)))


def test_cuda_graphs_on_a_cpu_model_are_refused_by_name(default_model_and_tokenizer):
    model, tokenizer = default_model_and_tokenizer
    with pytest.raises(ValueError, match="cuda_graphs: true needs a model on a CUDA device, not a model on cpu"):
        Engine(EngineConfig(num_kv_blocks=64, cuda_graphs=True), model=model, tokenizer=tokenizer)
    engine = Engine(EngineConfig(num_kv_blocks=64), model=model, tokenizer=tokenizer)  # auto: off on CPU
    assert engine.runner.decode_graphs is None
