"""Simulated days of the canary guard: Poisson arrivals split between the two sides,
each run failing at its side's rate, and the guard's own ``verdict`` and
``Suspicions`` judging the window every second, as beat has it do. A day ends at its
first rollback.

The windows are the guard's (``guard.judged_windows``), to the second: the short one, the
last ``window`` seconds, cut for both sides at once where the new side has
``window_runs`` runs or the old side four times that (``guard.read_window``); and the
long one, the last ``history`` seconds, cut where the new side has
``LONG_RUNS_PER_SHORT`` times ``window_runs`` runs (``guard.long_windows``: the ledger's
minutes, and its ``SETTLE`` s, are not simulated).
A failure counts when it happens, as the guard counts the active rows' failures.

Run as a script for the table docs/canary-guard.md quotes::

    python3 tests/helpers/guard_days.py [DAYS]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bridge.canary.guard import (
    LONG_RUNS_PER_SHORT,
    OLD_RUNS_PER_NEW,
    Bounds,
    SideStats,
    Suspicions,
    Window,
    verdict,
)
from bridge.config import load_settings
from bridge.queue.implementations import PYTHON

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
    history: int | None = None,
) -> Day:
    """One day (or ``seconds``) of ``traffic``; the guard's settings are the defaults
    unless given."""
    defaults = load_settings({})
    bounds = bounds or Bounds.from_settings(defaults)
    window = window or defaults.canary_window
    window_runs = window_runs or defaults.canary_window_runs
    history = history or defaults.canary_history
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

    def cut(runs: np.ndarray, cap: int) -> np.ndarray:
        """For each second, where a side's newest ``cap`` runs begin."""
        return np.searchsorted(runs, runs[t] - cap, side="right") - 1

    def counts(start: np.ndarray) -> list[np.ndarray]:
        """Each second's window from ``start``: new runs, new failures, old runs, old
        failures."""
        return [a[t] - a[start] for a in (runs_new, fails_new, runs_old, fails_old)]

    # The short window: the last ``window`` s, cut where a side reaches its cap.
    new_cut = cut(runs_new, window_runs)
    old_cut = cut(runs_old, OLD_RUNS_PER_NEW * window_runs)
    short_start = np.maximum.reduce([np.maximum(t - window, 0), new_cut, old_cut])
    short = counts(short_start)
    # The long one (the ledger's): the last ``history`` s, cut at the new side's cap only.
    long_start = np.maximum(
        np.maximum(t - history, 0), cut(runs_new, LONG_RUNS_PER_SHORT * window_runs)
    )
    long = counts(long_start)
    few_old = short[2] < bounds.min_runs  # the short window's old side is the history's
    short[2] = np.where(few_old, long[2], short[2])
    short[3] = np.where(few_old, long[3], short[3])
    spans = (t - short_start, t - long_start)

    def worse(n_new, f_new, n_old, f_old):
        return f_new * np.maximum(n_old, bounds.min_runs) > f_old * n_new

    # An evaluation whose new side fails no more often than the old in either window
    # cannot trip: the verdict is skipped there (and the count of bad evaluations reset).
    suspect = worse(*short) | worse(*long)
    suspicions = Suspicions(bounds.failure_limit)
    judged: dict[tuple[int, ...], str | None] = {}

    def judge(i: int, window: list[np.ndarray], span: np.ndarray) -> str | None:
        key = (*(int(a[i]) for a in window), int(span[i]))
        if key not in judged:  # the verdict is a function of the counts
            new = SideStats(runs=key[0], successes=key[0] - key[1])
            old = SideStats(runs=key[2], successes=key[2] - key[3])
            judged[key] = verdict(Window("C", PYTHON, key[4], new, old), bounds)
        return judged[key]

    for i in range(seconds):
        if not suspect[i]:
            suspicions.confirmed("C", PYTHON, None)
            continue
        reason = judge(i, short, spans[0]) or judge(i, long, spans[1])
        if suspicions.confirmed("C", PYTHON, reason):
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


WORSE = [
    Traffic(per_second, share, new, 0.01)
    for new in (0.03, 0.3)
    for per_second in (1, 10, 100)
    for share in (0.05, 0.2)
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
    print(
        "\n| new side failing (old 1%) | tasks/s | share | new-side runs before the rollback "
        "| seconds | days without one |"
    )
    print("|---|---|---|---|---|---|")
    for traffic in WORSE:
        found = [simulate(traffic, seed) for seed in range(days)]
        caught = [day for day in found if day.tripped_at is not None]
        runs = sorted(day.new_runs for day in caught) or [0]
        took = sorted(day.tripped_at or 0 for day in caught) or [0]
        print(
            f"| {traffic.new_failing:.0%} | {traffic.per_second:g} | {traffic.share:.0%} "
            f"| {runs[0]:,}-{runs[-1]:,} | {took[0]:,}-{took[-1]:,} "
            f"| {len(found) - len(caught)} |",
            flush=True,
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
