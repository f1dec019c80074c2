"""Batched ``worker.execute`` requests (``BRIDGE_CONDUIT_BATCH``) against a local HTTP
server playing the extension, and the worker's bound on requests in flight."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from conduit_fakes import TOKEN, FakeServer, Reply, conduit_error, conduit_result, execute_answer

from bridge.handlers.api import TaskContext
from bridge.handlers.outcome import run_handlers
from bridge.queue.model import Outcome
from bridge.transports.conduit.client import ConduitClient
from bridge.transports.conduit.handler import ConduitProxyHandler
from bridge.transports.conduit.request_slots import RequestSlots


def task(task_id: int, task_class: str = "PhabricatorSearchWorker") -> TaskContext:
    raw = json.dumps({"n": task_id})
    return TaskContext(task_id, task_class, {"n": task_id}, 0, 3000, raw_data=raw)


def proxy(url: str, batch: int = 16) -> ConduitProxyHandler:
    return ConduitProxyHandler(ConduitClient(url, TOKEN), batch=batch)


def test_one_request_carries_the_tasks_and_each_gets_its_own_outcome() -> None:
    answers = [
        execute_answer(
            result="success",
            duration=1200,
            followups=[{"taskClass": "PhabricatorSearchWorker", "data": {"x": 1}, "options": []}],
        ),
        execute_answer(result="failure", message="Exception: boom", retryWait=120),
        execute_answer(result="yield", yieldDuration=40),
        execute_answer(result="permanent-failure", message="gone"),
    ]
    tasks = [task(i) for i in (11, 12, 13, 14)]
    with FakeServer(lambda request: conduit_result({"results": answers})) as server:
        handler = proxy(server.url)
        results = run_handlers(handler, tasks)
    (request,) = server.requests
    sent = request.params["tasks"]
    assert [t["taskID"] for t in sent] == [11, 12, 13, 14]
    assert sent[0]["data"] == '{"n": 11}'  # the stored bytes, as for one task
    assert [r.outcome for r in results] == [
        Outcome.SUCCESS,
        Outcome.FAILURE,
        Outcome.YIELD,
        Outcome.PERMANENT_FAILURE,
    ]
    assert results[0].duration_us == 1200
    assert [f.task_class for f in results[0].followups] == ["PhabricatorSearchWorker"]
    assert (results[1].delay, results[1].reason) == (120, "Exception: boom")
    assert results[2].delay == 40


def test_php_dying_in_a_batch_fails_each_task_with_its_message() -> None:
    reply = Reply(status=500, body=b"PHP Fatal error: Allowed memory size exhausted")
    with FakeServer(lambda request: reply) as server:
        results = run_handlers(proxy(server.url), [task(1), task(2)])
    assert [r.outcome for r in results] == [Outcome.FAILURE, Outcome.FAILURE]
    assert all("memory size exhausted" in r.reason for r in results)


def test_an_outage_hands_the_whole_batch_back_without_a_failure() -> None:
    with FakeServer(lambda request: Reply(status=503, body=b"down")) as server:
        handler = proxy(server.url)
        results = run_handlers(handler, [task(1), task(2), task(3)])
    assert [r.outcome for r in results] == [Outcome.HANDED_BACK] * 3
    assert not handler.availability.allow()


def test_an_extension_older_than_batches_gets_one_task_a_request() -> None:
    def old_extension(request: Any) -> Reply:
        params = request.params
        if "taskID" not in params:
            return conduit_error(
                "ERR-BRIDGE-PARAMETER", 'Parameter "taskID" must be an integer no smaller than 1.'
            )
        return conduit_result(execute_answer(result="success"))

    with FakeServer(old_extension) as server:
        handler = proxy(server.url)
        results = run_handlers(handler, [task(1), task(2)])
        assert [r.outcome for r in results] == [Outcome.SUCCESS] * 2
        assert handler.batch_limit == 1, "the engine hands it one task at a time from now on"
    assert [r.params.get("taskID") for r in server.requests] == [None, 1, 2]


def test_a_batch_answered_with_the_wrong_count_fails_every_task() -> None:
    reply = conduit_result({"results": [execute_answer(result="success")]})
    with FakeServer(lambda request: reply) as server:
        results = run_handlers(proxy(server.url), [task(1), task(2)])
    assert [r.outcome for r in results] == [Outcome.FAILURE] * 2


def test_a_class_with_a_long_required_lease_is_sent_alone() -> None:
    reply = conduit_result(execute_answer(result="success"))
    parse = "PhabricatorRepositoryGitCommitChangeParserWorker"
    with FakeServer(lambda request: reply) as server:
        results = run_handlers(proxy(server.url), [task(1), task(2, parse)])
    assert [r.outcome for r in results] == [Outcome.SUCCESS] * 2
    assert [r.params.get("taskID") for r in server.requests] == [1, 2]


def test_requests_in_flight_never_pass_the_bound(tmp_path: Path) -> None:
    in_flight, most = 0, 0
    lock = threading.Lock()

    def slow(request: Any) -> Reply:
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        time.sleep(0.05)
        with lock:
            in_flight -= 1
        return conduit_result(execute_answer(result="success"))

    with FakeServer(slow) as server:
        handler = ConduitProxyHandler(
            ConduitClient(server.url, TOKEN), slots=RequestSlots(2, str(tmp_path))
        )
        threads = [threading.Thread(target=handler.run, args=(task(i),)) for i in range(1, 9)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert len(server.requests) == 8
    assert most == 2


def _hold_forever(directory: str, held: Any) -> None:
    with RequestSlots(1, directory).slot():
        held.set()
        time.sleep(3600)


def test_a_slot_held_by_a_killed_process_is_free_again(tmp_path: Path) -> None:
    held = multiprocessing.get_context("fork").Event()
    child = multiprocessing.get_context("fork").Process(
        target=_hold_forever, args=(str(tmp_path), held)
    )
    child.start()
    try:
        assert held.wait(30)
        slots = RequestSlots(1, str(tmp_path))
        got: list[int] = []
        waiter = threading.Thread(target=lambda: got.extend(_take(slots)))
        waiter.start()
        waiter.join(0.3)
        assert got == [], "the only slot is the child's"
        os.kill(child.pid or 0, signal.SIGKILL)
        waiter.join(30)
        assert got == [0]
    finally:
        child.kill()
        child.join()


def _take(slots: RequestSlots) -> list[int]:
    with slots.slot() as slot:
        return [slot]
