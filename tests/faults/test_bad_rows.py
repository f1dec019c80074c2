"""Rows only a hand (or a PHP bug) writes, among good ones: each bad row fails alone.

A data row that is not UTF-8 (a UTF-8-encoded surrogate, as MariaDB stores it), one that
is not JSON, a missing data row: each is archived as a failure with its reason, and the
rest of the batch runs. Priorities 0 and 4294967295 run. Class names full of quotes,
``$(...)`` and backticks are not served: they stay queued for PHP, untouched, and the
CLI still lists and cancels them.
"""

from __future__ import annotations

from bad_rows import corrupt_data
from sqlalchemy import delete, select, update

from bridge.queue.model import RESULT_CANCELLED, RESULT_FAILURE
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_taskdata as taskdata

WEIRD_CLASSES = ["Quo'te\"Worker", "$(touch /tmp/pwned)Worker", "`id`Worker"]


def test_bad_rows_fail_alone(fault_database, fault_redis, make_fault_bridge, fault_run):
    bridge = make_fault_bridge(fault_database, fault_redis.url)
    run = fault_run(bridge)
    run.queue(40, duration=0.05)
    surrogate, not_json, no_data = run.queue(3, result=RESULT_FAILURE)
    corrupt_data(bridge.queue, surrogate)
    bridge.corrupt_data(not_json, '{"duration": 0, oops')
    with bridge.engine.begin() as conn:
        data_id = conn.execute(select(active.c.dataID).where(active.c.id == no_data)).scalar()
        conn.execute(delete(taskdata).where(taskdata.c.id == data_id))
    lowest, highest = run.queue(2)
    with bridge.engine.begin() as conn:  # below and above what the queue itself accepts
        conn.execute(update(active).where(active.c.id == lowest).values(priority=0))
        conn.execute(update(active).where(active.c.id == highest).values(priority=4294967295))
    weird = [bridge.enqueue(name, {})[0] for name in WEIRD_CLASSES]
    listed = bridge.cli("list", "--limit", "100")
    assert listed.returncode == 0, listed.stderr
    bridge.serve()
    run.start()
    run.check()
    logs = bridge.logs()
    for task_id in (surrogate, not_json, no_data):
        assert f"task {task_id} failed permanently" in logs
    # The unserved rows are as they were, and the CLI still reads and cancels them.
    rows = bridge.active_rows(weird)
    assert [rows[i].leaseOwner for i in weird] == [None] * 3
    assert bridge.cli("list", "--limit", "100").returncode == 0
    cancelled = bridge.cli("cancel", "--id", str(weird[0]))
    assert cancelled.returncode == 0, cancelled.stderr
    assert bridge.archived([weird[0]])[weird[0]].result == RESULT_CANCELLED
