"""Flower's view: task events name ``bridge.execute`` with arguments readable as ``Class#id``.

Events are captured the way Flower captures them, with Celery's event receiver on the
broker, and only those of this test's worker are kept.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from celery import Celery

TASK_CLASS = "PhabricatorTestWorker"


class EventLog:
    """Celery events captured from the broker in a background thread."""

    def __init__(self, broker_url: str) -> None:
        self.app = Celery(broker=broker_url, set_as_current=False)
        self.events: list[dict] = []
        self.receiver = None
        self.thread = threading.Thread(target=self._capture, daemon=True)

    def _capture(self) -> None:
        with self.app.connection_for_read() as conn:
            self.receiver = self.app.events.Receiver(conn, handlers={"*": self.events.append})
            self.receiver.capture(wakeup=False)

    def of(self, hostname: str, event_type: str | None = None) -> list[dict]:
        return [
            e
            for e in list(self.events)
            if e.get("hostname") == hostname and event_type in (None, e["type"])
        ]

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.should_stop = True
        self.thread.join(timeout=5)


@pytest.fixture
def event_log(make_bridge, database_url, broker_url) -> Iterator[tuple[object, EventLog]]:
    bridge = make_bridge(database_url, broker_url, TASK_EVENTS="true")
    log = EventLog(bridge.broker_url)
    log.thread.start()
    yield bridge, log
    log.stop()


def test_task_events_show_bridge_execute_with_the_phorge_task_as_argument(event_log):
    bridge, log = event_log
    worker = bridge.worker("worker", [bridge.default_queue, bridge.control_queue])
    bridge.wait_ready(worker)
    node = bridge.node(worker.name)
    bridge.wait_until(lambda: log.of(node), 10, "the worker's first event")

    ids = bridge.enqueue(TASK_CLASS, count=3)
    bridge.beat()
    bridge.wait_archived(ids)

    def one_per_task(event_type: str, keep) -> list[dict]:
        def found() -> list[dict]:
            return [e for e in list(log.events) if e["type"] == event_type and keep(e)]

        bridge.wait_until(lambda: len(found()) >= len(ids), 10, f"{len(ids)} {event_type} events")
        assert len(found()) == len(ids), found()
        return found()

    received = one_per_task(
        "task-received", lambda e: e["hostname"] == node and e["name"] == "bridge.execute"
    )
    assert sorted(e["args"] for e in received) == [f"('{TASK_CLASS}#{i}',)" for i in ids]
    assert {e["kwargs"] for e in received} == {"{}"}
    uuids = {e["uuid"] for e in received}
    # The poller's task-sent events (from its prefork child) say where each one went.
    sent = one_per_task("task-sent", lambda e: e["uuid"] in uuids)
    assert {(e["name"], e["queue"]) for e in sent} == {("bridge.execute", bridge.default_queue)}
    assert sorted(e["args"] for e in sent) == sorted(e["args"] for e in received)
    succeeded = one_per_task("task-succeeded", lambda e: e["uuid"] in uuids)
    assert sorted(e["result"] for e in succeeded) == [f"'{TASK_CLASS}#{i}: success'" for i in ids]
