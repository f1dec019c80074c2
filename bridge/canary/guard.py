"""The canary guard: the new side's runs against the old side's, from Phorge's tables,
and the rollback (or the next ramp step) that follows.

Both sides archive their runs in ``worker_archivetask``, and each row's lease owner
names who ran it (``model.label_of``). Over the window (the last ``seconds``, cut
short for both sides at once when the new side has ``max_runs`` runs or the old side
four times that), an archived row counts ``1 + failureCount`` runs: its earlier,
temporary failures and its last run (a success, or a permanent failure; a cancelled
row's last run never ran). A row that fell back (``*-fallback``) is one new-side failure
and the old side's run after it. Rows still active count too, when their failure
happened in the window: a fallback waiting for the old side is a new-side failure, and
a temporary failure waiting for its retry is one of its side's, so a failure counts when
it happens on either side, not only once its row is archived after the retry wait (an
outage both sides share then weighs on both alike).

The verdict is a test, not a point difference: Fisher's exact test must find the new
side's excess of failures significant (``significance``), the excess must be larger
than a practical bound (``max_drop``), and both must hold on ``failure_limit``
consecutive evaluations (:class:`Suspicions`, as Argo Rollouts' ``failureLimit``).

:func:`guard_once` runs under a named database lock, so one guard judges at a time
however many beats and workers send it; beat sends it every
``BRIDGE_CANARY_GUARD_INTERVAL`` s (``bridge.runtime.canary_guard``).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine

from bridge.canary import decisions, sql
from bridge.canary.ledger import Counts, Ledger, Minutes, add_counts
from bridge.canary.short_window import MICROSECONDS, newest_first
from bridge.canary.significance import excess_failures_p, rate_change_p
from bridge.canary.sql import MINUTE
from bridge.canary.store import CanaryStore
from bridge.canary.weights import FELL_BACK, NEW, Canary, label_parts, side_of
from bridge.queue.implementations import PHD
from bridge.queue.model import RESULT_FAILURE, RESULT_SUCCESS, label_of
from bridge.queue.phorge_queue import named_lock

if TYPE_CHECKING:
    from bridge.config import Settings

log = logging.getLogger(__name__)

OLD_RUNS_PER_NEW = 4  # the old side's runs, per new-side run of max_runs, that cut it
# The long window is cut where the new side has this many times the short window's
# runs: 3% failing against 1% can take more than 2,000 new-side runs to prove (2,374 on
# one of 60 simulated days, tests/helpers/guard_days.py), and a cut keeps a new fault
# from being diluted by a day of good runs.
LONG_RUNS_PER_SHORT = 5


@dataclass(frozen=True)
class SideStats:
    """One side's runs over a window; durations (seconds) are successful runs'."""

    runs: int = 0
    successes: int = 0
    temporary_failures: int = 0
    permanent_failures: int = 0
    fallbacks: int = 0
    p50: float | None = None
    p99: float | None = None
    implementations: tuple[str, ...] = ()
    # The follow-ups its successful runs queued, as the bridge's labels say, and those
    # runs (phd's owners carry no count: its successes are not among them).
    followups: int = 0
    labelled_successes: int = 0
    # Its rows still yielding past the class's ``max_yielding``: a failed run each.
    yield_loops: int = 0

    @property
    def failures(self) -> int:
        return self.runs - self.successes

    @property
    def followups_per_success(self) -> float | None:
        return self.followups / self.labelled_successes if self.labelled_successes else None

    @property
    def ratio(self) -> float | None:
        """Successes per run; None without a run."""
        return self.successes / self.runs if self.runs else None


@dataclass(frozen=True)
class Window:
    task_class: str
    level: str
    seconds: int
    new: SideStats
    old: SideStats


def quantile(ordered: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile of ``ordered`` (ascending)."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class _Tally:
    """A side's counts as rows are read, newest first."""

    full_at: int
    runs: int = 0
    successes: int = 0
    temporary: int = 0
    permanent: int = 0
    fallbacks: int = 0
    followups: int = 0
    labelled: int = 0
    durations: list[float] = field(default_factory=list)
    implementations: set[str] = field(default_factory=set)

    @property
    def full(self) -> bool:
        return self.runs >= self.full_at

    def archived(
        self, failure_count: int, result: int, duration: int, label: str, followups: int
    ) -> None:
        self.archived_rows(1, failure_count, result, label, followups)
        if result == RESULT_SUCCESS:
            self.durations.append(duration / MICROSECONDS)

    def archived_rows(
        self, rows: int, failures: int, result: int, label: str, followups: int = 0
    ) -> None:
        """``rows`` archive rows of one result, with ``failures`` earlier failures and,
        each, ``followups`` follow-ups queued (a success's)."""
        self.implementations.add(label)
        self.runs += failures
        self.temporary += failures
        if result == RESULT_SUCCESS:
            self.runs += rows
            self.successes += rows
            if label != PHD:
                self.labelled += rows
                self.followups += rows * followups
        elif result == RESULT_FAILURE:
            self.runs += rows
            self.permanent += rows

    def fell_back(self, rows: int = 1) -> None:
        self.runs += rows
        self.fallbacks += rows

    def failed_for_now(self, failure_count: int, label: str) -> None:
        """An active row's temporary failures, its retry still to come."""
        self.implementations.add(label)
        self.runs += failure_count
        self.temporary += failure_count

    def stats(self) -> SideStats:
        ordered = sorted(self.durations)
        return SideStats(
            runs=self.runs,
            successes=self.successes,
            temporary_failures=self.temporary,
            permanent_failures=self.permanent,
            fallbacks=self.fallbacks,
            p50=quantile(ordered, 0.50),
            p99=quantile(ordered, 0.99),
            implementations=tuple(sorted(self.implementations)),
            followups=self.followups,
            labelled_successes=self.labelled,
        )


