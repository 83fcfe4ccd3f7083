"""Batches of sequences split by length, for the torch attention paths: every sequence in one call
is padded to the longest, so one 2,000-token sequence among 200-token ones would otherwise make each
of them read 2,000 tokens."""

from __future__ import annotations


def length_groups(seq_lens: list[int], ratio: float = 2.0, floor: int = 64) -> list[list[int]]:
    """Indices grouped so that, within a group, the longest is at most ``ratio`` x the shortest
    (lengths under ``floor`` count as ``floor``: short sequences are cheap to pad)."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups and seq_lens[i] <= ratio * max(seq_lens[groups[-1][0]], floor):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
