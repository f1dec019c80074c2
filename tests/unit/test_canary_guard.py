"""The canary guard (bridge/canary/guard.py): the verdict's bounds and minimum sample,
the window read off archive rows, and the rollbacks and ramp steps it makes, on SQLite."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import pytest
import sqlalchemy as sa
from canary_archive import TASK_IDS, archived, owner

from bridge.canary import guard, short_window
from bridge.canary import sql as canary_sql
from bridge.canary.guard import (
    Bounds,
    SideStats,
    Suspicions,
    Window,
    guard_once,
    long_windows,
    read_window,
    read_windows,
    summed_window,
    verdict,
)
from bridge.canary.ledger import SETTLE, Ledger
from bridge.canary.store import CanaryStore
from bridge.canary.weights import CanaryState, bucket, stored
from bridge.config import load_settings
from bridge.queue import make_engine
from bridge.queue.implementations import CELERY, PYTHON
from bridge.queue.schema import worker_activetask as active

BOUNDS = Bounds(slowdown_floor=0.1)  # the defaults but the floor
ONCE = replace(BOUNDS, failure_limit=1)


def side(runs: int, failures: int, p50: float | None = 0.01) -> SideStats:
    return SideStats(runs=runs, successes=runs - failures, p50=p50, p99=p50)


def window(new: SideStats, old: SideStats) -> Window:
    return Window("C", PYTHON, 300, new, old)


def test_the_reason_names_both_ratios_the_window_and_the_chance():
    reason = verdict(window(side(40, 12), side(160, 0)), BOUNDS)
    assert reason == (
        "new side success 70.0% over 40 runs, old side 100.0% over 160 runs, "
        "window 300 s (p = 9.1e-10)"
    )


@pytest.mark.parametrize(
    ("new", "old"),
    [
        (side(3, 1), side(1000, 0)),  # 1 failure in 3 runs
        (side(9, 9), side(100, 0)),  # fewer runs than the minimum
        (side(10, 2), side(100, 0)),  # 80%, but fewer failures than the minimum
        (side(0, 0), side(0, 0)),
    ],
    ids=["one-in-three", "min-runs", "min-failures", "nothing"],
)
def test_no_verdict_without_a_sample(new, old):
    assert verdict(window(new, old), BOUNDS) is None


def test_a_difference_must_be_significant_not_only_larger_than_the_bound():
    # 30% failing against none: 6 of 20 could be luck (p 3e-5), 12 of 40 cannot.
    assert verdict(window(side(20, 6), side(80, 0)), BOUNDS) is None
    assert verdict(window(side(40, 12), side(160, 0)), BOUNDS) is not None
    assert verdict(window(side(20, 6), side(80, 0)), replace(BOUNDS, significance=1e-4))
    # Both failing 20%: a point estimate 5 points apart is no evidence.
    assert verdict(window(side(100, 25), side(400, 80)), BOUNDS) is None
    # 3% against 1% over thousands of runs is.
    assert verdict(window(side(3000, 90), side(12000, 120)), BOUNDS) is not None


def test_a_significant_difference_must_also_exceed_the_practical_bound():
    # 2.5% against 2.0% over a million runs each: real, but under the 1-point bound.
    assert verdict(window(side(10**6, 25_000), side(10**6, 20_000)), BOUNDS) is None
    assert verdict(window(side(10**6, 35_000), side(10**6, 20_000)), BOUNDS) is not None
    wide = replace(BOUNDS, max_drop=0.02)
    assert verdict(window(side(10**6, 35_000), side(10**6, 20_000)), wide) is None


def test_an_old_side_below_the_minimum_counts_as_that_many_successes():
    reason = verdict(window(side(30, 30), side(5, 2)), BOUNDS)
    assert reason is not None and "old side 100.0% over 10 runs" in reason
    assert verdict(window(side(30, 3), side(5, 2)), BOUNDS) is None


def test_the_slowdown_bound_needs_both_the_factor_and_the_floor():
    old = side(100, 3, p50=0.2)
    reason = verdict(window(side(100, 3, p50=1.0), old), BOUNDS)
    assert reason is not None
    assert reason.startswith("new side success 97.0% over 100 runs, old side 97.0% over 100")
    assert "new side p50 1.000 s against the old side's 0.200 s" in reason
    assert verdict(window(side(100, 3, p50=0.5), old), BOUNDS) is None  # 2.5 times
    fast = side(100, 3, p50=0.01)
    assert verdict(window(side(100, 3, p50=0.05), fast), BOUNDS) is None  # 0.04 s slower
    assert verdict(window(side(100, 3, p50=0.05), fast), replace(BOUNDS, slowdown_floor=0.03))
    # Slowness alone trips it: the minimum failures are the success ratio's sample.
    assert "new side p50 1.000 s" in (verdict(window(side(100, 0, p50=1.0), old), BOUNDS) or "")
    assert verdict(window(side(9, 0, p50=1.0), old), BOUNDS) is None  # under min_runs
    # Nor against an old side without a sample.
    assert verdict(window(side(150, 3, p50=1.0), side(5, 0, p50=0.2)), BOUNDS) is None


def effects(runs: int, followups: int, labelled: bool = True) -> SideStats:
    """``runs`` successes that queued ``followups`` follow-ups in all."""
    counted = runs if labelled else 0
    return replace(side(runs, 0), followups=followups, labelled_successes=counted)


def test_a_new_side_that_queues_other_followups_is_worse():
    reason = verdict(window(effects(40, 0), effects(160, 160)), BOUNDS)
    assert reason is not None and reason.endswith(
        "new side queued 0.00 follow-ups per success against the old side's 1.00 (p = 6.2e-16)"
    )
    assert verdict(window(effects(80, 160), effects(320, 320)), BOUNDS), "twice as many"
    assert verdict(window(effects(40, 30), effects(160, 160)), BOUNDS) is None, "within 50%"
    assert verdict(window(effects(5, 0), effects(160, 160)), BOUNDS) is None, "5 runs"
    # phd's runs carry no count (the celery level's old side): nothing to compare.
    assert verdict(window(effects(40, 40), effects(160, 0, labelled=False)), BOUNDS) is None
    assert (
        verdict(window(effects(40, 0), effects(160, 160)), replace(BOUNDS, max_followup_change=1))
        is None
    )


def test_a_rollback_needs_failure_limit_bad_evaluations_in_a_row():
    suspicions = Suspicions(limit=3)
    bad, good = "worse", None
    assert [suspicions.confirmed("C", PYTHON, r) for r in (bad, bad, good, bad, bad)] == [False] * 5
    assert suspicions.confirmed("C", PYTHON, bad)  # the third in a row
    assert not suspicions.confirmed("D", PYTHON, bad), "each class counts its own"
    assert not suspicions.confirmed("C", "celery", bad), "and each level"


def test_bounds_come_from_the_settings():
    settings = load_settings(
        {
            "BRIDGE_CANARY_MIN_RUNS": "20",
            "BRIDGE_CANARY_MIN_FAILURES": "5",
            "BRIDGE_CANARY_MAX_DROP": "0.1",
            "BRIDGE_CANARY_SIGNIFICANCE": "0.001",
            "BRIDGE_CANARY_FAILURE_LIMIT": "2",
            "BRIDGE_CANARY_MAX_SLOWDOWN": "2",
            "BRIDGE_CANARY_SLOWDOWN_FLOOR": "0.5",
        }
    )
    assert Bounds.from_settings(settings) == Bounds(20, 5, 0.1, 0.001, 2, 2.0, 0.5)
    assert Bounds.from_settings(load_settings({})) == Bounds()


# -- on SQLite, with archive rows ---------------------------------------------------------


@pytest.mark.parametrize("level", [PYTHON, CELERY])
def test_a_summed_span_counts_what_reading_each_row_counts(engine, level):
    """``canary report --since``'s grouped statement against the row-by-row window, on
    SQLite and MariaDB: the same runs per side, without durations."""
    engine = make_engine(engine.url.render_as_string(hide_password=False))  # SQLite's functions
    phorge = "4242:1700000000:web01:3"  # Phorge's own taskmaster: no label
    for label, extra in [
        ("native", {"count": 4}),
        ("native", {"failures": 2}),
        ("runner", {"count": 3}),
        ("runner", {"failures": 1, "result": 1}),
        ("runner-fallback", {"count": 2}),
        ("phd-fallback", {}),
        ("runner", {"result": 2}),
        ("runner", {"count": 5, "age": 1000}),
        ("native", {"count": 5, "task_class": "Other"}),
    ]:
        archived(engine, owner(label), **extra)
    archived(engine, phorge, count=2)
    archived(engine, "phd:1:1700000000:host:2", failures=1)
    failed_rows(engine, None, 2, failures=0)  # fell back, waiting for the old side
    failed_rows(engine, owner("runner"), 1)  # failed on the old side, waiting for its retry
    each = read_window(engine, "C", level, 300, 500)
    summed = summed_window(engine, "C", level, 300)
    now = int(time.time())
    (ledger,) = long_windows(engine, Ledger(3600), [("C", level, now - 300)], now + SETTLE, 500)
    for side in ("new", "old"):
        assert getattr(summed, side) == replace(getattr(each, side), p50=None, p99=None), side
        assert getattr(ledger, side) == getattr(summed, side), side
    assert each.new.runs and each.old.runs


def test_the_window_splits_the_rows_by_label(db):
    engine, _ = db
    archived(engine, owner("native"), count=4, duration_us=20_000)
    archived(engine, owner("native"), failures=2)  # ran 3 times, failed twice first
    archived(engine, owner("runner"), count=3, duration_us=5_000)
    archived(engine, owner("runner"), failures=1, result=1)  # failed, then for good
    archived(engine, owner("runner-fallback"), count=2, duration_us=7_000)
    archived(engine, owner("runner"), result=2)  # cancelled: its last run never ran
    archived(engine, owner("runner"), count=5, age=1000)  # outside the window
    archived(engine, owner("native"), count=5, task_class="Other")
    w = read_window(engine, "C", PYTHON, 300, 500)
    assert (w.task_class, w.level, w.seconds) == ("C", PYTHON, 300)
    assert w.new == SideStats(
        runs=4 + 3 + 2,
        successes=5,
        temporary_failures=2,
        permanent_failures=0,
        fallbacks=2,
        p50=0.02,
        p99=0.02,
        implementations=("native",),
        labelled_successes=5,
    )
    assert w.old == SideStats(
        runs=3 + 2 + 2,
        successes=3 + 2,
        temporary_failures=1,
        permanent_failures=1,
        fallbacks=0,
        p50=0.005,
        p99=0.007,
        implementations=("runner", "runner-fallback"),
        labelled_successes=5,
    )
    assert w.new.ratio == pytest.approx(5 / 9) and w.new.failures == 4


def test_the_window_counts_the_followups_each_side_queued(db):
    engine, _ = db
    archived(engine, owner("native"), count=4)
    archived(engine, owner("native~2"), count=3)
    archived(engine, owner("runner~1"), count=10)
    archived(engine, owner("runner~1"), failures=1, result=1)  # a failure queues nothing
    w = read_window(engine, "C", PYTHON, 300, 500)
    assert (w.new.followups, w.new.labelled_successes, w.new.implementations) == (6, 7, ("native",))
    assert (w.old.followups, w.old.followups_per_success) == (10, 1.0)
    summed = summed_window(engine, "C", PYTHON, 300)
    assert (summed.new.followups, summed.old.followups) == (6, 10)


def test_at_the_bridge_level_phd_and_stock_owners_are_the_old_side(db):
    engine, _ = db
    archived(engine, f"phd:1:{int(time.time())}:web:1", count=2)
    archived(engine, f"1:{int(time.time())}:web:1", count=3)  # Phorge's own taskmasters
    archived(engine, f"phd-fallback:1:{int(time.time())}:web:1")
    archived(engine, owner("conduit"), count=4)
    w = read_window(engine, "C", CELERY, 300, 500)
    assert (w.new.runs, w.new.fallbacks, w.new.implementations) == (5, 1, ("conduit",))
    assert (w.old.runs, w.old.implementations) == (6, ("phd", "phd-fallback"))


def test_percentiles_are_of_successful_runs_in_seconds(db):
    engine, _ = db
    for ms in range(1, 101):
        archived(engine, owner("native"), duration_us=ms * 1000)
    archived(engine, owner("native"), result=1, duration_us=10**9)
    w = read_window(engine, "C", PYTHON, 300, 500)
    assert (w.new.p50, w.new.p99) == (0.05, 0.099)
    assert w.old == SideStats()


@pytest.mark.parametrize("page", [3, 1000])
def test_the_window_is_cut_for_both_sides_at_once(db, monkeypatch, page):
    """Both sides over the same span: cut where the new side has ``max_runs`` runs (or
    the old side four times that), so a busy old side does not judge a shorter span."""
    engine, _ = db
    monkeypatch.setattr(short_window, "PAGE_ROWS", page)  # pages that split rows of one second
    archived(engine, owner("native"), count=10, duration_us=1_000_000, age=20)
    archived(engine, owner("runner"), count=7, age=15)  # older than the cut: left out
    archived(engine, owner("native"), count=10, duration_us=1_000, age=10)
    archived(engine, owner("runner"), count=4, age=5)
    w = read_window(engine, "C", PYTHON, 300, 10)
    assert (w.new.runs, w.new.p99) == (10, 0.001)  # the newest ten only
    assert w.old.runs == 4
    assert 10 <= w.seconds <= 12, "the span judged, not the window asked for"
    busy = read_window(engine, "C", PYTHON, 300, 1)  # the old side reaches its cap, 4, first
    assert (busy.new.runs, busy.old.runs) == (0, 4)


def mixed(engine: sa.Engine, now: int) -> None:
    """20 batches of rows 10 s apart over several classes, on the same seconds, and
    active rows that failed at several ages: what one read for all classes sorts out."""
    phd = f"phd:1:{now}:web:1"
    for batch in range(20):
        age = 10 * batch
        archived(engine, owner("native"), count=3, task_class="A", age=age)
        archived(engine, owner("runner"), count=2, task_class="A", age=age)
        archived(engine, owner("runner"), count=5, task_class="B", age=age, failures=batch % 3)
        archived(engine, owner("native"), task_class="B", age=age, result=batch % 2)
        archived(engine, owner("native"), count=4, task_class="Other", age=age)
        archived(engine, owner("runner-fallback"), task_class="C", age=age + 5)
        archived(engine, phd, count=2, task_class="C", age=age)
        archived(engine, owner("conduit"), task_class="C", age=age, duration_us=1000 * age + 1)
    archived(engine, owner("native"), count=50, task_class="C", age=400)  # before every span
    for task_class, who, failures, age in [
        ("A", None, 0, 5),  # fell back, in both of A's windows
        ("A", None, 0, 20),  # in A's cut window, not in its 10 s one
        ("A", None, 0, 150),  # before A's cut
        ("B", owner("runner"), 2, 0),
        ("C", owner("runner-fallback"), 1, 100),
        ("C", owner("runner-fallback"), 1, 250),  # before C's cut at the celery level
        ("Other", None, 0, 0),
    ]:
        failed_rows(engine, who, 1, failures=failures, task_class=task_class, age=age)


@pytest.mark.parametrize("page", [2, 7, 1000])
def test_one_read_of_several_classes_gives_each_its_own_window(engine, monkeypatch, page):
    """The guard's and the scrape's one pass over the archive for all the classes asked
    (``read_windows``): each window is the one its class's own read gives, cut on its
    own (A by its new side, B by its old side, C at one level and not the other), over
    its own span (A's 10 s, as after a promotion), across pages, with its own active
    rows; on SQLite and MariaDB."""
    engine = make_engine(engine.url.render_as_string(hide_password=False))
    monkeypatch.setattr(short_window, "PAGE_ROWS", page)
    now = int(time.time())  # the server's clock, held for the reads to compare
    monkeypatch.setattr(canary_sql, "server_time", lambda: sa.select(sa.literal(now)))
    mixed(engine, now)
    asked = [
        ("A", PYTHON, 300),
        ("B", PYTHON, 300),
        ("C", PYTHON, 300),
        ("C", CELERY, 300),
        ("A", PYTHON, 10),
        ("D", PYTHON, 300),  # nothing archived
    ]
    together = read_windows(engine, asked, 25)
    assert together == [read_window(engine, *one, 25) for one in asked]
    a, b, c_native, c_bridge, a_since, d = together
    assert a.seconds < 300 and (a.new.runs, a.new.fallbacks) == (25 + 2, 2)
    assert b.seconds < 300 and b.old.runs >= 4 * 25 and b.new.runs < 25
    assert c_native.seconds == 300 and c_native.new.fallbacks == 20 + 2
    assert c_bridge.seconds < 250 and c_bridge.old.implementations == ("phd", "runner-fallback")
    assert c_bridge.new.runs >= 25 and c_bridge.new.p50 is not None
    assert a_since.seconds == 10 and a_since.new.fallbacks == 1
    assert d == Window("D", PYTHON, 300, SideStats(), SideStats())
    assert read_windows(engine, [], 25) == []


def test_a_temporary_failure_counts_when_it_happens_not_when_archived(db):
    """The old side's retries wait (Phorge's 300 s): its failures count while they wait,
    as the new side's fallbacks do, so an outage both sides share weighs on both."""
    engine, _ = db
    archived(engine, owner("native"), count=20)
    archived(engine, owner("runner"), count=80)
    failed_rows(engine, owner("runner"), 6, failures=2)  # waiting for their third run
    failed_rows(engine, f"1:{int(time.time())}:web:1", 2)  # phd's, at the celery level
    fell_back_rows(engine, 5)
    w = read_window(engine, "C", PYTHON, 300, 500)
    assert (w.new.runs, w.new.fallbacks) == (25, 5)
    assert (w.old.runs, w.old.temporary_failures) == (80 + 12 + 2, 14)
    # The shared outage: 20% of either side fails.
    assert verdict(w, BOUNDS) is None