@dataclass
class _Reading:
    """A window as it is read: whose, from which second on, both sides' tallies, and
    whether its archive rows are all counted (its span read, or cut)."""

    task_class: str
    level: str
    start: int
    new: _Tally
    old: _Tally
    complete: bool = False

    def window(self, now: int) -> Window:
        return Window(
            self.task_class, self.level, now - self.start, self.new.stats(), self.old.stats()
        )


def read_windows(
    engine: Engine, asked: Sequence[tuple[str, str, int]], max_runs: int
) -> list[Window]:
    """For each ``(task_class, level, seconds)`` of ``asked``, the class's runs of the
    last ``seconds``, split into the two sides of ``level`` by their lease owners'
    labels: archived rows newest first, until the new side has ``max_runs`` runs or the
    old side ``OLD_RUNS_PER_NEW`` times that (both sides then cover the same, shorter
    span); then the active rows that failed in that span, read after the archive so
    that a row archived meanwhile is missed rather than counted twice. One pass over the
    archive serves them all (:func:`sql.archived_runs`), each window cut on its own."""
    if not asked:
        return []
    with engine.connect() as conn:
        now = int(conn.execute(sql.server_time()).scalar_one())
        readings = [
            _Reading(
                task_class,
                level,
                now - seconds,
                _Tally(max_runs),
                _Tally(OLD_RUNS_PER_NEW * max_runs),
            )
            for task_class, level, seconds in asked
        ]
        _read_archive(conn, readings)
        _failing(conn, readings)
    return [reading.window(now) for reading in readings]


def read_window(engine: Engine, task_class: str, level: str, seconds: int, max_runs: int) -> Window:
    """:func:`read_windows` of one class."""
    return read_windows(engine, [(task_class, level, seconds)], max_runs)[0]


def _read_archive(conn: Connection, readings: list[_Reading]) -> None:
    """The archive rows of the readings' spans onto them, newest first, a page at a time
    of the classes still read, until each is complete."""
    by_class: dict[str, list[_Reading]] = {}
    for reading in readings:
        by_class.setdefault(reading.task_class, []).append(reading)

    def pending() -> list[tuple[str, int]]:
        return [(r.task_class, r.start) for r in readings if not r.complete]

    for row in newest_first(conn, pending):
        for reading in by_class[row.taskClass]:
            if reading.complete:
                continue
            if row.dateModified < reading.start:  # older than its span, as all after
                reading.complete = True
                continue
            _count(reading.new, reading.old, reading.level, row)
            if reading.new.full or reading.old.full:
                reading.start, reading.complete = row.dateModified, True


