"""Warm shutdown: the running task finishes, the dispatched-but-unstarted ones are handed back.

A worker holds messages it has not started only when it prefetches more than it runs:
with the bridge's ``worker_prefetch_multiplier = 1`` and acks late, every unacked
message of a ``-c 1`` worker is the one running. So the worker here is started with
``--prefetch-multiplier 4``, the setting an operator would pick for short tasks.
"""

from __future__ import annotations

import signal

from bridge.queue.model import RESULT_SUCCESS

DISPATCH_LEASE = 60  # the hand-back, not an expiry, must be what frees the leases
RUNNING_SECONDS = 3
UNSTARTED = 3


def test_warm_shutdown_finishes_the_running_task_and_hands_back_the_rest(
    make_bridge, database_url, broker_url
):
    # Unpaced, one poll dispatches all four: the pace would hold the others back in the
    # database until the long task's run showed how slow this queue is.
    bridge = make_bridge(
        database_url, broker_url, DISPATCH_LEASE=str(DISPATCH_LEASE), DISPATCH_AHEAD="off"
    )
    [running] = bridge.enqueue("RecordedA", {"duration": RUNNING_SECONDS}, priority=1000)
    waiting = bridge.enqueue("RecordedB", count=UNSTARTED, priority=3000)
    worker = bridge.worker("worker", [bridge.default_queue], extra=("--prefetch-multiplier", "4"))
    poller = bridge.worker("poller", [bridge.control_queue])
    beat = bridge.beat()
    bridge.wait_ready(worker, poller)

    bridge.wait_until(lambda: bridge.runs_of(running), 20, "the long task to start")
    bridge.wait_until(
        lambda: worker.log().count("] received") >= 1 + UNSTARTED,
        10,
        "the worker to hold the other tasks' messages",
    )
    # No more polls: a poll would lease the handed-back rows again at once.
    beat.kill()
    poller.kill()
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=RUNNING_SECONDS + 15) == 0

    [row] = bridge.archived([running]).values()
    assert row.result == RESULT_SUCCESS, "the running task did not finish"
    freed = bridge.active_rows(waiting)
    assert [(r.leaseOwner, r.leaseExpires) for r in freed.values()] == [(None, None)] * UNSTARTED
    assert all(bridge.runs_of(task_id) == [] for task_id in waiting)
    assert f"handed back {UNSTARTED} unstarted lease(s)" in worker.log()

    # Handed back, they run as soon as a worker is there, long before their lease ends.
    successor = bridge.worker("successor", [bridge.default_queue, bridge.control_queue])
    bridge.beat("beat-2")
    bridge.wait_ready(successor)
    archived = bridge.wait_archived(waiting, timeout=DISPATCH_LEASE / 3)
    assert {r.result for r in archived.values()} == {RESULT_SUCCESS}