def test_a_fallback_the_old_side_failed_too_counts_on_both_sides_while_it_waits(db):
    """The new side failed it (a fallback), then the old side's run failed as well: the
    failed owner says ``runner-fallback``, one failure of each side."""
    engine, _ = db
    archived(engine, owner("native"), count=20)
    archived(engine, owner("runner"), count=80)
    failed_rows(engine, owner("runner-fallback"), 4)
    w = read_window(engine, "C", PYTHON, 300, 500)
    assert (w.new.runs, w.new.fallbacks, w.new.successes) == (24, 4, 20)
    assert (w.old.runs, w.old.temporary_failures) == (84, 4)


def test_an_old_side_with_few_runs_in_the_window_is_judged_by_its_history(db):
    engine, settings = db
    store = CanaryStore(engine, None)
    store.set_weights(WEIGHTS)
    archived(engine, owner("runner"), count=200, age=5000)  # an hour and more ago
    archived(engine, owner("native"), count=28)
    fell_back_rows(engine, 12)
    assert guard_once(store, engine, settings, Suspicions(1)) == ["rollback C (python)"]
    reason = store.read().state.of("C", PYTHON).reason or ""
    assert "old side 100.0 percent over 200 runs" in reason
    history = load_settings(
        {"BRIDGE_DATABASE_URL": str(engine.url), "BRIDGE_CANARY_HISTORY": "300"}
    )
    store.set_weights({"C": {"python": 20}})
    store.change_state(lambda s: s.with_promotion("C", PYTHON, int(time.time()) - 60, 20.0, "t"))
    assert guard_once(store, engine, history, Suspicions(1)) == [], "10 successes: no proof"


