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

import logging
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine

from bridge.canary import sql
from bridge.canary.ledger import Counts, Ledger
from bridge.canary.significance import excess_failures_p, rate_change_p
from bridge.canary.sql import MINUTE
from bridge.canary.store import CanaryStore
from bridge.canary.weights import (
    FELL_BACK,
    NEW,
    PHD,
    Canary,
    CanaryState,
    label_parts,
    percent,
    side_of,
)
from bridge.queue.model import RESULT_FAILURE, RESULT_SUCCESS, label_of
from bridge.queue.phorge_queue import named_lock

if TYPE_CHECKING:
    from bridge.config import Settings

log = logging.getLogger(__name__)

MICROSECONDS = 1_000_000  # the archive's ``duration`` unit
PAGE_ROWS = 1000  # archive rows read at a time, newest first, until the window is cut
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


def read_window(engine: Engine, task_class: str, level: str, seconds: int, max_runs: int) -> Window:
    """``task_class``'s runs of the last ``seconds``, split into the two sides of
    ``level`` by their lease owners' labels: archived rows newest first, until the new
    side has ``max_runs`` runs or the old side ``OLD_RUNS_PER_NEW`` times that (both
    sides then cover the same, shorter span); then the active rows that failed in that
    span, read after the archive so that a row archived meanwhile is missed rather than
    counted twice."""
    new, old = _Tally(max_runs), _Tally(OLD_RUNS_PER_NEW * max_runs)
    since: int | None = None  # where the window was cut, when it was
    before: tuple[int, int] | None = None
    with engine.connect() as conn:
        now = int(conn.execute(sql.server_time()).scalar_one())
        while since is None:
            rows = conn.execute(sql.archived_runs(task_class, seconds, PAGE_ROWS, before)).all()
            for row in rows:
                _count(new, old, level, row)
                if new.full or old.full:
                    since = row.dateModified
                    break
            if len(rows) < PAGE_ROWS:
                break
            before = (rows[-1].dateModified, rows[-1].id)
        start = now - seconds if since is None else since
        _failing(conn, new, old, task_class, level, start)
    return Window(task_class, level, now - start, new.stats(), old.stats())


def summed_window(engine: Engine, task_class: str, level: str, seconds: int) -> Window:
    """The runs of :func:`read_window`, over the whole of the last ``seconds`` (no cut)
    and summed by the server (a day of runs is one grouped statement), without the
    durations, which only reading each row would give (``canary report --since``)."""
    new, old = _Tally(0), _Tally(0)
    with engine.connect() as conn:
        now = int(conn.execute(sql.server_time()).scalar_one())
        for row in conn.execute(sql.minute_runs(task_class, now - seconds - 1, now)).all():
            _count_summed(new, old, level, row.label, row.result, int(row.rows), int(row.failures))
        _failing(conn, new, old, task_class, level, now - seconds)
    return Window(task_class, level, seconds, new.stats(), old.stats())


def long_window(
    engine: Engine,
    ledger: Ledger,
    task_class: str,
    level: str,
    span: tuple[int, int],
    max_runs: int,
) -> Window:
    """``task_class``'s runs from the ledger's minutes of ``span`` (its first and last
    second, the database's clock), newest first, cut for both sides at once at the
    first whole minute where the new side has ``max_runs`` runs (the old side has no
    cap: its runs cost no read), and the active rows that failed since; without
    durations."""
    since, now = span
    summed: Counts = {}
    new_runs: dict[tuple[str | None, int], tuple[int, int]] = {}
    runs, start = 0, since
    with engine.connect() as conn:
        for minute, counts in ledger.minutes(conn, task_class, now):
            if minute * MINUTE < since:
                break
            for key, (rows, failures) in counts.items():
                total = summed.setdefault(key, [0, 0])
                total[0] += rows
                total[1] += failures
                if key not in new_runs:
                    new_runs[key] = _new_side_runs(level, *key)
                per_row, per_failure = new_runs[key]
                runs += per_row * rows + per_failure * failures
            if runs >= max_runs:
                start = minute * MINUTE
                break
        new, old = _Tally(max_runs), _Tally(0)
        for (label, result), (rows, failures) in summed.items():
            _count_summed(new, old, level, label, result, rows, failures)
        _failing(conn, new, old, task_class, level, start)
    return Window(task_class, level, now - start, new.stats(), old.stats())


def _new_side_runs(level: str, label: str | None, result: int) -> tuple[int, int]:
    """The new side's runs that one archive row of ``label`` and ``result`` adds, and
    each of its earlier failures: a day of minutes is summed per label and result
    once, and the cut needs only the new side's runs as it goes."""
    counted = []
    for rows, failures in ((1, 0), (0, 1)):
        new = _Tally(0)
        _count_summed(new, _Tally(0), level, label, result, rows, failures)
        counted.append(new.runs)
    return counted[0], counted[1]


def _count_summed(
    new: _Tally, old: _Tally, level: str, label: str | None, result: int, rows: int, failures: int
) -> None:
    """Summed archive rows of one label and result onto their side (a fallback onto
    both)."""
    who, followups = label_parts(label)
    side, shown = side_of(level, who), who or PHD
    if side == FELL_BACK:
        new.fell_back(rows)
    tally = new if side == NEW else old
    tally.archived_rows(rows, failures, result, shown, followups)


def _failing(
    conn: Connection, new: _Tally, old: _Tally, task_class: str, level: str, start: int
) -> None:
    """The active rows that failed since ``start``, onto their sides: a fallback waiting
    for the old side, a temporary failure waiting for its retry (the old side's run of a
    fallback that failed too: both sides' failures)."""
    for row in conn.execute(sql.failed_in_window(task_class, start)).all():
        label = label_of(row.leaseOwner)
        if row.failureCount == 0:  # only a fallback leaves a failure time and no count
            new.fell_back()
            continue
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


