"""The Triton backend of ``kernels.dispatch``: one import that fails cleanly where Triton can't load."""

from kernels.triton_decode import paged_decode_attention
from kernels.triton_fused import add_rms_norm, rope
from kernels.triton_fused import supports as fused_supports
from kernels.triton_prefill import paged_prefill_attention
from kernels.triton_store_kv import store_kv

__all__ = ["add_rms_norm", "fused_supports", "paged_decode_attention", "paged_prefill_attention", "rope", "store_kv"]
