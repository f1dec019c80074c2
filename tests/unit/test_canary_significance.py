"""The guard's exact test (bridge/canary/significance.py) is SciPy's one-sided Fisher
test, and it does what the guard relies on it for."""

from __future__ import annotations

import random

import pytest
from scipy.stats import fisher_exact

from bridge.canary.significance import excess_failures_p


def scipy_p(new_failures: int, new_runs: int, old_failures: int, old_runs: int) -> float:
    table = [[new_failures, new_runs - new_failures], [old_failures, old_runs - old_failures]]
    return float(fisher_exact(table, alternative="greater").pvalue)


def test_it_agrees_with_scipy_over_random_tables():
    rng = random.Random(7)
    for _ in range(2000):
        new_runs, old_runs = rng.randint(1, 3000), rng.randint(1, 12_000)
        new_failures = rng.randint(0, min(new_runs, rng.choice([3, 30, new_runs])))
        old_failures = rng.randint(0, min(old_runs, rng.choice([3, 300, old_runs])))
        ours = excess_failures_p(new_failures, new_runs, old_failures, old_runs)
        theirs = scipy_p(new_failures, new_runs, old_failures, old_runs)
        assert ours == pytest.approx(theirs, rel=1e-8, abs=1e-300)


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ((1, 3, 0, 1000), 0.003),  # one failure in three runs: no proof
        ((12, 40, 0, 160), 9.1e-10),  # 30% failing against none
        ((90, 3000, 120, 12_000), 2.8e-14),  # 3% against 1% over thousands of runs
        ((20, 1000, 20, 1000), 0.56),  # alike
    ],
)
def test_known_tables(table, expected):
    assert excess_failures_p(*table) == pytest.approx(expected, rel=0.05)


def test_no_failure_on_the_new_side_is_no_evidence():
    assert excess_failures_p(0, 100, 50, 100) == 1.0
