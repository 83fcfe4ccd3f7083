"""Which way a CPU decode step's threads share its batch, learned while it serves.

The compiled stack (``kernels/csrc/decoder_cpu.cpp``) runs a batch two ways, with the same bits:
- **team**: every matrix's weight rows split among the threads, the batch's rows together (each weight read once);
- **split**: the batch's rows split among the threads, each running its rows through every layer alone (every
  weight read by each thread, nothing handed between them).
Which is faster depends on the host, and on this 2-vCPU VM it changes by the minute: when its vCPUs sit near (one
path to memory, ~50 GB/s) the team wins (batch 4: 1.85 against 2.7 ms); when far apart (~75 GB/s, lines between the
cores dearer) the split does (batch 16 at 450 tokens: 6.5 against 8.1 ms); the state has flipped within ten
seconds, and held for a quarter hour. So the step keeps running one way and now and then runs one step of a batch
size the other way; the two steps back to back see the same batch and nearly the same context, so their ratio is a
fair comparison where step times themselves drift with context. A running mean of that ratio switches the way when
the other is faster. The other way is tried every ``explore_every`` steps, but every ``soon_every`` while the
choice is new (its first ``first_explorations`` pairs, and again after each switch) or the last pair found the
other way faster: a flip of the host is followed within ~50 steps (a pair's ratio varies by a few percent; the mean
of two or three moves past the margin), and a settled choice costs one step in 32 run the slower way (~0.4% at
batch 8 here). ``TANDEM_BATCH_SPLIT=0`` keeps every step on the team (A/B runs).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass


@dataclass
class _Choice:
    split: bool = False  # the way its steps run now
    steps: int = 0
    last_s: float | None = None  # the last step's seconds the current way
    ratio: float | None = None  # running mean of (the other way's seconds) / (this way's), from paired steps
    explored: int = 0  # pairs since the choice was made
    next_explore: int = 0  # the step that runs the other way


class BatchSplitChooser:
    """Per batch size: ``split(batch, threads)`` says how to run the next step, ``record(batch, split, seconds)``
    what it took. Batch 1 (nothing to split) and a single thread always take the team. Each thread that steps an
    engine learns from its own steps (engines in one process share a model, and so its stack)."""

    def __init__(self, explore_every: int = 32, soon_every: int = 8, first_explorations: int = 4,
                 weight: float = 0.5, margin: float = 0.03, min_pairs: int = 2):
        self.explore_every = explore_every
        self.soon_every = soon_every
        self.first_explorations = first_explorations
        self.weight = weight  # of a new ratio in the running mean
        self.margin = margin  # the other way must be this much faster (a share) to switch
        self.min_pairs = min_pairs  # paired steps before a switch: one step can be an outlier
        self.enabled = os.environ.get("TANDEM_BATCH_SPLIT") != "0"
        self._local = threading.local()

    @property
    def _choices(self) -> dict[int, _Choice]:
        choices: dict[int, _Choice] | None = getattr(self._local, "choices", None)
        if choices is None:
            choices = self._local.choices = {}
        return choices

    def split(self, batch: int, threads: int) -> bool:
        if batch < 2 or threads < 2 or not self.enabled:
            return False
        c = self._choices.get(batch)
        if c is None:
            c = self._choices[batch] = _Choice(next_explore=self.soon_every - 1)
        explore = c.last_s is not None and c.steps >= c.next_explore
        return c.split != explore

    def record(self, batch: int, split: bool, seconds: float) -> None:
        c = self._choices.get(batch)
        if c is None:
            return  # a batch that never splits
        c.steps += 1
        if split == c.split:
            c.last_s = seconds
            return
        assert c.last_s is not None  # an exploring step follows one the current way
        ratio = seconds / c.last_s
        c.explored += 1
        c.ratio = ratio if c.ratio is None else (1 - self.weight) * c.ratio + self.weight * ratio
        if c.explored >= self.min_pairs and c.ratio < 1 - self.margin:
            # The other way is faster: it becomes the way (the ratio now the old way's against it), and is checked
            # soon again.
            c.split, c.last_s, c.ratio, c.explored = split, seconds, 1 / c.ratio, 0
        soon = c.explored < self.first_explorations or ratio < 1
        c.next_explore = c.steps + (self.soon_every if soon else self.explore_every) - 1

    def ways(self) -> dict[int, bool]:
        """{batch size: whether this thread's steps run split now}."""
        return {batch: c.split for batch, c in self._choices.items()}