def guard_lock_name(owner_prefix: str) -> str:
    return f"{owner_prefix}:canary-guard"


def guard_lock(engine: Engine, owner_prefix: str) -> AbstractContextManager[int | None]:
    """Hold the guard's named lock for the block; yields the database time, or None when
    another guard holds it."""
    return named_lock(engine, guard_lock_name(owner_prefix))


def _trip(store: CanaryStore, task_class: str, level: str, now: int, reason: str) -> bool:
    """Roll ``task_class`` back at ``level``; False when it already was (a CLI meanwhile)."""
    tripped = False

    def change(state: CanaryState) -> CanaryState:
        nonlocal tripped
        tripped = not state.of(task_class, level).rolled_back
        return state.with_rollback(task_class, level, now, reason) if tripped else state

    store.change_state(change)
    if tripped:
        log.error("canary rollback: %s (%s): %s", task_class, level, reason)
    return tripped


def _ramp(store: CanaryStore, canary: Canary, task_class: str, level: str, now: int) -> str | None:
    """The ramp's next step when the current one was held its dwell; None otherwise."""
    ramp = canary.configured(task_class).ramp
    seen = canary.state.of(task_class, level)
    if ramp is None or ramp.level != level or seen.rolled_back or seen.paused:
        return None
    if seen.step_since is None:  # first sight of this step: its dwell starts now

        def start(state: CanaryState) -> CanaryState:
            current = state.of(task_class, level)
            if current.step_since is not None or current.rolled_back:
                return state
            started = replace(current, step_since=now)
            return replace(state, levels={**state.levels, (task_class, level): started})

        store.change_state(start)
        return None
    step = seen.step + 1
    if step >= len(ramp.steps) or now - seen.step_since < ramp.dwell:
        return None
    weight = percent(ramp.steps[step])
    stepped = False

    def advance(state: CanaryState) -> CanaryState:
        nonlocal stepped
        current = state.of(task_class, level)
        stepped = current == seen  # unchanged since read: no CLI, no other guard
        return state.with_step(task_class, level, now, step, weight) if stepped else state

    store.change_state(advance)
    if not stepped:
        return None
    log.info(
        "canary ramp: %s (%s) steps to %g%% (step %d of %d) after %d s without a rollback",
        task_class,
        level,
        weight,
        step + 1,
        len(ramp.steps),
        now - seen.step_since,
    )
    return f"step {task_class} ({level}) {weight:g}%"


def judged_windows(
    engine: Engine,
    ledger: Ledger,
    task_class: str,
    level: str,
    now: int,
    settings: Settings,
    promoted: int | None,
    min_runs: int,
) -> tuple[Window, Window]:
    """The two windows the guard judges, both since the promotion if there was one:
    the short one (``BRIDGE_CANARY_WINDOW``, read row by row, with durations), quick to
    show a large difference, and the long one (``BRIDGE_CANARY_HISTORY``, from the
    ledger), which a small one at low traffic needs. The short window's old side is
    the history's when it holds fewer than ``min_runs`` runs (the old side's history is
    evidence whatever the promotion)."""
    seconds, history = settings.canary_window, now - settings.canary_history
    if promoted is not None:
        seconds = max(0, min(seconds, now - promoted))
    short = read_window(engine, task_class, level, seconds, settings.canary_window_runs)
    runs = LONG_RUNS_PER_SHORT * settings.canary_window_runs

    def over(since: int) -> Window:
        return long_window(engine, ledger, task_class, level, (since, now), runs)

    long = over(history if promoted is None else max(history, promoted))
    if short.old.runs < min_runs:
        old = long.old if promoted is None or promoted <= history else over(history).old
        short = replace(short, old=old)
    return short, long


def guard_once(
    store: CanaryStore,
    engine: Engine,
    settings: Settings,
    suspicions: Suspicions,
    ledger: Ledger | None = None,
) -> list[str]:
    """Judge every shared class once: roll back those the new side was found worse for
    on ``failure_limit`` evaluations in a row, and move a quiet ramp to its next step.
    Returns what it did (``rollback C (level)``, ``step C (level) 5%``); nothing but one
    read of the options when no class is shared, or when another guard holds the lock."""
    if not store.read().partial():
        return []
    bounds = Bounds.from_settings(settings)
    ledger = ledger or Ledger(settings.canary_history)
    made: list[str] = []
    with guard_lock(engine, settings.owner_prefix) as now:
        if now is None:
            return []
        canary = store.read()  # under the lock: as the last guard left it
        for task_class, level, _weight in canary.partial():
            # Since a promotion only: the runs that made the rollback are judged already.
            promoted = canary.state.promoted_at(task_class, level)
            # The class's own bounds over the settings' (``"guard"`` in its weights).
            own: dict[str, Any] = dict(canary.configured(task_class).guard)
            mine = replace(bounds, **own)
            short, long = judged_windows(
                engine, ledger, task_class, level, now, settings, promoted, mine.min_runs
            )
            reason = verdict(short, mine) or verdict(long, mine)
            if suspicions.confirmed(task_class, level, reason, own.get("failure_limit")):
                if _trip(store, task_class, level, now, str(reason)):
                    made.append(f"rollback {task_class} ({level})")
                continue
            if reason is not None:
                continue  # suspected: no ramp step meanwhile
            stepped = _ramp(store, canary, task_class, level, now)
            if stepped is not None:
                made.append(stepped)
    return made
