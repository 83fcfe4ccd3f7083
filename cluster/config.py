"""The one cluster YAML: a pydantic schema composed of what each package consumes.

    config = load_config("deploy/local-cpu.yaml")   # or ClusterConfig() for the built-in default

Unknown keys and bad values fail at start with the key's path and a one-line reason
(``ConfigError``), e.g. ``decode.replicas: must be between min_replicas (1) and max_replicas (4)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from router.auth import AuthConfig
from router.policy import PolicyConfig
from workers.engine.config import EngineConfig
from workers.protocol.cluster_keys import MAX_POOL_WORKERS, ROLES
from workers.protocol.timing_profile import ProfileError, TimingProfile
from workers.resources import WorkerResources


class ConfigError(ValueError):
    """A bad cluster config; the message is one line naming the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False, validate_default=True)


class ModelSection(_Strict):
    path: str | None = None  # GGUF file or HF directory; None: the bundled SmolLM2-135M-Instruct
    served_name: str | None = None
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # gguf: a GGUF's Q4_1/Q8_0 blocks through the compiled CPU kernel; dense: dequantized to dtype;
    # auto: gguf on CPU in float32 where the kernel builds, else dense.
    weight_format: Literal["auto", "gguf", "dense"] = "auto"
    # The KV cache's element type, one for every pool (a prefill worker's blocks land in a decode worker's
    # cache as they are); auto: int8 where decode runs the compiled CPU stack over GGUF blocks, else dtype.
    # int8: each head row quantized with its own scale (kernels/kv_quant.py), compiled CPU attention only.
    kv_cache_dtype: Literal["auto", "float32", "float16", "bfloat16", "int8"] = "auto"
    max_model_len: int | None = Field(default=2048, ge=16)


class EngineSection(_Strict):
    block_size: int = Field(default=16, ge=1, le=1024)
    # KV pool size; None: kv_cache_memory_fraction of the memory free when the worker starts.
    kv_cache_bytes: int | None = Field(default=None, ge=1)
    # None: 0.1 of free host memory on CPU (workers share the host), 0.8 of free GPU memory on CUDA.
    kv_cache_memory_fraction: float | None = Field(default=None, gt=0, le=1)
    max_num_seqs: int = Field(default=64, ge=1)
    # Past either bound a new request is shed with 429 + Retry-After (the queue waits for KV and a slot).
    max_queue_len: int = Field(default=256, ge=0)
    max_queue_time_s: float = Field(default=30.0, gt=0)
    # Tokens one step computes at most (decodes + prompt chunks); None: 1,024 on CPU (a step near a second on two
    # cores: a burst of prompts is prefilled first come first served, not in one step of several seconds that
    # stalls every stream), 8,192 on CUDA.
    max_num_batched_tokens: int | None = Field(default=None, ge=16)
    prefill_chunk_size: int | None = Field(default=512, ge=16)
    enable_prefix_caching: bool = True
    # Decode steps replayed from CUDA graphs at padded batch sizes up to max_num_seqs; null: on where the
    # worker runs on a CUDA GPU with Triton attention; true on a CPU worker stops it at start.
    cuda_graphs: bool | None = None


class ResourcesSection(_Strict):
    num_cpus: float = Field(default=1.0, ge=0)
    num_gpus: float = Field(default=0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)
    torch_threads: int | None = Field(default=None, ge=1)


class PoolSection(_Strict):
    replicas: int = Field(default=1, ge=0, le=MAX_POOL_WORKERS)
    min_replicas: int = Field(default=1, ge=0, le=MAX_POOL_WORKERS)
    # prefill 0: never disaggregate (the autoscaler adds none)
    max_replicas: int = Field(default=4, ge=0, le=MAX_POOL_WORKERS)
    # A worker removed from the pool finishes its in-flight requests for up to this long, then stops.
    drain_timeout_s: float = Field(default=300.0, gt=0)
    # A serving worker that answers no probe for this long (a stalled process, a hung device) is killed and
    # replaced, which also ends every call still waiting on it; one that dies is replaced at once.
    unresponsive_timeout_s: float = Field(default=20.0, gt=0)
    resources: ResourcesSection = Field(default_factory=ResourcesSection)
    engine: EngineSection = Field(default_factory=EngineSection)

    @model_validator(mode="after")
    def _bounds(self) -> PoolSection:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(f"replicas ({self.replicas}) must be between min_replicas ({self.min_replicas}) "
                             f"and max_replicas ({self.max_replicas})")
        return self


class TransportSection(_Strict):
    backend: Literal["tcp", "nixl", "nccl"] = "tcp"
    timeout_s: float = Field(default=30.0, gt=0)


# The policy knobs' defaults are PolicyConfig's: under round_robin and least_loaded it refuses any other value.
_POLICY = PolicyConfig()


