"""The pace: how many leases a queue holds, from its archived runs (``bridge.engine.pace``)."""

from __future__ import annotations

import pytest

from bridge.engine.pace import FLOOR, SHORT_EVIDENCE, Pace, in_flight_target
from bridge.queue.model import RecentRuns

AHEAD = 0.25


def pace(count: int, seconds_each: float, span: int) -> Pace:
    found = Pace.of(RecentRuns(count, int(count * seconds_each * 1e6), span))
    assert found is not None
    return found


@pytest.mark.parametrize(
    ("runs", "leases", "message"),
    [
        # 50 ms tasks on two busy slots, 40 a second: the slots and a quarter second's
        # starts, a message each (spread over as many processes as may be idle).
        (pace(400, 0.05, 10), 12, 1),
        # 4 ms tasks on one busy slot: a quarter second's starts in 8 messages, not 32 of
        # two tasks each (each message costs the worker about a task's CPU).
        (pace(2500, 0.004, 10), 63, 7),
        # 1 s tasks on two slots: one waiting task at most, a message each.
        (pace(20, 1.0, 10), 3, 1),
        # No-op work: waiting behind 500 of them costs less than a quarter second;
        # messages as large as BRIDGE_BATCH_MAX allows.
        (pace(500, 0.0002, 1), 500, 16),
    ],
)
def test_a_queue_holds_what_its_busy_slots_start_within_ahead(runs, leases, message):
    assert in_flight_target(runs, AHEAD, limit=500) == leases
    target = in_flight_target(runs, AHEAD, limit=500)
    assert runs.message_size(target, AHEAD, batch_max=16) == message


def test_a_few_short_runs_do_not_send_a_backlog_at_once():
    # Ten quick runs (a warm-up, a class that is sometimes quick) say little about the
    # backlog behind them: the queue grows from what its workers finish.
    assert in_flight_target(pace(10, 0.0004, 2), AHEAD, limit=500) == FLOOR
    assert in_flight_target(pace(SHORT_EVIDENCE, 0.0004, 2), AHEAD, limit=500) == 500


def test_a_message_carries_at_most_ahead_seconds_of_work():
    # 10 ms tasks on 16 busy slots: 64 messages (four a slot) carry 7 each, 0.07 s of
    # work; 16 slots of 1 s tasks, one each, however many are leased.
    runs = pace(1600, 0.01, 1)
    assert runs.message_size(450, AHEAD, batch_max=16) == 7
    assert runs.message_size(450, 0.05, batch_max=16) == 5
    assert pace(160, 1.0, 10).message_size(450, AHEAD, batch_max=16) == 1


def test_busy_slots_follow_littles_law():
    assert pace(80, 0.5, 10).busy == pytest.approx(4.0)


def test_no_recent_runs_start_with_the_floor_and_off_fills_to_the_limit():
    assert Pace.of(RecentRuns(0, 0, 1)) is None
    assert in_flight_target(None, AHEAD, limit=500) == FLOOR
    assert in_flight_target(None, AHEAD, limit=1) == 1
    assert in_flight_target(pace(20, 1.0, 10), None, limit=500) == 500
