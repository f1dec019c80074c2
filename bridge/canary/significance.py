"""Whether the new side fails more often than the old one by more than chance: the
one-sided p-value of Fisher's exact test on the two sides' runs; and whether its runs
queue follow-ups at another rate (``rate_change_p``).

Exact rather than a normal approximation: the guard judges from a few runs (a new side
at 5% of a quiet class has a dozen in its window), where a z-test's tail is far off and
"1 failure in 3 runs against none in 1,000" would look certain. It is the hypergeometric
tail, in log space (``math.lgamma``), summed from the observed count until the terms
vanish; ``tests/unit/test_canary_significance.py`` holds it to SciPy's ``fisher_exact``,
which the bridge does not import for this one sum (SciPy's stats package costs a worker
2 s and 84 MB to load).
"""

from __future__ import annotations

from math import exp, floor, lgamma, log, log1p

_NEGLIGIBLE = 1e-12  # a term this small against the sum so far ends it (past the mode)


def _log_choose(n: int, k: int) -> float:
    return lgamma(n + 1) - lgamma(k + 1) - lgamma(n - k + 1)


def excess_failures_p(new_failures: int, new_runs: int, old_failures: int, old_runs: int) -> float:
    """P(the new side has at least ``new_failures`` of all failures) when both sides fail
    alike: of the ``new_failures + old_failures`` failed runs among the two sides' runs,
    as many or more fell on the new side's ``new_runs`` by chance. 1.0 without a failure
    on the new side."""
    if new_failures <= 0:
        return 1.0
    runs, failures = new_runs + old_runs, new_failures + old_failures
    mode = floor((new_runs + 1) * (failures + 1) / (runs + 2))
    whole = _log_choose(runs, new_runs)
    total = 0.0
    for k in range(new_failures, min(new_runs, failures) + 1):
        term = exp(_log_choose(failures, k) + _log_choose(runs - failures, new_runs - k) - whole)
        total += term
        if k > mode and term <= total * _NEGLIGIBLE:
            break
    return min(1.0, total)


def _log_binomial(n: int, k: int, share: float) -> float:
    return _log_choose(n, k) + k * log(share) + (n - k) * log1p(-share)


def rate_change_p(new_count: int, new_exposure: int, old_count: int, old_exposure: int) -> float:
    """The two-sided p-value that two sides' rates of events (follow-ups per successful
    run) are alike: of all ``new_count + old_count`` events, a split between the sides at
    least as uneven as this one, were each side's share its share of the exposures (the
    conditional binomial test of two Poisson rates). 1.0 without an event or an
    exposure."""
    events, exposure = new_count + old_count, new_exposure + old_exposure
    if events == 0 or new_exposure <= 0 or old_exposure <= 0:
        return 1.0
    share = new_exposure / exposure
    mode = floor((events + 1) * share)

    def tail(ks: range) -> float:
        total = 0.0
        for k in ks:
            term = exp(_log_binomial(events, k, share))
            total += term
            if abs(k - mode) > 1 and term <= total * _NEGLIGIBLE:
                break
        return total

    lower, upper = tail(range(new_count, -1, -1)), tail(range(new_count, events + 1))
    return min(1.0, 2 * min(lower, upper))