class RouterSection(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    policy: Literal["prefix_aware", "round_robin", "least_loaded"] = "prefix_aware"
    prefill_weight: float = Field(default=_POLICY.prefill_weight, ge=0)
    load_weight: float = Field(default=_POLICY.load_weight, ge=0)
    local_prefill_max_tokens: int = Field(default=_POLICY.local_prefill_max_tokens, ge=0)
    local_prefill_min_overlap: float = Field(default=_POLICY.local_prefill_min_overlap, ge=0)
    prefix_affinity: float = Field(default=_POLICY.prefix_affinity, ge=0)
    decode_affinity_slack: int = Field(default=_POLICY.decode_affinity_slack, ge=0)
    approx_ttl_s: float = Field(default=2.0, gt=0)
    shutdown_grace_s: int = Field(default=20, ge=0)  # on SIGTERM, in-flight streams get this many seconds
    # A stream whose decode worker dies or fails is resumed on another this many times (0: it ends).
    max_failovers: int = Field(default=2, ge=0, le=10)
    max_request_bytes: int = Field(default=8 << 20, ge=1024)  # a bigger request body is a 413
    # A streaming client that takes no data for this long is cut off and its request cancelled.
    client_stall_timeout_s: float = Field(default=30.0, gt=0)
    # Keys (router/auth.py): secrets, shown as ********** wherever the config is dumped (/cluster/config).
    # Prefer TANDEM_API_KEY / TANDEM_ADMIN_KEY or --api-key / --admin-key to a key written in a file.
    api_keys: list[SecretStr] = Field(default_factory=list)
    admin_keys: list[SecretStr] = Field(default_factory=list)
    metrics_need_key: bool = False

    @model_validator(mode="after")
    def _knobs_the_policy_reads(self) -> RouterSection:
        self.policy_config()  # PolicyConfig refuses a prefix_aware knob set under another policy
        return self

    def auth_config(self) -> AuthConfig:
        return AuthConfig(tuple(k.get_secret_value() for k in self.api_keys),
                          tuple(k.get_secret_value() for k in self.admin_keys), self.metrics_need_key)

    def policy_config(self) -> PolicyConfig:
        return PolicyConfig(self.policy, self.prefill_weight, self.load_weight, self.local_prefill_max_tokens,
                            self.local_prefill_min_overlap, self.prefix_affinity, self.decode_affinity_slack)


class RedisSection(_Strict):
    url: str | None = None  # None: start an embedded redis-server


class RaySection(_Strict):
    address: str | None = None  # None: start a local Ray cluster
    namespace: str = "tandem"
    # Logical CPUs of a local cluster; None: the machine's cores, or what the pools need at max_replicas.
    num_cpus: int | None = Field(default=None, ge=1)


class SLOSection(_Strict):
    ttft_ms: float = Field(default=2000.0, gt=0)
    tpot_ms: float = Field(default=200.0, gt=0)
    attainment: float = Field(default=0.9, gt=0, le=1)


class AutoscalerSection(_Strict):
    enabled: bool = False
    interval_s: float = Field(default=15.0, gt=0)
    scale_down_delay_s: float = Field(default=120.0, ge=0)
    # The timing profile the predictions start from (``tandem profile`` on this hardware; measured ones are
    # under deploy/profiles/); None: sim_profile, when the cluster runs as timing models.
    profile: str | None = None
    # Grow a pool when a predicted TTFT or TPOT passes this share of its target; shrink only to sizes predicted
    # within down_margin (the gap between them keeps a steady load from flapping).
    up_margin: float = Field(default=0.85, gt=0, le=1)
    down_margin: float = Field(default=0.6, gt=0, le=1)

    @model_validator(mode="after")
    def _margins(self) -> AutoscalerSection:
        if self.down_margin > self.up_margin:
            raise ValueError(f"down_margin ({self.down_margin}) exceeds up_margin ({self.up_margin})")
        if self.profile is not None:
            try:
                TimingProfile.load(self.profile)
            except ProfileError as e:
                raise ValueError(f"profile: {e}") from None
        return self


def _default_prefill_pool() -> PoolSection:
    # None by default: on a small CPU host one decode worker that prefills locally on every core serves more at
    # a chat SLO than splitting the cores (deploy/local-cpu.yaml has the measurement). Prefill workers can
    # still be added live (`tandem scale prefill=1`) or in the YAML.
    return PoolSection(replicas=0, min_replicas=0)


def _default_decode_pool() -> PoolSection:
    return PoolSection(resources=ResourcesSection(num_cpus=2.0))


class ClusterConfig(_Strict):
    name: str = "default"
    # A timing profile (``tandem profile``'s JSON): every worker runs as a timing model of it, with no
    # weights (``tandem serve --sim``); KV pools default to the profiled worker's size.
    sim_profile: str | None = None
    model: ModelSection = Field(default_factory=ModelSection)
    prefill: PoolSection = Field(default_factory=_default_prefill_pool)
    decode: PoolSection = Field(default_factory=_default_decode_pool)
    transport: TransportSection = Field(default_factory=TransportSection)
    router: RouterSection = Field(default_factory=RouterSection)
    redis: RedisSection = Field(default_factory=RedisSection)
    ray: RaySection = Field(default_factory=RaySection)
    slo: SLOSection = Field(default_factory=SLOSection)
    autoscaler: AutoscalerSection = Field(default_factory=AutoscalerSection)

    @field_validator("sim_profile")
    @classmethod
    def _readable_profile(cls, path: str | None) -> str | None:
        if path is not None:
            try:
                TimingProfile.load(path)
            except ProfileError as e:
                raise ValueError(str(e)) from None
        return path

    @model_validator(mode="after")
    def _some_decode_worker(self) -> ClusterConfig:
        if self.decode.max_replicas < 1:
            raise ValueError("decode.max_replicas must be at least 1: decode workers serve every request")
        return self

    @model_validator(mode="after")
    def _autoscaler_has_a_profile(self) -> ClusterConfig:
        if self.autoscaler.enabled and self.autoscaler.profile is None and self.sim_profile is None:
            raise ValueError("autoscaler.enabled needs autoscaler.profile: a timing profile of this hardware "
                             "(`tandem profile --out FILE` writes one)")
        return self

    def autoscaler_profile(self) -> TimingProfile:
        path = self.autoscaler.profile or self.sim_profile
        assert path is not None, "checked when the config was read"
        return TimingProfile.load(path)

    def timing_profile(self) -> TimingProfile | None:
        return None if self.sim_profile is None else TimingProfile.load(self.sim_profile)

    def pool(self, role: str) -> PoolSection:
        """The ``prefill`` or ``decode`` section."""
        return self.prefill if role == "prefill" else self.decode

    def engine_config(self, role: str) -> EngineConfig:
        e = self.pool(role).engine
        profile = self.timing_profile()
        # A timing model's pool is the profiled worker's, unless the YAML sizes it.
        num_kv_blocks = (profile.kv_tokens_per_worker // e.block_size
                         if profile is not None and e.kv_cache_bytes is None else None)
        return EngineConfig(model=self.model.path, dtype=self.model.dtype, weight_format=self.model.weight_format,
                            kv_cache_dtype=self.model.kv_cache_dtype, max_model_len=self.model.max_model_len,
                            block_size=e.block_size, kv_cache_bytes=e.kv_cache_bytes,
                            kv_cache_memory_fraction=e.kv_cache_memory_fraction, max_num_seqs=e.max_num_seqs,
                            max_num_batched_tokens=e.max_num_batched_tokens,
                            prefill_chunk_size=e.prefill_chunk_size, enable_prefix_caching=e.enable_prefix_caching,
                            cuda_graphs=e.cuda_graphs,
                            max_queue_len=e.max_queue_len, max_queue_time_s=e.max_queue_time_s,
                            num_kv_blocks=num_kv_blocks, timing_profile=profile)

    def worker_resources(self, role: str) -> WorkerResources:
        r = self.pool(role).resources
        return WorkerResources(r.num_cpus, r.num_gpus, dict(r.resources), r.torch_threads)


def _one_line(error: ValidationError) -> str:
    first = error.errors()[0]
    path = ".".join(str(p) for p in first["loc"]) or "(top level)"
    if first["type"] == "extra_forbidden":
        return f"{path}: unknown key"
    message = str(first["msg"]).removeprefix("Value error, ")
    return f"{path}: {message}"


def parse_config(data: dict[str, Any] | None) -> ClusterConfig:
    try:
        return ClusterConfig.model_validate(data or {})
    except ValidationError as e:
        raise ConfigError(_one_line(e)) from None


def load_config(path: str | Path | None) -> ClusterConfig:
    """The YAML at ``path``, or the built-in default (``deploy/local-cpu.yaml`` spells it out)."""
    if path is None:
        return ClusterConfig()
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not YAML: {str(e).splitlines()[0]}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return parse_config(_relative_to(Path(path).parent, data or {}))


def _relative_to(folder: Path, data: dict[str, Any]) -> dict[str, Any]:
    """Profile paths written in a YAML are read from the YAML's folder (as a compose file's are)."""
    def resolve(value: Any) -> Any:
        return str(folder / value) if isinstance(value, str) and not Path(value).is_absolute() else value

    if "sim_profile" in data:
        data["sim_profile"] = resolve(data["sim_profile"])
    scaler = data.get("autoscaler")
    if isinstance(scaler, dict) and "profile" in scaler:
        scaler["profile"] = resolve(scaler["profile"])
    return data


def check_kv_budget(config: ClusterConfig, kv_bytes_per_token: int, model_max_len: int) -> None:
    """Each pool's KV pool must hold at least one request of ``max_model_len`` tokens (a size set by a share
    of free memory is known only when the worker starts; the engine refuses what can never fit then)."""
    max_len = config.model.max_model_len or model_max_len
    for role in ROLES:
        engine = config.pool(role).engine
        if engine.kv_cache_bytes is None:
            continue
        block_bytes = kv_bytes_per_token * engine.block_size
        num_blocks = engine.kv_cache_bytes // block_bytes
        needed = -(-max_len // engine.block_size)  # ceil; kernels.host_math would import torch into every CLI call
        if num_blocks < needed:
            raise ConfigError(
                f"{role}.engine.kv_cache_bytes: {engine.kv_cache_bytes} bytes hold {num_blocks} blocks, but one "
                f"request of max_model_len {max_len} needs {needed} ({needed * block_bytes} bytes)")
