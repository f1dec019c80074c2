"""Simulated days of the canary guard: Poisson arrivals split between the two sides,
each run failing at its side's rate, and the guard's own ``verdict`` and
``Suspicions`` judging the window every second, as beat has it do. A day ends at its
first rollback.

The window is the guard's: the last ``window`` seconds, cut for both sides at once where
the new side has ``window_runs`` runs or the old side four times that
(``guard.read_window``), to the second. A failure counts when it happens, as the guard
now counts the active rows' failures.

Run as a script for the table docs/operations.md quotes::

    python3 tests/helpers/guard_days.py [DAYS]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bridge.canary.guard import (
    OLD_RUNS_PER_NEW,
    Bounds,
    SideStats,
    Suspicions,
    Window,
    verdict,
)
from bridge.canary.weights import NATIVE
from bridge.config import load_settings

DAY = 86_400


@dataclass(frozen=True)
class Traffic:
    per_second: float  # tasks of the class a second, both sides
    share: float  # the new side's part (0..1)
    new_failing: float  # the chance a new-side run fails
    old_failing: float  # the same on the old side


@dataclass(frozen=True)
class Day:
    tripped_at: int | None  # seconds into the day of the rollback, or None
    new_runs: int  # the new side's runs until then
    new_failures: int
    class_runs: int  # both sides' runs until then


def simulate(
    traffic: Traffic,
    seed: int,
    *,
    seconds: int = DAY,
    bounds: Bounds | None = None,
    window: int | None = None,
    window_runs: int | None = None,
) -> Day:
    """One day (or ``seconds``) of ``traffic``; the guard's settings are the defaults
    unless given."""
    defaults = load_settings({})
    bounds = bounds or Bounds.from_settings(defaults)
    window = window or defaults.canary_window
    window_runs = window_runs or defaults.canary_window_runs
    rng = np.random.default_rng(seed)
    new_runs = rng.poisson(traffic.per_second * traffic.share, seconds)
    old_runs = rng.poisson(traffic.per_second * (1 - traffic.share), seconds)
    new_failed = rng.binomial(new_runs, traffic.new_failing)
    old_failed = rng.binomial(old_runs, traffic.old_failing)
    # Totals before second t: index t of each cumulative sum (t from 0 to seconds).
    sums = [
        np.concatenate(([0], np.cumsum(a))) for a in (new_runs, old_runs, new_failed, old_failed)
    ]
    runs_new, runs_old, fails_new, fails_old = sums
    t = np.arange(1, seconds + 1)
    # The window's start for each second: the cut, where a side reaches its cap, or the
    # window's own start, whichever is later.
    cut_new = np.searchsorted(runs_new, runs_new[t] - window_runs, side="right") - 1
    cut_old = (
        np.searchsorted(runs_old, runs_old[t] - OLD_RUNS_PER_NEW * window_runs, side="right") - 1
    )
    start = np.maximum.reduce([np.maximum(t - window, 0), cut_new, cut_old])
    n_new, n_old = runs_new[t] - runs_new[start], runs_old[t] - runs_old[start]
    f_new, f_old = fails_new[t] - fails_new[start], fails_old[t] - fails_old[start]
    # An evaluation whose new side fails no more often than the old cannot trip: the
    # guard's verdict is skipped there (and its count of bad evaluations in a row reset).
    worse = f_new * np.maximum(n_old, bounds.min_runs) > f_old * n_new
    suspicions = Suspicions(bounds.failure_limit)
    judged: dict[tuple[int, ...], str | None] = {}
    for i in range(seconds):
        if not worse[i]:
            suspicions.confirmed("C", NATIVE, None)
            continue
        key = (int(n_new[i]), int(f_new[i]), int(n_old[i]), int(f_old[i]), int(t[i] - start[i]))
        if key not in judged:  # the verdict is a function of the counts
            new = SideStats(runs=key[0], successes=key[0] - key[1])
            old = SideStats(runs=key[2], successes=key[2] - key[3])
            judged[key] = verdict(Window("C", NATIVE, key[4], new, old), bounds)
        if suspicions.confirmed("C", NATIVE, judged[key]):
            end = int(t[i])
            return Day(
                end, int(runs_new[end]), int(fails_new[end]), int(runs_new[end] + runs_old[end])
            )
    return Day(None, int(runs_new[-1]), int(fails_new[-1]), int(runs_new[-1] + runs_old[-1]))


EQUAL = [
    Traffic(per_second, share, rate, rate)
    for per_second in (1, 10, 100)
    for share in (0.05, 0.2)
    for rate in (0.01, 0.05, 0.2)
]


def main(days: int) -> None:
    print("| tasks/s | share | failing (both) | days with a false rollback |")
    print("|---|---|---|---|")
    for traffic in EQUAL:
        tripped = sum(simulate(traffic, seed).tripped_at is not None for seed in range(days))
        print(
            f"| {traffic.per_second:g} | {traffic.share:.0%} | {traffic.old_failing:.0%} "
            f"| {tripped} of {days} |",
            flush=True,
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