def short_windows(
    engine: Engine, ledger: Ledger, asked: Sequence[tuple[str, str, int]], max_runs: int
) -> list[Window]:
    """:func:`read_windows`' windows, from the rows ``ledger`` keeps of them (each
    ``(task_class, level)`` once): the guard's, which each second reads only the rows
    archived after its last mark, a few seconds behind its clock (``short_window``)."""
    if not asked:
        return []
    with engine.connect() as conn:
        now = int(conn.execute(sql.server_time()).scalar_one())
        caps = (max_runs, OLD_RUNS_PER_NEW * max_runs)
        readings = []
        for (task_class, level, _), found in zip(
            asked, ledger.short_windows(conn, asked, now, caps, _row_runs), strict=True
        ):
            reading = _Reading(task_class, level, found.start, _Tally(caps[0]), _Tally(caps[1]))
            for (label, result), (rows, failures) in found.counts.items():
                durations = found.durations.get((label, result), ())
                _count_summed(
                    reading.new, reading.old, level, label, result, rows, failures, durations
                )
            readings.append(reading)
        _failing(conn, readings)
    return [reading.window(now) for reading in readings]


def summed_window(engine: Engine, task_class: str, level: str, seconds: int) -> Window:
    """The runs of :func:`read_window`, over the whole of the last ``seconds`` (no cut)
    and summed by the server (a day of runs is one grouped statement), without the
    durations, which only reading each row would give (``canary report --since``)."""
    with engine.connect() as conn:
        now = int(conn.execute(sql.server_time()).scalar_one())
        reading = _Reading(task_class, level, now - seconds, _Tally(0), _Tally(0))
        for row in conn.execute(sql.minute_runs([task_class], now - seconds - 1, now)).all():
            _count_summed(
                reading.new,
                reading.old,
                level,
                row.label,
                row.result,
                int(row.rows),
                int(row.failures),
            )
        _failing(conn, [reading])
    return reading.window(now)


def long_windows(
    engine: Engine,
    ledger: Ledger,
    asked: Sequence[tuple[str, str, int]],
    now: int,
    max_runs: int,
) -> list[Window]:
    """For each ``(task_class, level, since)`` of ``asked``, the class's runs from the
    ledger's minutes from ``since`` to ``now`` (the database's clock), newest first, cut
    for both sides at once at the first whole minute where the new side has ``max_runs``
    runs (the old side has no cap: its runs cost no read), and the active rows that
    failed since; without durations. The ledger is brought up to date, and the active
    rows read, once for them all."""
    if not asked:
        return []
    with engine.connect() as conn:
        kept = ledger.minutes(conn, sorted({task_class for task_class, _, _ in asked}), now)
        readings = [
            _from_minutes(kept[task_class], task_class, level, since, max_runs)
            for task_class, level, since in asked
        ]
        _failing(conn, readings)
    return [reading.window(now) for reading in readings]