def minutes_total(engine: sa.Engine, ledger: Ledger, now: int) -> int:
    """The archive rows of class C the ledger holds at ``now``."""
    with engine.connect() as conn:
        minutes = ledger.minutes(conn, ["C"], now)["C"]
    summed = sum(rows for counts in minutes.by_minute.values() for rows, _ in counts.values())
    assert summed == sum(rows for rows, _ in minutes.total.values()), "the sum kept"
    return summed


def test_the_ledger_adds_each_row_once_and_forgets_what_left_its_span(db):
    engine, _ = db
    ledger, now = Ledger(span=3600), int(time.time())
    archived(engine, owner("native"), count=3, age=100)
    archived(engine, owner("native"), count=2, age=4000)  # before the span
    assert minutes_total(engine, ledger, now) == 3
    archived(engine, owner("native"), count=4, age=2)  # too young: its commit may trail
    assert minutes_total(engine, ledger, now) == 3
    assert minutes_total(engine, ledger, now + SETTLE) == 7
    assert minutes_total(engine, ledger, now + SETTLE) == 7, "each row once"
    assert minutes_total(engine, ledger, now + 3600 - 20) == 4, "the first 3 left the span"
    assert minutes_total(engine, ledger, now + 3 * 3600) == 0, "unseen for longer: afresh"


