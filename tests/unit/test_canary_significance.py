"""The guard's exact test (bridge/canary/significance.py) is SciPy's one-sided Fisher
test, and it does what the guard relies on it for."""

from __future__ import annotations

import random

import pytest
from scipy.stats import binom, fisher_exact

from bridge.canary.significance import excess_failures_p, rate_change_p


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


def scipy_rate_p(new: int, new_exposure: int, old: int, old_exposure: int) -> float:
    """The conditional binomial test of two Poisson rates, doubled smaller tail."""
    events, share = new + old, new_exposure / (new_exposure + old_exposure)
    lower, upper = binom.cdf(new, events, share), binom.sf(new - 1, events, share)
    return min(1.0, 2 * float(min(lower, upper)))


def test_the_rate_test_agrees_with_scipy_over_random_counts():
    rng = random.Random(11)
    for _ in range(2000):
        new_exposure, old_exposure = rng.randint(1, 3000), rng.randint(1, 12_000)
        new = rng.randint(0, rng.choice([3, new_exposure, 3 * new_exposure]))
        old = rng.randint(0, rng.choice([3, old_exposure, 3 * old_exposure]))
        ours = rate_change_p(new, new_exposure, old, old_exposure)
        assert ours == pytest.approx(scipy_rate_p(new, new_exposure, old, old_exposure), rel=1e-7)


def test_a_side_that_forgets_its_followups_is_told_apart_from_chance():
    # One follow-up per run on the old side's 80, none on the new side's 20.
    assert rate_change_p(0, 20, 80, 80) < 1e-6
    assert rate_change_p(0, 2, 8, 8) > 0.01, "two runs prove nothing"
    assert rate_change_p(20, 20, 80, 80) == 1.0
    assert rate_change_p(0, 20, 0, 80) == 1.0, "no follow-up on either side"
