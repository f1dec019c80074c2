"""Crash safety: a worker killed under a task delays it, never loses it nor archives it twice."""

from __future__ import annotations

import os
import signal

import pytest

from bridge.queue.model import RESULT_SUCCESS
from bridge.queue.schema import worker_activetask as active

TASK_SECONDS = 3
DISPATCH_LEASE = "6"  # short, so a lost message only delays the task a few seconds


@pytest.mark.parametrize("victim", ["prefork-child", "whole-worker"])
def test_kill_9_during_a_task_another_worker_finishes_it_once(
    make_bridge, database_url, broker_url, victim
):
    bridge = make_bridge(
        database_url, broker_url, DISPATCH_LEASE=DISPATCH_LEASE, POLL_INTERVAL="0.5"
    )
    workers = {
        name: bridge.worker(name, [bridge.default_queue]) for name in ("worker-1", "worker-2")
    }
    poller = bridge.worker("poller", [bridge.control_queue])
    bridge.wait_ready(*workers.values(), poller)
    [task_id] = bridge.enqueue("RecordedA", {"duration": TASK_SECONDS})
    bridge.beat()

    [first] = bridge.wait_until(lambda: bridge.runs_of(task_id), 20, "the task to start")
    if victim == "prefork-child":
        os.kill(first["pid"], signal.SIGKILL)
    else:
        workers[first["worker"]].kill()

    [row] = bridge.wait_archived([task_id], timeout=60).values()
    assert row.result == RESULT_SUCCESS
    assert bridge.count(active) == 0, "a lease stayed behind"
    assert len(bridge.runs_of(task_id)) == 2, "expected the killed run and one more"
    [finished] = bridge.runs_of(task_id, "end")
    assert finished["pid"] != first["pid"]
    if victim == "whole-worker":
        assert finished["worker"] != first["worker"]
