"""Flower's view: task events name ``bridge.execute`` with arguments readable as ``Class#id``.

Events are captured the way Flower captures them, with Celery's event receiver on the
broker, and only those of this test's worker are kept.
"""

from __future__ import annotations

import re
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
    # Flower's search finds each task by the pair ``kwargs:<id>=<class>``.
    assert sorted(e["kwargs"] for e in received) == [repr({i: TASK_CLASS}) for i in ids]
    uuids = {e["uuid"] for e in received}
    # The poller's task-sent events (from its prefork child) say where each one went.
    sent = one_per_task("task-sent", lambda e: e["uuid"] in uuids)
    assert {(e["name"], e["queue"]) for e in sent} == {("bridge.execute", bridge.default_queue)}
    assert sorted(e["args"] for e in sent) == sorted(e["args"] for e in received)
    succeeded = one_per_task("task-succeeded", lambda e: e["uuid"] in uuids)
    assert sorted(e["result"] for e in succeeded) == [
        f"'{TASK_CLASS}#{i} [native]: success'" for i in ids
    ]
    # The polls that leased them sent no event: no task-sent to the control queue (beat's
    # and the worker's), and each event of the worker's is about one of these messages.
    assert [e for e in list(log.events) if e.get("queue") == bridge.control_queue] == []
    assert {e["uuid"] for e in log.of(node) if e["type"].startswith("task-")} == uuids


def test_celery_states_are_the_outcomes_and_failures_log_no_traceback(event_log):
    """Flower's states: SUCCESS, RETRY for a temporary failure, FAILURE with the reason,
    SUCCESS for a yield (the message is done; the row runs again in a new one); nothing
    is sent again by Celery, a RETRY included (the rows decide), and expected failures
    log one line each."""
    bridge, log = event_log
    worker = bridge.worker("worker", [bridge.default_queue, bridge.control_queue])
    bridge.wait_ready(worker)
    node = bridge.node(worker.name)
    bridge.wait_until(lambda: log.of(node), 10, "the worker's first event")

    [ok] = bridge.enqueue(TASK_CLASS, {})
    [flaky] = bridge.enqueue(TASK_CLASS, {"doWork": "fail-temporary", "getWaitBeforeRetry": 3600})
    [broken] = bridge.enqueue(TASK_CLASS, {"doWork": "fail-permanent"})
    [later] = bridge.enqueue(TASK_CLASS, {"doWork": "yield", "yieldUntil": 4_000_000_000})
    ids = [ok, flaky, broken, later]
    bridge.beat()

    def ended() -> dict[int, dict] | None:
        by_uuid = {
            e["uuid"]: int(e["args"].split("#")[1].split("'")[0])
            for e in list(log.events)
            if e["type"] == "task-received" and e.get("name") == "bridge.execute"
        }
        final = ("task-succeeded", "task-retried", "task-failed")
        done = {
            by_uuid[e["uuid"]]: e
            for e in list(log.events)
            if e["type"] in final and e["uuid"] in by_uuid
        }
        return done if set(ids) <= set(done) else None

    done = bridge.wait_until(ended, 30, "an end event for each task")
    assert {i: done[i]["type"] for i in ids} == {
        ok: "task-succeeded",
        flaky: "task-retried",
        broken: "task-failed",
        later: "task-succeeded",
    }
    assert done[ok]["result"] == f"'{TASK_CLASS}#{ok} [native]: success'"
    assert done[flaky]["exception"] == (
        f"TaskFailed('{TASK_CLASS}#{flaky} [native]: failure: Temporary failure! "
        "(due again in 3600 s)')"
    )
    assert done[broken]["exception"] == (
        f"TaskFailedPermanently('{TASK_CLASS}#{broken} [native]: permanent-failure: "
        "Permanent failure!')"
    )
    assert done[later]["result"].startswith(f"'{TASK_CLASS}#{later} [native]: yield (due again in ")
    assert done[later]["result"].endswith(
        f" s); runs again in a new message: search kwargs:{later}={TASK_CLASS}'"
    )
    assert [r.result for r in bridge.wait_archived([ok, broken]).values()] == [0, 1]
    rows = bridge.active_rows([flaky, later])
    assert (rows[flaky].failureCount, rows[later].leaseOwner) == (1, "(yield)")
    # One run each: Celery retried nothing, and no message waits in the broker.
    received = [e for e in list(log.events) if e["type"] == "task-received"]
    assert len([e for e in received if e.get("name") == "bridge.execute"]) == len(ids)
    worker_log = worker.log()
    assert "Traceback" not in worker_log
    assert f"raised expected: TaskFailedPermanently('{TASK_CLASS}#{broken}" in worker_log
    assert f"retry: {TASK_CLASS}#{flaky} [native]: failure: Temporary failure! (due" in worker_log


def test_one_grep_follows_a_task_from_the_poll_to_its_outcome(make_bridge, database_url, amqp_url):
    bridge = make_bridge(database_url, amqp_url)
    worker = bridge.worker("worker", [bridge.default_queue, bridge.control_queue])
    [task_id] = bridge.enqueue(TASK_CLASS, {"doWork": "fail-permanent"})
    bridge.beat()
    bridge.wait_ready(worker)
    bridge.wait_archived([task_id])
    tag = f"[task={task_id} class={TASK_CLASS} owner="
    dispatched = bridge.wait_until(
        lambda: [ln for ln in worker.log().splitlines() if tag in ln and "dispatched" in ln],
        10,
        "the dispatch line",
    )
    traceparent = dispatched[0].split("traceparent=")[1].rstrip("]")
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", traceparent)
    lines = [line for line in worker.log().splitlines() if traceparent in line]
    assert any("dispatched to" in line for line in lines)
    assert any(f"task {task_id} failed permanently: Permanent failure!" in line for line in lines)
    assert any(f"{TASK_CLASS}#{task_id} [native]: permanent-failure" in line for line in lines)
    assert all(tag in line for line in lines)
