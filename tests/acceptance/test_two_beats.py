"""Two ``celery beat`` processes, as on two hosts: one sends the polls, the other stands
by, and takes over when the first one dies (``bridge.queue.beat_lock``)."""

from __future__ import annotations

from collections import Counter

from bridge.queue.model import RESULT_SUCCESS

TASKS = 300
LEADS, STANDS_BY = "this beat sends the polls", "standing by; another beat holds"


def test_a_second_beat_stands_by_and_takes_over_when_the_first_dies(
    make_bridge, database_url, broker_url
):
    bridge = make_bridge(database_url, broker_url, MAX_INFLIGHT="10", DISPATCH_AHEAD="off")
    first_half = bridge.enqueue("RecordedA", count=TASKS // 2)
    queues = [bridge.default_queue, bridge.control_queue]
    workers = [bridge.worker(f"worker-{n}", queues, concurrency=2) for n in (1, 2)]
    beats = [bridge.beat("beat-1"), bridge.beat("beat-2")]
    bridge.wait_ready(*workers)
    bridge.wait_archived(first_half, timeout=90)

    [leader] = [beat for beat in beats if LEADS in beat.log()]
    [standby] = [beat for beat in beats if beat is not leader]
    assert STANDS_BY in standby.log()

    leader.kill()  # SIGKILL: the server frees the lock with the dead process's connection
    second_half = bridge.enqueue("RecordedA", count=TASKS // 2)
    archived = bridge.wait_archived(first_half + second_half, timeout=90)
    assert {row.result for row in archived.values()} == {RESULT_SUCCESS}
    assert LEADS in standby.log()
    runs = Counter(r["id"] for r in bridge.runs())
    assert runs == Counter(first_half + second_half), "a task ran twice"
