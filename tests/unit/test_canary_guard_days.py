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
    Traffic(per_second, share, rate, rate)
    for per_second in (1, 10, 100)
    for share in (0.05, 0.2)
    for rate in (0.01, 0.05, 0.2)
]


def name(traffic: Traffic) -> str:
    return f"{traffic.per_second}/s-{traffic.share:.0%}-{traffic.new_failing:.0%}"


@pytest.mark.parametrize("traffic", EQUAL, ids=name)
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


@pytest.mark.parametrize(
    "traffic",
    [
        Traffic(per_second, share, 0.03, 0.01)
        for per_second in (1, 10, 100)
        for share in (0.05, 0.2)
    ],
    ids=name,
)
def test_three_times_the_old_sides_failures_is_caught_within_3000_new_side_runs(traffic):
    """3% against 1%, the issue's target. At 1 task/s and a 5% share that is hours of
    runs: the long window (the ledger's day, cut at 10,000 new-side runs) holds them."""
    day = simulate(traffic, seed=3)
    assert day.tripped_at is not None and day.new_runs <= 3000


def test_without_the_long_window_a_quiet_class_is_not_caught_in_a_day():
    """The simulation can fail: with the history as short as the window (the guard before
    the ledger), 3% against 1% at 1 task/s goes unseen all day."""
    day = simulate(Traffic(1, 0.2, 0.03, 0.01), seed=3, history=300)
    assert day.tripped_at is None
