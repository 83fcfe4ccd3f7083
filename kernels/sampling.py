"""A sampled token for each row of logits on CPU in one compiled call (``kernels/csrc/sampling_cpu.cpp``):
temperature, top-k, top-p and min-p as ``workers/engine/sampler.py`` applies them, then the row's uniform
number through the kept distribution's CDF. The sampler's torch path stays for other devices and dtypes.

    if sampling.supported(logits):
        token_ids = sampling.sample_rows(logits, temperature, top_k, top_p, min_p, u)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kernels import cpu_kernel


def supported(logits: Tensor) -> bool:
    """Whether the compiled sampler takes these logits: fp32 rows on a CPU where the kernels build."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and cpu_kernel.available())


def sample_rows(logits: Tensor, temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float],
                min_p: Sequence[float], u: Tensor) -> Tensor:
    """[N, V] logits (already penalized and masked), each row's filters (temperature > 0; top_k <= 0 and
    top_p 1 and min_p 0 are off) and uniform number u [N] in [0, 1) -> [N] int64 token ids."""
    return torch.ops.tandem_cpu.sample_rows(
        logits.contiguous(), torch.tensor(temperature, dtype=torch.float32), torch.tensor(top_k, dtype=torch.long),
        torch.tensor(top_p, dtype=torch.float32), torch.tensor(min_p, dtype=torch.float32),
        u.to(torch.float64).reshape(-1).contiguous())
