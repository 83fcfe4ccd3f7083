"""The Triton backend of ``kernels.dispatch``: one import that fails cleanly where Triton can't load."""

from kernels.triton_decode import paged_decode_attention
from kernels.triton_prefill import paged_prefill_attention
from kernels.triton_store_kv import store_kv

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv"]
