"""``celery -A bridge beat`` as the README runs it leaves no schedule file behind."""

from __future__ import annotations

import signal

from bridge_harness import POLL_SENT


def test_beat_writes_no_schedule_file_in_its_directory(make_bridge, database_url, amqp_url):
    bridge = make_bridge(database_url, amqp_url)
    before = set(bridge.directory.iterdir())
    worker = bridge.worker("worker", [bridge.default_queue, bridge.control_queue])
    ids = bridge.enqueue("PhabricatorTestWorker", {}, count=2)
    beat = bridge.beat(schedule_file=False, level="DEBUG")
    bridge.wait_ready(worker)
    bridge.wait_archived(ids)
    # Beat has run its schedule several times: a file would exist by now.
    bridge.wait_until(lambda: beat.log().count(POLL_SENT) >= 3, 20, "three polls")
    beat.signal(signal.SIGTERM)
    assert beat.wait(20) == 0
    left = {p.name for p in set(bridge.directory.iterdir()) - before}
    assert not {name for name in left if name.startswith("celerybeat-schedule")}, left
