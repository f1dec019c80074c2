"""Two ``celery beat`` processes at once: polls double, yet no task runs twice.

Celery beat is one process by design; a second one is a mistake the guarded lease
makes harmless (every poll leases only rows nobody holds).
"""

from __future__ import annotations

from collections import Counter

from bridge.queue.model import RESULT_SUCCESS

TASKS = 300


def test_two_beats_never_run_a_task_twice(make_bridge, database_url, broker_url):
    # A small capacity keeps both beats' polls leasing, and racing, until the end.
    bridge = make_bridge(database_url, broker_url, MAX_INFLIGHT="10", POLL_INTERVAL="0.1")
    ids = bridge.enqueue("RecordedA", count=TASKS)
    queues = [bridge.default_queue, bridge.control_queue]
    workers = [bridge.worker(f"worker-{n}", queues, concurrency=2) for n in (1, 2)]
    beats = [bridge.beat("beat-1"), bridge.beat("beat-2")]
    bridge.wait_ready(*workers)

    archived = bridge.wait_archived(ids, timeout=90)
    assert {row.result for row in archived.values()} == {RESULT_SUCCESS}
    runs = Counter(r["id"] for r in bridge.runs())
    assert runs == Counter(ids), f"ran twice: {[i for i, n in runs.items() if n > 1]}"
    for beat in beats:
        assert beat.running() and "Sending due task" in beat.log()
