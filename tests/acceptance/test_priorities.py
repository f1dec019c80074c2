"""Phorge's priorities through real workers and brokers: an urgent task enqueued behind a
backlog starts before the backlog's remaining tasks, on every broker, with the pace on
by default (``bridge.engine.pace``)."""

from __future__ import annotations

import time

import pytest

from bridge.queue.model import RESULT_SUCCESS

BACKLOG, SECONDS = 300, 0.05  # 7.5 s of work on two processes
BULK, URGENT = 4000, 1000  # repository imports and mail, in Phorge's numbers


@pytest.fixture(params=["rabbitmq", "redis", "sqlite"])
def any_broker_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """Each broker the bridge supports: the two servers and the embedded SQLite file."""
    if request.param == "sqlite":
        return f"sqla+sqlite:///{tmp_path / 'broker.db'}"
    return request.getfixturevalue("amqp_url" if request.param == "rabbitmq" else "redis_url")


def test_an_urgent_task_overtakes_a_backlog(make_bridge, database_url, any_broker_url):
    bridge = make_bridge(database_url, any_broker_url)
    backlog = bridge.enqueue("RecordedA", {"duration": SECONDS}, count=BACKLOG, priority=BULK)
    worker = bridge.worker("worker", [bridge.default_queue, bridge.control_queue], concurrency=2)
    bridge.beat()
    bridge.wait_ready(worker)
    bridge.wait_until(lambda: len(bridge.runs()) >= 20, 120, "the backlog to be running")

    enqueued = time.time()
    [mail] = bridge.enqueue("RecordedB", {"duration": SECONDS}, priority=URGENT)
    assert bridge.wait_archived([mail], timeout=60)[mail].result == RESULT_SUCCESS
    [start] = bridge.runs_of(mail)

    backlog_starts = [r["time"] for r in bridge.runs() if r["id"] in set(backlog)]
    remaining = BACKLOG - sum(1 for t in backlog_starts if t < enqueued)
    overtaken_by = sum(1 for t in backlog_starts if enqueued <= t < start["time"])
    # Filling the broker (the 200 in flight these fixtures allow) would start most of the
    # remaining backlog first; the pace lets only what was about to start go ahead.
    assert remaining > BACKLOG // 2
    assert overtaken_by < remaining // 4, f"{overtaken_by} of {remaining} went first"
    bridge.wait_archived(backlog, timeout=120)
