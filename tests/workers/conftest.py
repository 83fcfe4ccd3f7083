"""Fixtures shared by the worker tests: the HF comparisons' reference prompts and HF's greedy continuations, and a
decode service on the dense model in this process."""

from __future__ import annotations

import pytest
import torch

from tests.prompts import reference_prompts
from workers.service.decode import DecodeService
from workers.transport.tcp import TcpTransport

NUM_NEW = 32


@pytest.fixture(scope="session")
def prompts(default_model_and_tokenizer):
    return reference_prompts(default_model_and_tokenizer[1])


@pytest.fixture(scope="session")
def prompt_ids(make_engine, prompts):
    engine = make_engine()
    return [engine.tokenize(p) for p in prompts]


@pytest.fixture(scope="session")
def hf_outputs(hf_reference, prompt_ids):
    model, _ = hf_reference
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NUM_NEW, do_sample=False)
            outs.append(gen[0, len(ids):].tolist())
    return outs


@pytest.fixture
def decode(make_engine):
    """A decode service (no Ray, no prefill workers) on the dense model, stepping on its own thread."""
    service = DecodeService(make_engine(dense=True), TcpTransport(), "d0", None).start()
    yield service
    service.close()