def test_the_ledger_brings_several_classes_up_to_date_at_once(db):
    """A class joins the guard later (summed afresh) while another is caught up: each
    row is summed once, to its class, and the kept sum is the minutes'."""
    engine, _ = db
    ledger, now = Ledger(span=3600), int(time.time())
    archived(engine, owner("native"), count=3, age=100)
    archived(engine, owner("native"), count=2, age=100, task_class="D")
    with engine.connect() as conn:
        assert ledger.minutes(conn, ["C"], now)["C"].total == {("native", 0): [3, 0]}
    archived(engine, owner("runner"), count=4, failures=1, age=2, task_class="D")
    archived(engine, owner("native"), count=1, age=2)
    with engine.connect() as conn:
        kept = ledger.minutes(conn, ["C", "D"], now + SETTLE)
    assert kept["C"].total == {("native", 0): [4, 0]}
    assert kept["D"].total == {("native", 0): [2, 0], ("runner", 0): [4, 4]}
    assert minutes_total(engine, ledger, now + SETTLE) == 4


@pytest.mark.parametrize("max_runs", [1, 9, 10, 19, 20, 10_000])
def test_several_long_windows_are_each_cut_on_their_own(db, max_runs):
    """``long_windows`` of several classes and starts at once: each as its own, cut at
    the whole minute where its new side has ``max_runs`` runs, else the sum of its span
    (the ledger's kept sum less the minutes before it), with its active rows."""
    engine, _ = db
    now = int(time.time())
    for minutes_ago in range(10):
        age = 60 * minutes_ago + 30
        archived(engine, owner("native"), count=2, age=age)
        archived(engine, owner("runner"), count=3, failures=1, age=age)
        archived(engine, owner("native"), result=1, age=age, task_class="D")
    fell_back_rows(engine, 2)
    failed_rows(engine, owner("runner"), 1, task_class="D", age=400)
    five = (now - 270) // 60 * 60  # the whole minutes of the last five batches
    asked = [("C", PYTHON, now - 3600), ("D", PYTHON, now - 3600), ("C", PYTHON, five)]
    ledger = Ledger(3600)
    together = long_windows(engine, ledger, asked, now + SETTLE, max_runs)
    assert together == [
        long_windows(engine, Ledger(3600), [one], now + SETTLE, max_runs)[0] for one in asked
    ]
    assert together == long_windows(engine, ledger, asked, now + SETTLE, max_runs), "kept"
    c, d, c_since = together
    archived_new = c.new.runs - c.new.fallbacks
    assert archived_new == (20 if max_runs > 20 else -(-max_runs // 2) * 2)
    assert (c.seconds < 3600) == (max_runs <= 20)
    assert c_since.new.runs - c_since.new.fallbacks == min(archived_new, 10)
    assert d.new.permanent_failures == min(10, max_runs)
    assert d.old.temporary_failures == (d.seconds >= 400), "its own active rows"


def spread(engine: sa.Engine, label: str, runs: int, failed: int, hours: int) -> None:
    """``runs`` archive rows run by ``label`` over the last ``hours``, ``failed`` of them
    failed for good, both spread evenly."""
    batches = 10 * hours
    for batch in range(batches):
        age = 10 + batch * 360
        archived(engine, owner(label), count=(runs - failed) // batches, age=age)
        archived(engine, owner(label), count=failed // batches, result=1, age=age)


def test_a_small_difference_at_low_traffic_is_caught_by_the_long_window(db):
    """3% failing against 1%, a class at 1 task/s with a 20% share over three hours:
    the short window's 60 new-side runs prove nothing, the history's 2,040 do."""
    engine, settings = db
    store = CanaryStore(engine, None)
    store.set_weights({"C": {"python": 20}})
    spread(engine, "native", 2040, 60, hours=3)
    spread(engine, "runner", 8040, 90, hours=3)
    short_only = load_settings(
        {"BRIDGE_DATABASE_URL": str(engine.url), "BRIDGE_CANARY_HISTORY": "300"}
    )
    assert guard_once(store, engine, short_only, Suspicions(1)) == []
    ledger = Ledger(settings.canary_history)
    assert guard_once(store, engine, settings, Suspicions(1), ledger) == ["rollback C (python)"]
    reason = store.read().state.of("C", PYTHON).reason or ""
    assert reason.startswith(
        "new side success 97.1 percent over 2040 runs, old side 98.9 percent over 8040 runs"
    ), reason


WEIGHTS = {"C": {"python": 20}, "Quiet": {"python": 20}}
ERROR = (
    "canary rollback: C (python): new side success 70.0% over 40 runs, "
    "old side 100.0% over 160 runs, window 300 s (p = 9.1e-10)"
)


def test_a_worse_new_side_is_rolled_back_with_one_error_line(db, caplog):
    engine, settings = db
    store = CanaryStore(engine, None)
    store.set_weights(WEIGHTS)
    archived(engine, owner("native"), count=28)
    archived(engine, owner("runner-fallback"), count=12)
    archived(engine, owner("runner"), count=148)
    archived(engine, owner("native"), count=20, task_class="Quiet")
    caplog.set_level(logging.INFO, logger="bridge.canary")
    assert guard_once(store, engine, settings, Suspicions(1)) == ["rollback C (python)"]
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in errors] == [ERROR]
    canary = store.read()
    state = canary.state.of("C", PYTHON)
    # Stored without "%", which `bin/config get` would take for a format directive.
    assert state.rolled_back and state.reason == stored(ERROR.split(": ", 2)[2])
    assert "%" not in state.reason
    assert canary.weight("C", PYTHON) == 0 and canary.weight("Quiet", PYTHON) == 2000
    (event,) = canary.state.history
    assert (event.task_class, event.level, event.event, event.weight) == (
        "C",
        PYTHON,
        "rollback",
        0,
    )
    # Rolled back, the class is no longer shared: the next guard leaves it alone.
    caplog.clear()
    assert guard_once(store, engine, settings, Suspicions(1)) == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_no_shared_class_is_one_read(db, monkeypatch):
    engine, settings = db
    store = CanaryStore(engine, None)
    store.set_weights({"C": {"python": 100}, "*": {"celery": 0}})
    monkeypatch.setattr(guard, "short_windows", lambda *a: pytest.fail("read the archive"))
    monkeypatch.setattr(guard, "guard_lock", lambda *a: pytest.fail("took the lock"))
    assert guard_once(store, engine, settings, Suspicions(1)) == []
    assert guard_once(CanaryStore(engine, None), engine, settings, Suspicions(1)) == []


RAMP = {"C": {"ramp": {"level": "python", "steps": [1, 5, 100], "dwell": 60}}}


def backdate(store: CanaryStore, seconds: int) -> None:
    """Make the current ramp step ``seconds`` older."""

    def change(state: CanaryState) -> CanaryState:
        level = state.of("C", PYTHON)
        assert level.step_since is not None
        moved = replace(level, step_since=level.step_since - seconds)
        return replace(state, levels={**state.levels, ("C", PYTHON): moved})

    store.change_state(change)


def test_a_quiet_ramp_steps_after_each_dwell(db):
    engine, settings = db
    store = CanaryStore(engine, None)
    store.set_weights(RAMP)
    assert store.read().weight("C", PYTHON) == 100
    # First sight: the step's dwell starts now; nothing moves.
    assert guard_once(store, engine, settings, Suspicions(1)) == []
    first = store.read().state.of("C", PYTHON)
    assert first.step == 0 and first.step_since is not None
    assert store.read().state.history == ()
    assert guard_once(store, engine, settings, Suspicions(1)) == []  # held 0 s of 60
    backdate(store, 50)  # 50 s and the test's own seconds (a busy machine's few)
    assert guard_once(store, engine, settings, Suspicions(1)) == []
    backdate(store, 10)
    assert guard_once(store, engine, settings, Suspicions(1)) == ["step C (python) 5%"]
    canary = store.read()
    assert canary.weight("C", PYTHON) == 500
    stepped = canary.state.of("C", PYTHON)
    assert stepped.step == 1 and stepped.step_since is not None
    assert stepped.step_since >= first.step_since  # the new step's dwell starts now
    assert [(e.event, e.weight) for e in canary.state.history] == [("step", 5.0)]
    backdate(store, 60)
    assert guard_once(store, engine, settings, Suspicions(1)) == ["step C (python) 100%"]
    assert store.read().weight("C", PYTHON) == 10_000
    # At 100% the class is no longer shared: the ramp is done.
    backdate(store, 600)
    assert guard_once(store, engine, settings, Suspicions(1)) == []


def test_a_paused_ramp_holds_its_step_until_resumed_and_a_whole_dwell(db):
    engine, settings = db
    store = CanaryStore(engine, None)
    store.set_weights(RAMP)
    assert guard_once(store, engine, settings, Suspicions(1)) == []  # its dwell starts
    store.change_state(lambda state: state.with_pause("C", PYTHON, 1, True, 1.0))
    backdate(store, 600)
    assert guard_once(store, engine, settings, Suspicions(1)) == []
    assert store.read().weight("C", PYTHON) == 100
    with engine.connect() as conn:
        now = int(conn.execute(canary_sql.server_time()).scalar_one())
    store.change_state(lambda state: state.with_pause("C", PYTHON, now, False, 1.0))
    assert guard_once(store, engine, settings, Suspicions(1)) == []  # resumed: 0 s of 60
    backdate(store, 60)
    assert guard_once(store, engine, settings, Suspicions(1)) == ["step C (python) 5%"]
    assert [e.event for e in store.read().state.history] == ["pause", "resume", "step"]


def test_a_class_sets_its_own_bounds(db):
    """Two classes, each with 10 fallbacks in 30 new-side runs beside a clean old side:
    one trips on the settings' bounds, the other allows a drop of 50 points, and a
    third needs two bad evaluations in a row where the settings say one."""
    engine, settings = db
    store = CanaryStore(engine, None)
    store.set_weights(
        {
            "Strict": {"python": 20},
            "Lax": {"python": 20, "guard": {"max_drop": 0.5}},
            "Patient": {"python": 20, "guard": {"failure_limit": 2}},
        }
    )
    for task_class in ("Strict", "Lax", "Patient"):
        archived(engine, owner("native"), count=20, task_class=task_class)
        archived(engine, owner("runner-fallback"), count=10, task_class=task_class)
        archived(engine, owner("runner"), count=90, task_class=task_class)
    suspicions = Suspicions(1)
    assert guard_once(store, engine, settings, suspicions) == ["rollback Strict (python)"]
    assert guard_once(store, engine, settings, suspicions) == ["rollback Patient (python)"]
    assert guard_once(store, engine, settings, suspicions) == []
    assert store.read().weight("Lax", PYTHON) == 2000


def test_a_ramp_with_a_bad_new_side_is_rolled_back_not_stepped(db):
    engine, settings = db
    store = CanaryStore(engine, None)
    store.set_weights(RAMP)
    assert guard_once(store, engine, settings, Suspicions(1)) == []
    backdate(store, 600)
    archived(engine, owner("native"), count=20)
    archived(engine, owner("runner-fallback"), count=10)
    archived(engine, owner("runner"), count=90)
    assert guard_once(store, engine, settings, Suspicions(1)) == ["rollback C (python)"]
    canary = store.read()
    assert canary.weight("C", PYTHON) == 0
    assert [e.event for e in canary.state.history] == ["rollback"]


def failed_rows(
    engine: sa.Engine,
    owner: str | None,
    count: int,
    failures: int = 1,
    task_class: str = "C",
    age: int = 0,
) -> None:
    """``count`` active rows of ``task_class`` that failed ``failures`` times, the last
    ``age`` s ago (0: a new side gave them back, which leaves a failure time and no count)."""
    now = int(time.time())
    rows = [
        {
            "id": next(TASK_IDS),
            "taskClass": task_class,
            "leaseOwner": owner,
            "leaseExpires": now + 300 if owner else None,
            "failureCount": failures,
            "dataID": 1,
            "failureTime": now - age,
            "priority": 3000,
            "dateCreated": now,
            "dateModified": now,
        }
        for _ in range(count)
    ]
    with engine.begin() as conn:
        conn.execute(sa.insert(active), rows)


def fell_back_rows(engine: sa.Engine, count: int, task_class: str = "C") -> None:
    failed_rows(engine, None, count, failures=0, task_class=task_class)


def test_fallbacks_waiting_for_the_old_side_count_as_new_side_failures(db):
    engine, _settings = db
    archived(engine, owner("native"), count=20)
    archived(engine, owner("runner"), count=100)
    fell_back_rows(engine, 10)  # phd has a backlog: not archived yet
    fell_back_rows(engine, 5, task_class="Other")
    w = read_window(engine, "C", PYTHON, 300, 100)
    assert (w.new.runs, w.new.successes, w.new.fallbacks) == (30, 20, 10)
    assert w.old.runs == 100  # the old side has not run them yet
    assert verdict(w, BOUNDS) is not None


def test_after_a_promotion_only_newer_runs_are_judged(db):
    engine, settings = db
    store = CanaryStore(engine, None)
    store.set_weights(WEIGHTS)
    archived(engine, owner("native"), count=28, age=30)
    archived(engine, owner("runner-fallback"), count=12, age=30)
    archived(engine, owner("runner"), count=148, age=30)
    assert guard_once(store, engine, settings, Suspicions(1)) == ["rollback C (python)"]
    now = int(time.time())
    store.change_state(lambda s: s.with_promotion("C", PYTHON, now, 20.0, "fixed"))
    # The failures that made the rollback are older than the promotion: no new trip.
    assert guard_once(store, engine, settings, Suspicions(1)) == []
    assert store.read().weight("C", PYTHON) == 2000
    archived(engine, owner("native"), count=28)
    archived(engine, owner("runner-fallback"), count=12)
    archived(engine, owner("runner"), count=148)
    assert guard_once(store, engine, settings, Suspicions(1)) == ["rollback C (python)"]


def yielding_rows(engine: sa.Engine, new: int, old: int, age: int) -> None:
    """``new`` and ``old`` rows of C yielded by each side of C's 50% native share,
    created ``age`` s ago."""
    now, rows = int(time.time()), []
    wanted = {True: new, False: old}
    while any(wanted.values()):
        task_id = next(TASK_IDS)
        ours = bucket(PYTHON, task_id) < 5000
        if wanted[ours]:
            wanted[ours] -= 1
            rows.append(
                {
                    "id": task_id,
                    "taskClass": "C",
                    "leaseOwner": "(yield)",
                    "leaseExpires": now + 30,
                    "failureCount": 0,
                    "dataID": 1,
                    "failureTime": None,
                    "priority": 3000,
                    "dateCreated": now - age,
                    "dateModified": now,
                }
            )
    with engine.begin() as conn:
        conn.execute(sa.insert(active), rows)


@pytest.mark.parametrize(
    ("new", "old", "rolled_back"),
    [(12, 0, True), (2, 8, False)],
    ids=["the new side loops", "both sides loop alike"],
)
def test_rows_yielding_past_max_yielding_are_their_sides_failures(db, new, old, rolled_back):
    """A new side that yields forever leaves no archive row: its rows still yielding an
    hour after their creation are its failures, and the old side's are the old side's,
    so a loop both sides share (a dependency down) rolls nothing back."""
    engine, settings = db
    store = CanaryStore(engine, None)
    store.set_weights({"C": {"python": 50, "guard": {"max_yielding": 3600}}})
    archived(engine, owner("native"), count=20)
    archived(engine, owner("runner"), count=80)
    yielding_rows(engine, new, old, age=3700)
    yielding_rows(engine, 20, 20, age=3500)  # young enough: Phorge's "not yet"
    made = guard_once(store, engine, settings, Suspicions(1))
    assert made == (["rollback C (python)"] if rolled_back else [])
    if rolled_back:
        reason = store.read().state.of("C", PYTHON).reason
        assert "rows in a yield loop 12 on the new side and 0 on the old" in reason
