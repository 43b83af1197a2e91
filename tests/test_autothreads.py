"""--torch-threads auto: the chooser keeps the setting that encoded faster lately, per batch size."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from retrieval.serve.autothreads import (
    EXPLORE_MAX_S,
    EXPLORE_S,
    SAMPLES,
    IdleCores,
    ThreadChooser,
    default_choices,
    size_class,
)


class Machine:
    """A fake clock and a fake encoder whose seconds per query depend on the thread count (and can change)."""

    def __init__(self, per_query: dict[int, float]):
        self.now = 0.0
        self.per_query = per_query
        self.applied: list[int] = []

    def batch(self, chooser: ThreadChooser, queries: int, gap: float = 0.05) -> int:
        threads = chooser.choose(queries)
        seconds = self.per_query[threads] * queries
        self.now += seconds + gap
        chooser.record(queries, threads, seconds)
        return threads


def chooser_on(machine: Machine, choices: tuple[int, ...] = (1, 2)) -> ThreadChooser:
    return ThreadChooser(machine.applied.append, choices, clock=lambda: machine.now)


def test_each_setting_is_measured_then_the_faster_kept() -> None:
    machine = Machine({1: 0.010, 2: 0.006})
    chooser = chooser_on(machine)
    used = [machine.batch(chooser, 8) for _ in range(20)]
    assert used[: 2 * SAMPLES] == [1] * SAMPLES + [2] * SAMPLES  # each tried SAMPLES times first
    assert set(used[2 * SAMPLES :]) == {2}
    assert machine.applied == [1, 2]  # applied only when it changes
    assert chooser.describe()["ms_per_query"]["8+"] == {"1": 10.0, "2": 6.0}


def test_a_change_of_load_is_followed_within_a_window() -> None:
    machine = Machine({1: 0.010, 2: 0.006})  # quiet: two threads faster
    chooser = chooser_on(machine)
    for _ in range(50):
        machine.batch(chooser, 8)
    assert chooser.current == 2
    machine.per_query = {1: 0.020, 2: 0.080}  # other processes took the cores: one thread now faster
    started = machine.now
    used = []
    while machine.now - started < 3 * EXPLORE_S:
        used.append(machine.batch(chooser, 8))
    assert used[:4].count(2) == 2  # two slow batches outvote the quiet ones: one thread from then on ...
    assert used[4:].count(2) <= 3  # ... but for a few tries (EXPLORE_S, then twice that, ...)
    assert len(used) > 50
    machine.per_query = {1: 0.010, 2: 0.006}  # quiet again: back to two threads once re-measured
    started = machine.now
    back = []
    while machine.now - started < (SAMPLES + 1) * EXPLORE_S:
        back.append(machine.batch(chooser, 8))
    assert back[-20:].count(2) >= 19  # two fresh fast timings (a try, and one EXPLORE_S later) were enough


def test_tries_that_lose_are_spaced_out_and_a_faster_try_brings_the_switch() -> None:
    """A setting out of use is tried after EXPLORE_S, then after twice as long each time it loses, up to
    EXPLORE_MAX_S (each try is a slow batch, and with many clients a visible share of the tail); when the load
    turns and it is faster, it is tried again after EXPLORE_S and taken."""
    machine = Machine({1: 0.004, 2: 0.040})  # the other setting is 10x slower: trying it must stay rare
    chooser = chooser_on(machine)
    tried_at = []
    while machine.now < 200:
        started = machine.now
        if machine.batch(chooser, 4) == 2:
            tried_at.append(started)
    gaps = [later - earlier for earlier, later in itertools.pairwise(tried_at[SAMPLES - 1 :])]
    assert len(gaps) >= 5
    for i, gap in enumerate(gaps):  # measured from the end of the try before, so a batch or two over the wait
        assert min(EXPLORE_S * 2**i, EXPLORE_MAX_S) < gap < min(EXPLORE_S * 2**i, EXPLORE_MAX_S) + 0.5, i
    assert chooser.describe()["retry_after_s"] == {"4-7": EXPLORE_MAX_S}
    machine.per_query = {1: 0.040, 2: 0.004}  # the load turned: the setting out of use is now 10x faster
    turned, used = machine.now, [1]
    while used[-3:] != [2, 2, 2]:  # taken, not just tried
        used.append(machine.batch(chooser, 4))
    assert machine.now - turned < EXPLORE_MAX_S + EXPLORE_S + 1  # one try at the longest wait, one soon after
    assert chooser.describe()["retry_after_s"] == {"4-7": EXPLORE_S}  # a change: look again soon


def test_a_pause_in_traffic_does_not_count_a_faster_try_as_a_loss() -> None:
    """After a pause every setting is stale, the one in use too: only the other is tried, and when it is faster
    the wait falls back to EXPLORE_S (the winner's own fresh timing was judged as the try, a loss, before)."""
    machine = Machine({1: 0.040, 2: 0.004})
    chooser = chooser_on(machine)
    while chooser.describe()["retry_after_s"].get("8+", 0) < 2 * EXPLORE_S:  # 1 tried and lost: the wait grew
        machine.batch(chooser, 8)
    machine.per_query = {1: 0.002, 2: 0.040}  # the load turned: one thread now beats two as they were ...
    machine.now += 60  # ... during a pause in traffic
    used = [machine.batch(chooser, 8) for _ in range(3)]
    assert used[0] == 1  # the setting out of use is tried first, the one in use is not "tried"
    assert chooser.describe()["retry_after_s"]["8+"] == EXPLORE_S  # faster: look again soon


def test_batch_sizes_are_compared_only_with_their_own_class() -> None:
    machine = Machine({1: 0.010, 2: 0.006})
    chooser = chooser_on(machine)
    for _ in range(20):
        machine.batch(chooser, 16)
    assert chooser.current == 2
    assert chooser.choose(1) == 1  # single queries have not been timed yet: measured on their own
    assert [size_class(n) for n in (1, 2, 3, 4, 7, 8, 500)] == [1, 2, 2, 3, 3, 4, 4]


def test_choices() -> None:
    assert default_choices(1) == (1,) and default_choices(2) == (1, 2) and default_choices(8) == (1, 4, 8)
    machine = Machine({1: 0.01})
    chooser = chooser_on(machine, choices=(1,))
    assert {machine.batch(chooser, 3) for _ in range(10)} == {1} and machine.applied == [1]
    with pytest.raises(ValueError):
        ThreadChooser(machine.applied.append, (0, 2))


def test_switches_count_changes_only_and_forget_applied_applies_again() -> None:
    machine = Machine({1: 0.010, 2: 0.006})
    chooser = chooser_on(machine)
    for _ in range(20):
        machine.batch(chooser, 8)
    assert machine.applied == [1, 2] and chooser.switches == 1  # the first setting applied is not a switch
    chooser.forget_applied()  # someone else set torch's threads (the warm-up does)
    assert chooser.current is None
    assert machine.batch(chooser, 8) == 2 and machine.applied == [1, 2, 2] and chooser.current == 2
    assert chooser.switches == 1


def test_empty_batches_and_negative_timings_are_not_recorded() -> None:
    machine = Machine({1: 0.010})
    chooser = chooser_on(machine, choices=(1,))
    chooser.record(0, 1, 0.5)
    chooser.record(4, 1, -0.001)
    assert chooser.describe()["ms_per_query"] == {}
    chooser.record(4, 1, 0.008)
    assert chooser.describe()["ms_per_query"] == {"4-7": {"1": 2.0}}


def test_a_deterministic_policy_keeps_every_core_and_an_injected_one_its_answer(monkeypatch) -> None:
    """RETRIEVAL_DETERMINISTIC=1: the count does not follow timings (two runs under different loads compute alike)."""
    from retrieval import timing

    machine = Machine({1: 0.010, 4: 0.030})  # one thread faster: a timed chooser would take it
    monkeypatch.setenv(timing.DETERMINISTIC_ENV, "1")
    chooser = chooser_on(machine, (1, 4))
    assert {machine.batch(chooser, 8) for _ in range(20)} == {4} and machine.applied == [4]
    with timing.use(timing.Policy(answers={"threads": "1"})):
        assert machine.batch(chooser, 8) == 1


def test_more_threads_are_tried_only_where_cores_are_idle() -> None:
    """With no core idle (other processes on them all), two threads are never tried: each try would be a batch
    at several times the cost. Once a core is idle they are measured and, faster, kept."""
    machine = Machine({1: 0.010, 2: 0.006})
    idle = [0.0]
    chooser = ThreadChooser(machine.applied.append, (1, 2), clock=lambda: machine.now, idle=lambda: idle[0])
    used = [machine.batch(chooser, 8) for _ in range(200)]
    assert set(used) == {1} and machine.applied == [1]
    idle[0] = 1.0
    used = [machine.batch(chooser, 8) for _ in range(20)]
    assert used[:SAMPLES] == [2] * SAMPLES and set(used[SAMPLES:]) == {2}
    idle[0] = 0.0  # in use now: two threads stay choosable, judged by their own timings
    machine.per_query = {1: 0.020, 2: 0.080}
    used = [machine.batch(chooser, 8) for _ in range(20)]
    assert used[-1] == 1


def test_idle_cores_are_read_from_proc_stat(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 800 0 0 0 0 0 0\n")
    idle = IdleCores(interval=0.0, path=str(stat))
    assert idle() is None  # one sample: nothing to compare yet
    stat.write_text("cpu  150 0 150 900 0 0 0 0 0 0\n")  # 200 jiffies, 100 of them idle: half the cores
    assert idle() == pytest.approx(0.5 * (os.cpu_count() or 1))
    assert IdleCores(path=str(tmp_path / "none"))() is None
