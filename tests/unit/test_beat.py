"""Beat's scheduler sleeps until the poll is due instead of spinning for it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from celery import Celery
from celery.beat import Scheduler
from celery.schedules import schedule

from bridge.queue.beat_lock import CHECK_EVERY
from bridge.runtime.beat import PollScheduler

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
INTERVAL = timedelta(seconds=0.25)
DUE_IN = 0.005  # seconds: inside the 10 ms Celery's scheduler spins through


def delay_before_due(scheduler_class: type[Scheduler]) -> float:
    """What one tick returns when the poll is due in ``DUE_IN`` seconds."""
    app = Celery(set_as_current=False)
    scheduler = scheduler_class(app, lazy=True)
    if isinstance(scheduler, PollScheduler):
        scheduler.lock = Holding()  # this beat sends (not the lock of whatever database)
    scheduler.schedule["poll"] = scheduler.Entry(
        name="poll",
        task="bridge.poll",
        schedule=schedule(INTERVAL, nowfun=lambda: NOW, app=app),
        last_run_at=NOW - INTERVAL + timedelta(seconds=DUE_IN),
        app=app,
    )
    return scheduler.tick()


def test_a_poll_not_yet_due_is_slept_for():
    assert delay_before_due(PollScheduler) == DUE_IN


def test_celerys_scheduler_would_tick_again_without_sleeping():
    # The reason PollScheduler exists: beat sleeps only on a positive delay.
    assert delay_before_due(Scheduler) <= 0


class StandingBy:
    """A beat lock another beat holds."""

    def held(self) -> bool:
        return False

    def close(self) -> None:
        pass


class Holding(StandingBy):
    """The beat lock, held by this beat."""

    def held(self) -> bool:
        return True


def test_a_beat_standing_by_sends_nothing_and_checks_again_later(monkeypatch):
    app = Celery(set_as_current=False)
    scheduler = PollScheduler(app, lazy=True)
    scheduler.lock = StandingBy()
    scheduler.schedule["poll"] = scheduler.Entry(
        name="poll",
        task="bridge.poll",
        schedule=schedule(INTERVAL, nowfun=lambda: NOW, app=app),
        last_run_at=NOW - 4 * INTERVAL,  # long due
        app=app,
    )
    sent: list[str] = []
    monkeypatch.setattr(scheduler, "apply_entry", lambda entry, producer=None: sent.append(entry))
    assert scheduler.tick() == CHECK_EVERY
    assert sent == []
