"""BatchSplitChooser (kernels/batch_split.py): per batch size, the way a decode step's threads share the batch,
learned from pairs of steps run both ways."""

from __future__ import annotations

import threading

from kernels.batch_split import BatchSplitChooser


def serve(chooser: BatchSplitChooser, steps: int, team_s: float, split_s: float, batch: int = 8,
          threads: int = 2) -> list[bool]:
    """Run ``steps`` steps whose seconds are ``team_s`` or ``split_s`` by their way; the ways they ran."""
    ways = []
    for _ in range(steps):
        split = chooser.split(batch, threads)
        chooser.record(batch, split, split_s if split else team_s)
        ways.append(split)
    return ways


def test_the_split_is_taken_once_it_is_faster_and_the_team_kept_while_it_is() -> None:
    chooser = BatchSplitChooser()
    ways = serve(chooser, 40, team_s=4.0e-3, split_s=3.2e-3)
    assert ways[0] is False  # the team first
    assert chooser.ways() == {8: True}
    assert ways[-16:].count(False) <= 2  # the team now only now and then, measured against the split
    slower = BatchSplitChooser()
    ways = serve(slower, 300, team_s=2.0e-3, split_s=2.8e-3)
    assert slower.ways() == {8: False}
    explored = sum(ways)
    assert 4 <= explored <= 4 + 300 // 32  # the first few soon, then one step in 32


def test_the_way_follows_the_host_when_it_changes() -> None:
    chooser = BatchSplitChooser()
    serve(chooser, 60, team_s=4.0e-3, split_s=3.0e-3)
    assert chooser.ways() == {8: True}
    for _ in range(200):  # settled: the team tried one step in 32
        serve(chooser, 1, team_s=4.0e-3, split_s=3.0e-3)
    ways = serve(chooser, 100, team_s=2.0e-3, split_s=2.8e-3)  # the machine's state flipped: the team wins now
    assert chooser.ways() == {8: False}
    assert ways[-50:].count(True) <= 5  # back on the team within ~50 steps (the split now and then, checked)


def test_a_close_call_or_one_outlier_does_not_switch() -> None:
    chooser = BatchSplitChooser()
    serve(chooser, 200, team_s=4.0e-3, split_s=3.95e-3)  # within the margin
    assert chooser.ways() == {8: False}
    chooser = BatchSplitChooser(min_pairs=2, soon_every=8)
    for _ in range(7):  # the team's steps up to the first exploring one
        chooser.record(8, chooser.split(8, 2), 4.0e-3)
    assert chooser.split(8, 2) is True  # exploring
    chooser.record(8, True, 1.0e-3)  # one very fast split step
    assert chooser.ways() == {8: False}  # not enough: one pair


def test_nothing_to_split_never_splits() -> None:
    chooser = BatchSplitChooser()
    assert not any(serve(chooser, 50, team_s=4e-3, split_s=1e-3, batch=1))
    assert not any(serve(chooser, 50, team_s=4e-3, split_s=1e-3, threads=1))
    assert chooser.ways() == {}


def test_turned_off_it_never_splits(monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_BATCH_SPLIT", "0")
    chooser = BatchSplitChooser()
    assert not any(serve(chooser, 100, team_s=4e-3, split_s=1e-3))


def test_batch_sizes_learn_apart() -> None:
    chooser = BatchSplitChooser()
    serve(chooser, 60, team_s=2e-3, split_s=3e-3, batch=4)
    serve(chooser, 60, team_s=8e-3, split_s=6e-3, batch=16)
    assert chooser.ways() == {4: False, 16: True}


def test_each_thread_learns_from_its_own_steps() -> None:
    """Engines in one process share a model's stack, each stepped on its own thread: one's steps never pair with
    another's."""
    chooser = BatchSplitChooser()
    other: dict[int, bool] = {}

    def elsewhere() -> None:
        serve(chooser, 60, team_s=2e-3, split_s=3e-3)
        other.update(chooser.ways())

    serve(chooser, 60, team_s=4e-3, split_s=3e-3)
    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert chooser.ways() == {8: True} and other == {8: False}
