"""The cluster YAML: examples parse, and each kind of mistake is one line naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ClusterConfig, ConfigError, check_kv_budget, load_config, parse_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_local_cpu_yaml_is_the_built_in_default():
    assert load_config(DEPLOY / "local-cpu.yaml") == ClusterConfig()


@pytest.mark.parametrize("name", ["gpu-1p1d.yaml", "gpu-2p6d.yaml"])
def test_gpu_examples_parse(name):
    config = load_config(DEPLOY / name)
    assert config.transport.backend == "nixl" and config.decode.resources.num_gpus == 1
    assert config.engine_config("decode").kv_cache_bytes > config.engine_config("prefill").kv_cache_bytes


def test_cuda_graphs_reach_the_engine():
    config = parse_config({"decode": {"engine": {"cuda_graphs": False}}})
    assert config.engine_config("decode").cuda_graphs is False
    assert config.engine_config("prefill").cuda_graphs is None  # auto: on a CUDA GPU with Triton attention


@pytest.mark.parametrize(("data", "message"), [
    ({"decode": {"replicaz": 2}}, "decode.replicaz: unknown key"),
    ({"colour": "blue"}, "colour: unknown key"),
    ({"prefill": {"replicas": "two"}}, "prefill.replicas: Input should be a valid integer"),
    ({"router": {"port": 70000}}, "router.port: Input should be less than or equal to 65535"),
    ({"router": {"policy": "random"}}, "router.policy: Input should be"),
    ({"model": {"weight_format": "q5_k"}}, "model.weight_format: Input should be"),
    ({"decode": {"min_replicas": 3, "max_replicas": 2, "replicas": 2}},
     "decode: min_replicas (3) exceeds max_replicas (2)"),
    ({"prefill": {"replicas": 9}}, "prefill: replicas (9) must be between min_replicas (1) and max_replicas (4)"),
    ({"transport": {"backend": "carrier-pigeon"}}, "transport.backend: Input should be 'tcp', 'nixl' or 'nccl'"),
    ({"decode": {"engine": {"kv_cache_bytes": 0}}}, "decode.engine.kv_cache_bytes: Input should be greater than"),
    ({"decode": {"engine": {"cuda_graphs": "sometimes"}}},
     "decode.engine.cuda_graphs: Input should be a valid boolean"),
    ({"router": {"policy": "least_loaded", "local_prefill_max_tokens": 0}},
     "router: local_prefill_max_tokens: only the prefix_aware policy reads this, and the policy is least_loaded"),
])
def test_bad_config_is_one_line_naming_the_key(data, message):
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    text = str(info.value)
    assert text.startswith(message), text
    assert "\n" not in text


def test_kv_budget_too_small_for_one_max_length_request():
    config = parse_config({"model": {"max_model_len": 2048}, "decode": {"engine": {"kv_cache_bytes": 1 << 20}}})
    with pytest.raises(ConfigError, match=r"^decode\.engine\.kv_cache_bytes: 1048576 bytes hold 11 blocks, but one "
                                          r"request of max_model_len 2048 needs 128"):
        check_kv_budget(config, kv_bytes_per_token=46080 // 8, model_max_len=8192)
    check_kv_budget(ClusterConfig(), kv_bytes_per_token=46080, model_max_len=8192)  # the default fits


def test_unreadable_and_non_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode: [1, 2\n")
    with pytest.raises(ConfigError, match="not YAML"):
        load_config(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
