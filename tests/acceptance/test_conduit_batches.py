"""Batched ``worker.execute`` requests with real workers: one request carries several
tasks of a message, each task ends its own way, and a worker's requests in flight stay
within ``BRIDGE_CONDUIT_MAX_REQUESTS`` across all its prefork processes.

The fake Phorge (a real HTTP server on 127.0.0.1) answers every task of a batch by its
data, takes a little while per request so that requests overlap, and counts how many
are in flight at once.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from conduit_fakes import TOKEN, FakeServer, Reply, Request, conduit_result, execute_answer

from bridge.queue.model import RESULT_SUCCESS
from bridge.queue.schema import worker_activetask as active

TASKS = 240
FAILING_EVERY = 10  # every tenth task fails (temporarily, for an hour)
REQUEST_SECONDS = 0.03
MAX_REQUESTS = 2
PROCESSES = 4


@dataclass
class BatchingPhorge:
    """Answers batches and single tasks alike; keeps every request's task ids."""

    requests: list[list[int]] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def respond(self, request: Request) -> Reply:
        if request.path != "/api/worker.execute":  # the circuit breaker's probe
            return conduit_result({"userName": "bridge-bot", "roles": ["admin"]})
        params = request.params
        tasks = params.get("tasks", [params])
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.requests.append([t["taskID"] for t in tasks])
        try:
            time.sleep(REQUEST_SECONDS)
            results = [self.answer(t) for t in tasks]
        finally:
            with self.lock:
                self.in_flight -= 1
        return conduit_result({"results": results} if "tasks" in params else results[0])

    @staticmethod
    def answer(task: dict[str, Any]) -> dict[str, Any]:
        if json.loads(task["data"])["fail"]:
            return execute_answer(result="failure", message="Exception: no", retryWait=3600)
        return execute_answer(result="success", duration=800)


def test_a_backlog_goes_in_batches_within_the_workers_bound(make_bridge, database_url, amqp_url):
    fake = BatchingPhorge()
    with FakeServer(fake.respond) as server:
        bridge = make_bridge(
            database_url,
            amqp_url,
            CONDUIT_URL=server.url,
            CONDUIT_TOKEN=TOKEN,
            CONDUIT_BATCH="8",
            CONDUIT_MAX_REQUESTS=str(MAX_REQUESTS),
            POLL_INTERVAL="0.2",
        )
        ids = [
            bridge.enqueue("ProxyBatched", {"n": n, "fail": n % FAILING_EVERY == 0})[0]
            for n in range(TASKS)
        ]
        failing = set(ids[::FAILING_EVERY])
        worker = bridge.worker(
            "worker", [bridge.default_queue, bridge.control_queue], concurrency=PROCESSES
        )
        bridge.beat()
        bridge.wait_ready(worker)
        bridge.wait_until(
            lambda: bridge.count(active, active.c.id.in_(ids), active.c.failureCount == 0) == 0,
            120,
            "every task to have run once",
        )
        bridge.stop()

    archived = bridge.archived(ids)
    assert set(archived) == set(ids) - failing
    assert {row.result for row in archived.values()} == {RESULT_SUCCESS}
    left = bridge.active_rows(ids)
    assert set(left) == failing
    assert {row.failureCount for row in left.values()} == {1}
    runs = Counter(task_id for request in fake.requests for task_id in request)
    assert set(runs) == set(ids) and set(runs.values()) == {1}, "each task ran once"
    sizes = Counter(len(request) for request in fake.requests)
    assert max(sizes) > 1, f"no request carried more than one task: {sizes}"
    assert max(sizes) <= 8
    assert fake.most_in_flight <= MAX_REQUESTS, "the bound is the worker's, not a process's"
