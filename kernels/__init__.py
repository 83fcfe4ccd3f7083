"""Attention kernels: Triton on CUDA, vectorized torch elsewhere, readable torch references."""

from kernels.dispatch import paged_decode_attention, paged_prefill_attention, resolve_backend, store_kv

__all__ = ["paged_decode_attention", "paged_prefill_attention", "resolve_backend", "store_kv"]
