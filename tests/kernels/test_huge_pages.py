"""kernels/huge_pages.py: copies of tensors in one mapping advised for transparent huge pages."""

from __future__ import annotations

import gc

import pytest
import torch

from kernels.huge_pages import ALIGN, HUGE_PAGE, huge_page_copies, huge_page_zeros, transparent_huge_pages


def sample_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (333, 21), dtype=torch.uint8, generator=g), torch.randn(7, 5, generator=g),
            torch.zeros(0, 4), torch.randn(3, 8, generator=g)[:, ::2]]  # the last one not contiguous


def test_copies_hold_the_same_values_aligned_in_one_mapping() -> None:
    originals = sample_tensors()
    copies = huge_page_copies(originals)
    for original, copy in zip(originals, copies, strict=True):
        assert copy.dtype == original.dtype and copy.shape == original.shape and copy.is_contiguous()
        assert torch.equal(copy, original)
        assert copy.numel() == 0 or copy.data_ptr() != original.data_ptr()
    filled = [c for c in copies if c.numel()]
    assert all(c.data_ptr() % ALIGN == 0 for c in filled)
    assert filled[0].data_ptr() % HUGE_PAGE == 0, "the first copy starts a huge page"
    span = filled[-1].data_ptr() - filled[0].data_ptr()
    assert 0 < span < sum(c.numel() * c.element_size() + ALIGN for c in filled), "one mapping, packed in order"


def test_copies_outlive_the_originals_and_each_other() -> None:
    copies = huge_page_copies(sample_tensors())
    want = copies[1].clone()
    keep = copies[1]
    del copies
    gc.collect()
    keep.add_(1)  # the mapping is still there: writing and reading it works
    assert torch.equal(keep, want + 1)


def test_off_switch_makes_plain_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_HUGE_PAGES", "0")
    originals = sample_tensors()
    copies = huge_page_copies(originals)
    assert all(torch.equal(a, b) and b.is_contiguous() for a, b in zip(originals, copies, strict=True))


def test_the_setting_is_read() -> None:
    assert transparent_huge_pages() in ("always", "madvise", "never", "unknown")


def test_the_default_model_streams_its_blocks_from_the_huge_page_mapping(quantized_model) -> None:
    """Every layer matrix and the head lie in one mapping (the stack packs these same tensors)."""
    model = quantized_model
    data = [getattr(layer, name).data for layer in model.layers for name in ("qkv", "o_proj", "gate_up", "down")]
    data.append(model.lm_head.data)
    assert model.embed is model.lm_head, "the tied embedding still shares the head's bytes"
    starts = sorted(d.data_ptr() for d in data)
    total = sum(d.numel() for d in data)
    assert starts[-1] - starts[0] < total, "not one packed mapping"
    assert starts[0] % HUGE_PAGE == 0


def test_zeros_are_zeros_of_the_shape_and_writable() -> None:
    kv = huge_page_zeros((2, 3, 5, 16, 3, 68), torch.int8)
    assert kv.shape == (2, 3, 5, 16, 3, 68) and kv.dtype == torch.int8 and kv.is_contiguous()
    assert not kv.any()
    assert kv.data_ptr() % HUGE_PAGE == 0
    kv[1, 2].fill_(7)
    assert int(kv.sum()) == 7 * kv[1, 2].numel()
    floats = huge_page_zeros((4, 6), torch.float32)
    assert torch.equal(floats, torch.zeros(4, 6))


def test_zeros_off_switch_gives_plain_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_HUGE_PAGES", "0")
    kv = huge_page_zeros((3, 4), torch.float16)
    assert torch.equal(kv, torch.zeros(3, 4, dtype=torch.float16))


def test_the_default_model_keeps_its_kv_cache_in_huge_pages(quantized_model) -> None:
    kv = quantized_model.new_kv_cache(8, 16)
    assert kv.data_ptr() % HUGE_PAGE == 0 and not kv.any()
