"""What one worker actor asks Ray for (``cluster/config.py`` reads it from each pool's YAML)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class WorkerResources:
    """What one worker actor asks Ray for; custom resources pin a pool to a node type."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    # e.g. {"prefill_node": 1}: only nodes started with that resource take the worker.
    resources: dict[str, float] = field(default_factory=dict)
    # torch intra-op threads of the engine; None: the actor's num_cpus (at least 1).
    torch_threads: int | None = None

    @property
    def engine_threads(self) -> int:
        return self.torch_threads or max(1, math.floor(self.num_cpus))

    def demand(self) -> dict[str, float]:
        """What Ray must find free on one node, under Ray's resource names."""
        return {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
