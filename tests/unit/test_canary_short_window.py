"""The guard's kept short window (bridge/canary/short_window.py, ``guard.short_windows``):
evaluation after evaluation, with rows archived in between, each window is the one a
fresh ``read_windows`` gives over the same rows, while a later evaluation reads only the
rows archived after its mark; on SQLite and MariaDB."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import sqlalchemy as sa

from bridge.canary import short_window
from bridge.canary import sql as canary_sql
from bridge.canary.guard import Window, read_windows, short_windows
from bridge.canary.ledger import SETTLE, Ledger
from bridge.queue import make_engine
from bridge.queue.implementations import CELERY, PYTHON
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_archivetask as archive

BASE = 1_700_000_000  # the database's clock at the first evaluation, as the tests set it
OWNERS = [
    "bridge:native:1:1:host:1",
    "bridge:native~2:1:1:host:1",  # queued two follow-ups
    "bridge:runner:1:1:host:1",
    "bridge:runner~1:1:1:host:1",
    "bridge:runner-fallback:1:1:host:1",
    "bridge:conduit:1:1:host:1",
    "phd:1:1:host:1",
    "phd-fallback:1:1:host:1",
    "1:1:host:1",  # Phorge's own taskmasters: no label
]


class Archive:
    """Archive and active rows written at seconds the test chooses, and the database's
    clock (``canary_sql.server_time``) set to the test's ``now``."""

    def __init__(self, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
        self.engine, self.now = engine, BASE
        self.random = random.Random(seed)
        ids = list(range(1, 100_000))
        self.random.shuffle(ids)  # a row's id says nothing of when it was archived
        self.ids: Iterator[int] = iter(ids)
        monkeypatch.setattr(canary_sql, "server_time", lambda: sa.select(sa.literal(self.now)))

    def archive(self, task_class: str, modified: int, count: int, owner: str | None = None) -> None:
        """``count`` rows of ``task_class`` archived at ``modified``: successes at the
        first run of ``owner``, else of random owners and outcomes (successes, permanent
        failures, cancellations, earlier failures)."""
        pick = self.random
        rows = [
            {
                "id": next(self.ids),
                "taskClass": task_class,
                "leaseOwner": owner or pick.choice(OWNERS),
                "leaseExpires": modified,
                "failureCount": 0 if owner else pick.choice([0, 0, 0, 1, 3]),
                "dataID": 1,
                "result": 0 if owner else pick.choice([0, 0, 0, 0, 1, 2]),
                "duration": pick.randrange(1, 10**7),
                "dateCreated": modified,
                "dateModified": modified,
                "priority": 3000,
            }
            for _ in range(count)
        ]
        if rows:
            with self.engine.begin() as conn:
                conn.execute(sa.insert(archive), rows)

    def failing(self, task_class: str, failed: int) -> None:
        """An active row of ``task_class`` that failed at ``failed``: a fallback, or a
        failure waiting for its retry."""
        owner = self.random.choice([None, *OWNERS])
        row = {
            "id": next(self.ids),
            "taskClass": task_class,
            "leaseOwner": owner,
            "leaseExpires": failed + 300,
            "failureCount": 0 if owner is None else 1,
            "dataID": 1,
            "failureTime": failed,
            "priority": 3000,
            "dateCreated": failed,
            "dateModified": failed,
        }
        with self.engine.begin() as conn:
            conn.execute(sa.insert(active), [row])


@pytest.fixture
def paged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages of 7 rows in both reads: pages that split the rows of one second."""
    monkeypatch.setattr(short_window, "PAGE_ROWS", 7)


FRESH = [False]  # while the fresh read runs: its pages are not the kept read's


def recorded_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ``since`` of each archive page the kept read asks for, as it asks."""
    starts: list[int] = []

    def recorded(classes, since, limit, before=None):
        if not FRESH[0]:
            starts.append(since)
        return canary_sql.archived_runs(classes, since, limit, before)

    monkeypatch.setattr(short_window, "sql", SimpleNamespace(archived_runs=recorded))
    return starts


def kept_and_fresh(
    db: Archive, ledger: Ledger, asked: list[tuple[str, str, int]], max_runs: int
) -> list[Window]:
    kept = short_windows(db.engine, ledger, asked, max_runs)
    FRESH[0] = True
    try:
        assert kept == read_windows(db.engine, asked, max_runs), f"at {db.now - BASE} s"
    finally:
        FRESH[0] = False
    return kept


@pytest.mark.usefixtures("paged")
def test_each_evaluation_keeps_the_window_a_fresh_read_gives(engine, monkeypatch):
    """Seconds of a busy and a quiet class, with bursts, evaluated every few seconds and
    after pauses (one longer than the span) with nothing archived, at both levels, one
    class judged afresh from a second that moves (its span growing from 0, then the
    whole span again): rows archived late within ``SETTLE``, windows cut or not, rows
    leaving the span. The kept window equals the fresh read's at every evaluation."""
    db = Archive(make_engine(engine.url.render_as_string(hide_password=False)), monkeypatch, 1)
    for second in range(BASE - 400, BASE + 1, 3):
        db.archive("A", second, db.random.randrange(3))
        db.archive("B", second, db.random.randrange(2))
    ledger, since, seen = Ledger(3600), None, set()
    steps = [1, 2, 1, 3, 1, 1, 5, 20, 1, 2, 400, 1, 2, 1, 7, 1, 1, 60, 2, 1] * 3
    for step, evaluation in zip(steps, itertools.count()):
        before, db.now = db.now, db.now + step
        quiet = db.now - 2 if step > 30 else 0  # a pause: only its last seconds archive
        for second in range(max(before - SETTLE + 1, db.now - 300, quiet), db.now + 1):
            burst = 4 if evaluation % 13 < 3 else 1  # the new side's cut comes and goes
            db.archive("A", second, db.random.randrange(3 * burst))
            db.archive("B", second, db.random.randrange(2))
        if evaluation % 4 == 0:
            db.failing(db.random.choice("AB"), db.now - db.random.randrange(400))
        if evaluation % 20 == 5:
            since = db.now - 2  # a promotion: B judged from here
        elif evaluation % 20 == 15:
            since = None  # its history let it go: the whole span again
        span = 300 if since is None else max(0, min(300, db.now - since))
        asked = [("A", PYTHON, 300), ("A", CELERY, 300), ("B", PYTHON, span), ("C", PYTHON, 300)]
        for window in kept_and_fresh(db, ledger, asked, 15):
            seen.add((window.task_class, window.level, window.seconds < 300))
    # What the rows above were for: each window of A cut at some evaluations, not at others.
    assert {("A", PYTHON, True), ("A", PYTHON, False), ("A", CELERY, True)} <= seen
    assert {("B", PYTHON, True), ("B", PYTHON, False), ("A", CELERY, False)} <= seen


def test_a_later_evaluation_reads_only_the_rows_after_its_mark(engine, monkeypatch):
    """The first evaluation reads the span; each later one the rows archived after the
    previous mark (``SETTLE`` s before its clock) on, and a class asked anew its span;
    a class no longer asked is forgotten (read afresh when asked again)."""
    db = Archive(make_engine(engine.url.render_as_string(hide_password=False)), monkeypatch, 2)
    for second in range(BASE - 299, BASE + 1, 10):
        db.archive("A", second, 2)
        db.archive("B", second, 2)
    reads = recorded_reads(monkeypatch)
    ledger = Ledger(3600)
    kept_and_fresh(db, ledger, [("A", PYTHON, 300)], 1000)
    assert reads == [BASE - 300]
    db.now += 2
    db.archive("A", db.now - 1, 3)
    reads.clear()
    (a,) = kept_and_fresh(db, ledger, [("A", PYTHON, 300)], 1000)
    assert reads == [BASE - SETTLE + 1], "only the rows after the mark"
    assert a.new.runs + a.old.runs > 60
    db.now += 1
    reads.clear()
    kept_and_fresh(db, ledger, [("A", PYTHON, 300), ("B", PYTHON, 300)], 1000)
    assert reads == [db.now - 300], "B's whole span, A's rows after its mark in it"
    db.now += 1
    reads.clear()
    kept_and_fresh(db, ledger, [("B", PYTHON, 300)], 1000)
    kept_and_fresh(db, ledger, [("A", PYTHON, 300)], 1000)
    assert reads == [db.now - SETTLE, db.now - 300], "A was forgotten"


@pytest.mark.usefixtures("paged")
def test_rows_after_the_mark_that_reach_the_cut_are_the_whole_window(engine, monkeypatch):
    """An evaluation whose rows after the mark alone reach the cut reads no further back
    (three pages of 7 rows for 20 runs, of 60 after the mark), and its window is theirs:
    the kept rows are behind the cut."""
    db = Archive(make_engine(engine.url.render_as_string(hide_password=False)), monkeypatch, 3)
    for second in range(BASE - 200, BASE + 1, 5):
        db.archive("A", second, 4)
    pages = recorded_reads(monkeypatch)
    ledger = Ledger(3600)
    (first,) = kept_and_fresh(db, ledger, [("A", CELERY, 300)], 20)
    assert first.new.runs >= 20 and first.seconds < 300
    db.now += 2
    for second in (db.now - 1, db.now):
        db.archive("A", second, 30, "bridge:native:1:1:host:1")  # the new side's, 30 runs
    pages.clear()
    (cut,) = kept_and_fresh(db, ledger, [("A", CELERY, 300)], 20)
    assert len(pages) == 3
    assert (cut.new.runs, cut.old.runs, cut.seconds) == (20, 0, 0)


def test_a_span_that_starts_further_back_is_read_afresh(engine, monkeypatch):
    """A class judged afresh lets its history go (its span the whole window again): the
    rows of the longer span are read. The database's clock set back under a span that
    starts at a fixed second (a promotion's) counts no row twice."""
    db = Archive(make_engine(engine.url.render_as_string(hide_password=False)), monkeypatch, 4)
    for second in range(BASE - 299, BASE + 1, 10):
        db.archive("A", second, 2)
    db.archive("A", BASE - SETTLE - 1, 2)  # kept at once, and after the clock set back
    ledger = Ledger(3600)
    (short,) = kept_and_fresh(db, ledger, [("A", PYTHON, 10)], 1000)
    (whole,) = kept_and_fresh(db, ledger, [("A", PYTHON, 300)], 1000)
    assert short.seconds == 10 and whole.new.runs + whole.old.runs > 10 * (
        short.new.runs + short.old.runs
    )
    promoted = BASE - 20
    for moved in (-3, 6):
        db.now += moved
        db.archive("A", db.now - 1, 2)
        kept_and_fresh(db, ledger, [("A", PYTHON, db.now - promoted)], 1000)