def _from_minutes(
    minutes: Minutes, task_class: str, level: str, since: int, max_runs: int
) -> _Reading:
    """One long window's reading, before its active rows: the minutes' sum from
    ``since`` when the new side has fewer than ``max_runs`` runs in it, else the minutes
    newest first until it has."""
    summed = minutes.summed_from(-(-since // MINUTE))  # the first whole minute
    start = since
    if _new_side_runs(level, summed) >= max_runs:
        summed, runs = {}, 0
        for minute, counts in minutes.newest_first():
            if minute * MINUTE < since:
                break
            add_counts(summed, counts)
            runs += _new_side_runs(level, counts)
            if runs >= max_runs:
                start = minute * MINUTE
                break
    reading = _Reading(task_class, level, start, _Tally(max_runs), _Tally(0))
    for (label, result), (rows, failures) in summed.items():
        _count_summed(reading.new, reading.old, level, label, result, rows, failures)
    return reading


def _new_side_runs(level: str, counts: Counts) -> int:
    """The new side's runs in ``counts``."""
    runs = 0
    for (label, result), (rows, failures) in counts.items():
        (per_row, _), (per_failure, _) = _runs_per(level, label, result)
        runs += per_row * rows + per_failure * failures
    return runs


def _row_runs(level: str, label: str | None, result: int, failures: int) -> tuple[int, int]:
    """The runs one archive row with ``failures`` earlier failures counts on the new
    side and on the old side (the short window's cut, ``short_window.Weigh``)."""
    (new, old), (new_each, old_each) = _runs_per(level, label, result)
    return new + failures * new_each, old + failures * old_each


@functools.lru_cache(maxsize=1024)
def _runs_per(
    level: str, label: str | None, result: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """The new side's and the old side's runs that one archive row of ``label`` and
    ``result`` adds, and each of its earlier failures: the windows' cuts need only the
    sides' runs, and a window's rows repeat a few labels and results."""
    counted = []
    for rows, failures in ((1, 0), (0, 1)):
        new, old = _Tally(0), _Tally(0)
        _count_summed(new, old, level, label, result, rows, failures)
        counted.append((new.runs, old.runs))
    return counted[0], counted[1]


def _count_summed(
    new: _Tally,
    old: _Tally,
    level: str,
    label: str | None,
    result: int,
    rows: int,
    failures: int,
    durations: Sequence[float] = (),
) -> None:
    """Summed archive rows of one label and result onto their side (a fallback onto
    both), with their successes' ``durations`` (seconds) if known."""
    who, followups = label_parts(label)
    side, shown = side_of(level, who), who or PHD
    if side == FELL_BACK:
        new.fell_back(rows)
    tally = new if side == NEW else old
    tally.archived_rows(rows, failures, result, shown, followups)
    tally.durations.extend(durations)


def _failing(conn: Connection, readings: list[_Reading]) -> None:
    """The active rows that failed in each reading's span, onto its sides, in one
    statement: a fallback waiting for the old side, a temporary failure waiting for its
    retry (the old side's run of a fallback that failed too: both sides' failures)."""
    by_class: dict[str, list[_Reading]] = {}
    for reading in readings:
        by_class.setdefault(reading.task_class, []).append(reading)
    since = min(reading.start for reading in readings)
    for row in conn.execute(sql.failed_in_window(sorted(by_class), since)).all():
        for reading in by_class[row.taskClass]:
            if row.failureTime >= reading.start:
                _failed(reading.new, reading.old, reading.level, row)


def _failed(new: _Tally, old: _Tally, level: str, row: Any) -> None:
    """One active row's failures onto their sides."""
    label = label_of(row.leaseOwner)
    if row.failureCount == 0:  # only a fallback leaves a failure time and no count
        new.fell_back()
        return
    side = side_of(level, label)
    if side == FELL_BACK:  # the old side failed it too, after the new side had
        new.fell_back()
    tally = new if side == NEW else old
    tally.failed_for_now(row.failureCount, label or PHD)


def _count(new: _Tally, old: _Tally, level: str, row: Any) -> None:
    """One archive row onto its side (a fallback onto both)."""
    who, followups = label_parts(label_of(row.leaseOwner))
    side = side_of(level, who)
    shown = who or PHD  # Phorge's own taskmasters' owners carry no label
    tally = new if side == NEW else old
    if side == FELL_BACK:
        new.fell_back()
    tally.archived(row.failureCount, row.result, row.duration, shown, followups)


@dataclass(frozen=True)
class Bounds:
    """When the guard rolls a class back (``BRIDGE_CANARY_*``)."""

    min_runs: int = 10
    min_failures: int = 3
    max_drop: float = 0.01
    significance: float = 1e-6
    failure_limit: int = 3
    max_slowdown: float = 3.0
    slowdown_floor: float = 1.0  # a PHP runner's first, cold runs are 0.1-0.6 s slower
    max_followup_change: float = 0.5
    max_yielding: int = 3600

    @classmethod
    def from_settings(cls, settings: Settings) -> Bounds:
        return cls(
            min_runs=settings.canary_min_runs,
            min_failures=settings.canary_min_failures,
            max_drop=settings.canary_max_drop,
            significance=settings.canary_significance,
            failure_limit=settings.canary_failure_limit,
            max_slowdown=settings.canary_max_slowdown,
            slowdown_floor=settings.canary_slowdown_floor,
            max_followup_change=settings.canary_max_followup_change,
            max_yielding=settings.canary_max_yielding,
        )


def _percent(ratio: float) -> str:
    return f"{ratio * 100:.1f}%"


def verdict(window: Window, bounds: Bounds) -> str | None:
    """Why the new side must be rolled back on this evaluation, or None.

    Only with at least ``min_runs`` new-side runs, ``min_failures`` of them failed. It
    trips when the new side fails more often than the old side by more than
    ``max_drop`` and Fisher's one-sided test puts the chance of an excess this large,
    were both sides alike, below ``significance``; or when its median duration is more
    than ``max_slowdown`` times the old side's (with ``min_runs`` old runs) and at least
    ``slowdown_floor`` s slower. An old side with fewer than ``min_runs`` runs counts as
    ``min_runs`` successes (the guard reads its longer history first, ``guard_once``).
    """
    new, old = window.new, window.old
    if new.runs < bounds.min_runs:
        return None
    if old.runs < bounds.min_runs:
        old = replace(old, runs=bounds.min_runs, successes=bounds.min_runs)
    new_ratio, old_ratio = new.ratio or 0.0, old.ratio or 0.0
    reason = (
        f"new side success {_percent(new_ratio)} over {new.runs} runs, old side "
        f"{_percent(old_ratio)} over {old.runs} runs, window {window.seconds} s"
    )
    if new.yield_loops or old.yield_loops:
        reason += (
            f", rows in a yield loop {new.yield_loops} on the new side and "
            f"{old.yield_loops} on the old"
        )
    if new.failures >= bounds.min_failures and old_ratio - new_ratio > bounds.max_drop:
        p = excess_failures_p(new.failures, new.runs, old.failures, old.runs)
        if p < bounds.significance:
            return f"{reason} (p = {p:.1e})"
    effects = _effects(new, old, bounds)
    if effects is not None:
        return f"{reason}; {effects}"
    if (
        new.p50 is not None
        and old.p50 is not None
        and window.old.runs >= bounds.min_runs
        and new.p50 > bounds.max_slowdown * old.p50
        and new.p50 - old.p50 >= bounds.slowdown_floor
    ):
        return (
            f"{reason}; new side p50 {new.p50:.3f} s against the old side's {old.p50:.3f} s "
            f"(more than {bounds.max_slowdown:g} times, and {bounds.slowdown_floor:g} s slower)"
        )
    return None


def _effects(new: SideStats, old: SideStats, bounds: Bounds) -> str | None:
    """Why the new side's successful runs queue other follow-ups than the old side's,
    or None: per labelled success, more than ``max_followup_change`` of the old side's
    rate apart, significantly (two Poisson rates, ``rate_change_p``), with
    ``min_runs`` labelled successes on each side."""
    new_rate, old_rate = new.followups_per_success, old.followups_per_success
    if new_rate is None or old_rate is None:
        return None
    if min(new.labelled_successes, old.labelled_successes) < bounds.min_runs:
        return None
    if abs(new_rate - old_rate) <= bounds.max_followup_change * old_rate:
        return None
    p = rate_change_p(new.followups, new.labelled_successes, old.followups, old.labelled_successes)
    if p >= bounds.significance:
        return None
    return (
        f"new side queued {new_rate:.2f} follow-ups per success against the old side's "
        f"{old_rate:.2f} (p = {p:.1e})"
    )


@dataclass
class Suspicions:
    """How many consecutive evaluations each (class, level) was found worse in: one bad
    evaluation is not a rollback (flapping protection, Argo Rollouts' ``failureLimit``).
    Kept by the process that runs the guard: a guard in another process starts its own
    count, which delays a rollback by at most ``failure_limit`` of its evaluations."""

    limit: int
    _seen: dict[tuple[str, str], int] = field(default_factory=dict)

    def confirmed(
        self, task_class: str, level: str, reason: str | None, limit: int | None = None
    ) -> bool:
        """Note this evaluation's verdict; True once ``limit`` (the class's own, else
        :attr:`limit`) in a row found it worse."""
        key = (task_class, level)
        if reason is None:
            self._seen.pop(key, None)
            return False
        self._seen[key] = self._seen.get(key, 0) + 1
        return self._seen[key] >= (self.limit if limit is None else limit)

    def forget(self, task_class: str, level: str) -> None:
        """Evaluations before a fresh judgement do not count towards a rollback."""
        self._seen.pop((task_class, level), None)


def note_versions(
    store: CanaryStore,
    canary: Canary,
    versions: Mapping[tuple[str, str], str],
    now: int,
    suspicions: Suspicions,
) -> Canary:
    """Record the new side's version of each shared class and level
    (:func:`decisions.record_versions`): a change starts a fresh judgement (its runs
    from now, its suspicions forgotten), as Flagger analyses a new revision afresh.
    Returns the canary as it now stands."""
    changed = decisions.record_versions(store, canary, versions, now)
    for (task_class, level), (was, version) in changed.items():
        if was is not None:
            suspicions.forget(task_class, level)
            log.warning(
                "canary: %s (%s) runs %s on its new side (was %s): judged afresh from now",
                task_class,
                level,
                version,
                was,
            )
    return store.read() if changed else canary


def guard_lock_name(owner_prefix: str) -> str:
    return f"{owner_prefix}:canary-guard"


def guard_lock(engine: Engine, owner_prefix: str) -> AbstractContextManager[int | None]:
    """Hold the guard's named lock for the block; yields the database time, or None when
    another guard holds it."""
    return named_lock(engine, guard_lock_name(owner_prefix))


def _trip(store: CanaryStore, task_class: str, level: str, now: int, reason: str) -> bool:
    """Roll ``task_class`` back at ``level``; False when it already was (a CLI meanwhile)."""
    tripped = decisions.roll_back(store, task_class, level, now, reason).done
    if tripped:
        log.error("canary rollback: %s (%s): %s", task_class, level, reason)
    return tripped


def _ramp(store: CanaryStore, canary: Canary, task_class: str, level: str, now: int) -> str | None:
    """The ramp's next step when the current one was held its dwell; None otherwise."""
    weight = decisions.step_ramp(store, canary, task_class, level, now)
    if weight is None:
        return None
    seen = canary.state.of(task_class, level)
    ramp = canary.configured(task_class).ramp
    assert ramp is not None and seen.step_since is not None  # as step_ramp found them
    log.info(
        "canary ramp: %s (%s) steps to %g%% (step %d of %d) after %d s without a rollback",
        task_class,
        level,
        weight,
        seen.step + 2,
        len(ramp.steps),
        now - seen.step_since,
    )
    return f"step {task_class} ({level}) {weight:g}%"


def judged_windows(
    engine: Engine,
    ledger: Ledger,
    judged: Sequence[tuple[str, str, int | None, int]],
    now: int,
    settings: Settings,
) -> list[tuple[Window, Window]]:
    """The two windows the guard judges for each ``(task_class, level, since,
    min_runs)`` of ``judged``, both from ``since`` if the class is judged afresh from a
    promotion or a new version (``CanaryState.judged_since``): the short one
    (``BRIDGE_CANARY_WINDOW``, counted row by row, with durations, kept in the ledger),
    quick to show a large difference, and the long one (``BRIDGE_CANARY_HISTORY``, from
    the ledger), which a small one at low traffic needs. The short window's old side is
    the history's when it holds fewer than ``min_runs`` runs (the old side's history is
    evidence whatever the new side's promotion or version)."""
    seconds, history = settings.canary_window, now - settings.canary_history
    short_asked, long_asked = [], []
    for task_class, level, since, _ in judged:
        span = seconds if since is None else max(0, min(seconds, now - since))
        short_asked.append((task_class, level, span))
        long_asked.append((task_class, level, history if since is None else max(history, since)))
    runs = LONG_RUNS_PER_SHORT * settings.canary_window_runs
    shorts = short_windows(engine, ledger, short_asked, settings.canary_window_runs)
    longs = long_windows(engine, ledger, long_asked, now, runs)
    windows = []
    for (task_class, level, since, min_runs), short, long in zip(
        judged, shorts, longs, strict=True
    ):
        if short.old.runs < min_runs:
            old = long.old
            if since is not None and since > history:  # the old side's whole history
                old = long_windows(engine, ledger, [(task_class, level, history)], now, runs)[0].old
            short = replace(short, old=old)
        windows.append((short, long))
    return windows


def yield_loops(
    engine: Engine, canary: Canary, judged: Sequence[tuple[str, str, int]], now: int
) -> dict[tuple[str, str], tuple[int, int]]:
    """For each ``(task_class, level, max_yielding)`` of ``judged``, its rows yielding
    still ``max_yielding`` s after their creation (``now``: the database's clock), on
    the new side and on the old (``Canary.takes``: a row that fell back is the old
    side's). Each is a failure of its side while it yields: the new side's loop leaves
    no other evidence until its next run falls back, and a loop both sides share (a
    dependency down) weighs on both alike."""
    if not judged:
        return {}
    looping = {(task_class, level): [0, 0] for task_class, level, _ in judged}
    by_class: dict[str, list[tuple[str, int]]] = {}
    for task_class, level, bound in judged:
        by_class.setdefault(task_class, []).append((level, now - bound))
    oldest = max(created_before for both in by_class.values() for _, created_before in both)
    with engine.connect() as conn:
        rows = conn.execute(sql.yielding(sorted(by_class), oldest)).all()
    for row in rows:
        for level, created_before in by_class[row.taskClass]:
            if row.dateCreated < created_before:
                new = canary.takes(level, row.taskClass, row.id, row.failureTime)
                looping[row.taskClass, level][0 if new else 1] += 1
    return {key: (new, old) for key, (new, old) in looping.items()}


def with_yield_loops(window: Window, new: int, old: int) -> Window:
    """``window`` with ``new`` and ``old`` rows in a yield loop as failed runs."""
    return replace(
        window,
        new=replace(window.new, runs=window.new.runs + new, yield_loops=new),
        old=replace(window.old, runs=window.old.runs + old, yield_loops=old),
    )


def guard_once(
    store: CanaryStore,
    engine: Engine,
    settings: Settings,
    suspicions: Suspicions,
    ledger: Ledger | None = None,
    versions: Callable[[Canary], Mapping[tuple[str, str], str]] | None = None,
) -> list[str]:
    """Judge every shared class once: roll back those the new side was found worse for
    on ``failure_limit`` evaluations in a row, and move a quiet ramp to its next step.
    ``versions``: the new side's version of each shared (class, level) of a canary, as
    the live workers announce it; a new one starts a fresh judgement
    (:func:`note_versions`). Returns what
    it did (``rollback C (level)``, ``step C (level) 5%``); nothing but one read of the
    options when no class is shared, or when another guard holds the lock."""
    if not store.read().partial():
        return []
    bounds = Bounds.from_settings(settings)
    ledger = ledger or Ledger(settings.canary_history)
    made: list[str] = []
    with guard_lock(engine, settings.owner_prefix) as now:
        if now is None:
            return []
        canary = store.read()  # under the lock: as the last guard left it
        if versions is not None:
            canary = note_versions(store, canary, versions(canary), now, suspicions)
        shared = []
        for task_class, level, _weight in canary.partial():
            # Since a promotion (the runs that made the rollback are judged already) or a
            # new version of the new side (the old one's runs judge another code).
            since = canary.state.judged_since(task_class, level)
            # The class's own bounds over the settings' (``"guard"`` in its weights).
            own: dict[str, Any] = dict(canary.configured(task_class).guard)
            mine = replace(bounds, **own)
            shared.append((task_class, level, since, mine, own.get("failure_limit")))
        judged = [
            (task_class, level, since, mine.min_runs)
            for task_class, level, since, mine, _ in shared
        ]
        windows = judged_windows(engine, ledger, judged, now, settings)
        bounds_of = [
            (task_class, level, mine.max_yielding) for task_class, level, _, mine, _ in shared
        ]
        loops = yield_loops(engine, canary, bounds_of, now)
        for (task_class, level, _, mine, limit), windows_of in zip(shared, windows, strict=True):
            looping = loops[task_class, level]
            short, long = (with_yield_loops(window, *looping) for window in windows_of)
            reason = verdict(short, mine) or verdict(long, mine)
            if suspicions.confirmed(task_class, level, reason, limit):
                if _trip(store, task_class, level, now, str(reason)):
                    made.append(f"rollback {task_class} ({level})")
                continue
            if reason is not None:
                continue  # suspected: no ramp step meanwhile
            stepped = _ramp(store, canary, task_class, level, now)
            if stepped is not None:
                made.append(stepped)
    return made
