"""Many tasks, two classes, two queues: each runs exactly once, on its own queue's worker."""

from __future__ import annotations

from collections import Counter

from bridge.queue.model import RESULT_SUCCESS
from bridge.queue.schema import worker_activetask as active

TASKS_PER_CLASS = 500


def test_two_classes_on_two_queues_each_run_once_on_their_own_worker(
    make_bridge, database_url, broker_url
):
    bridge = make_bridge(database_url, broker_url)
    bridge.route(RecordedA="queue-a", RecordedB="queue-b")
    ids = bridge.enqueue("RecordedA", count=TASKS_PER_CLASS)
    ids += bridge.enqueue("RecordedB", count=TASKS_PER_CLASS)

    workers = [
        bridge.worker("worker-a", [bridge.queue_name("queue-a")], concurrency=2),
        bridge.worker("worker-b", [bridge.queue_name("queue-b")], concurrency=2),
        bridge.worker("poller", [bridge.control_queue]),
    ]
    bridge.beat()
    bridge.wait_ready(*workers)

    archived = bridge.wait_archived(ids, timeout=90)
    assert len(archived) == 2 * TASKS_PER_CLASS
    assert {row.result for row in archived.values()} == {RESULT_SUCCESS}
    assert bridge.count(active) == 0

    runs = bridge.runs()
    assert Counter(r["id"] for r in runs) == Counter(ids), "some task ran more than once"
    assert Counter((r["taskClass"], r["worker"]) for r in runs) == {
        ("RecordedA", "worker-a"): TASKS_PER_CLASS,
        ("RecordedB", "worker-b"): TASKS_PER_CLASS,
    }
