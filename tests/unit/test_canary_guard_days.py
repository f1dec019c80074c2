"""Simulated days of the canary guard's own code (tests/helpers/guard_days.py): at equal
failure rates it does not roll back, and a worse new side is caught.

The point-estimate guard this replaced (a 2-point drop on one evaluation) rolled back
every one of these days with both sides failing 5%, within minutes."""

from __future__ import annotations

from dataclasses import replace

import pytest
from guard_days import DAY, Traffic, simulate

from bridge.canary.guard import Bounds

EQUAL = [
    Traffic(per_second, 0.2, rate, rate)
    for per_second in (1, 10, 100)
    for rate in (0.01, 0.05, 0.2)
]


@pytest.mark.parametrize("traffic", EQUAL, ids=lambda t: f"{t.per_second}/s-{t.old_failing:.0%}")
def test_alike_sides_are_not_rolled_back_in_a_day(traffic):
    day = simulate(traffic, seed=11)
    assert day.tripped_at is None, f"a false rollback after {day.tripped_at} s"


def test_a_point_estimate_guard_would_have_rolled_back_the_same_day():
    """The simulation can fail: the old bounds (trip on one evaluation, no test of
    significance) do, at 5% on both sides."""
    old = replace(Bounds(), max_drop=0.02, significance=1.0, failure_limit=1)
    day = simulate(Traffic(10, 0.2, 0.05, 0.05), seed=11, bounds=old, window=300, window_runs=500)
    assert day.tripped_at is not None and day.tripped_at < DAY / 24


@pytest.mark.parametrize("per_second", [1, 10, 100])
def test_a_new_side_failing_30_percent_is_caught_within_a_few_dozen_runs(per_second):
    day = simulate(Traffic(per_second, 0.05, 0.3, 0.01), seed=3)
    assert day.tripped_at is not None
    assert day.new_runs <= 60 and day.new_failures <= 20


@pytest.mark.parametrize(("per_second", "within"), [(10, 3000), (100, 4000)])
def test_three_times_the_old_sides_failures_is_caught(per_second, within):
    """3% against 1%: the target is 3,000 new-side runs. At 100 tasks/s the window's cut
    (2,000 new-side runs, 8,000 old: the cost bound) holds the sample, and this seed
    needs 3,759 (other seeds 1,100-2,100: docs/operations.md)."""
    day = simulate(Traffic(per_second, 0.2, 0.03, 0.01), seed=3)
    assert day.tripped_at is not None and day.new_runs <= within
