"""Phorge's outcomes through real workers: retries, yields, follow-ups, corrupt data, long runs.

One bridge per broker serves the whole module: every scenario's tasks are queued before
the workers start, so their waits overlap instead of adding up, and each test then waits
for its own tasks only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import pytest

from bridge.queue.model import RESULT_FAILURE, RESULT_SUCCESS, TaskFilter

DISPATCH_LEASE = 3
LONG_TASK_SECONDS = 5  # longer than the dispatch lease: only the heartbeat keeps it
DECLARED_WAIT = 1
MAX_RETRIES = 2
YIELD_SECONDS = 3
# Slack on top of a declared wait: the database clock's whole seconds, a poll, dispatch.
# Seen on 2 cores loaded by a full suite or other tests and two busy loops (9 runs of
# each): at most 1.42 s late on a retry, 1.45 s on the yield; far below any other wait.
LATENESS = 4.0
SETTINGS = {
    "DISPATCH_LEASE": str(DISPATCH_LEASE),
    "POLL_INTERVAL": "0.5",
    # The default retry policy, made short: 1 s, then 2 s, capped at 2 s.
    "RETRY_BASE": "1",
    "RETRY_MAX": "2",
    "RETRY_JITTER": "0",
}


@dataclass
class Scenario:
    bridge: Any  # bridge_harness.Bridge
    ids: dict[str, int] = field(default_factory=dict)
    ordinary: list[int] = field(default_factory=list)

    def add(self, name: str, task_class: str, data: dict, **options) -> None:
        data = {**data, "scenario": self.bridge.suffix, "name": name}
        [self.ids[name]] = self.bridge.enqueue(task_class, data, **options)

    def followups(self, parent: str) -> list:
        """Tasks (active or archived) queued as follow-ups of the named parent."""
        tasks = self.bridge.queue.list(TaskFilter(classes=["RecordedB"]))
        return [
            t
            for t in tasks
            if isinstance(t.data, dict)
            and t.data.get("followupOf") == f"{self.bridge.suffix}:{parent}"
        ]

    def starts(self, name: str) -> list[dict]:
        return self.bridge.runs_of(self.ids[name])


def failing(**policy) -> dict:
    return {"doWork": "fail-temporary", "getMaximumRetryCount": MAX_RETRIES, **policy}


def followup(scenario_suffix: str, parent: str, n: int, **options) -> dict:
    return {
        "taskClass": "RecordedB",
        "data": {"followupOf": f"{scenario_suffix}:{parent}", "n": n},
        **options,
    }


@pytest.fixture(
    scope="module",
    # The threads pool (docs/scaling.md recommends it for work that waits) once.
    params=[("rabbitmq", "prefork"), ("redis", "prefork"), ("rabbitmq", "threads")],
    ids="-".join,
)
def scenario(request, make_module_bridge, module_database_url) -> Iterator[Scenario]:
    broker, pool = request.param
    broker_url = request.getfixturevalue("amqp_url" if broker == "rabbitmq" else "redis_url")
    bridge = make_module_bridge(module_database_url, broker_url, **SETTINGS)
    s = Scenario(bridge)
    suffix = bridge.suffix
    s.add("declared-wait", "RecordedA", failing(getWaitBeforeRetry=DECLARED_WAIT))
    s.add("default-wait", "RecordedA", failing())
    s.add("yield", "RecordedA", {"yieldFirst": YIELD_SECONDS})
    s.add(
        "parent",
        "RecordedA",
        {
            "failTimes": 1,
            "getWaitBeforeRetry": DECLARED_WAIT,
            "followups": [
                followup(suffix, "parent", 1),
                followup(suffix, "parent", 2, priority=4000),
            ],
        },
        priority=1500,
    )
    s.add(
        "failed-parent",
        "RecordedA",
        {"doWork": "fail-permanent", "followups": [followup(suffix, "failed-parent", 1)]},
    )
    s.add("corrupt", "RecordedA", {})
    bridge.corrupt_data(s.ids["corrupt"], '{"duration": 1,')
    s.ordinary = bridge.enqueue("RecordedC", {"after": "corrupt"}, count=20)
    s.add("long", "RecordedA", {"duration": LONG_TASK_SECONDS})

    queues = [bridge.default_queue]
    workers = [
        bridge.worker(f"worker-{n}", queues, concurrency=2, extra=("-P", pool)) for n in (1, 2)
    ]
    workers.append(bridge.worker("poller", [bridge.control_queue]))
    bridge.beat()
    bridge.wait_ready(*workers)
    yield s
    bridge.stop()  # before the next broker's bridge starts


def assert_waits(starts: list[dict], waits: list[float]) -> None:
    """Consecutive runs are apart by at least each wait, and not much more."""
    gaps = [b["time"] - a["time"] for a, b in pairwise(starts)]
    assert len(gaps) == len(waits), starts
    for gap, wait in zip(gaps, waits, strict=True):
        assert wait <= gap <= wait + LATENESS, f"gaps {gaps}, expected waits {waits}"


@pytest.mark.parametrize(
    ("name", "waits"),
    [
        ("declared-wait", [DECLARED_WAIT] * MAX_RETRIES),
        # RETRY_BASE * 2**failureCount, capped by RETRY_MAX
        ("default-wait", [1, 2]),
    ],
)
def test_temporary_failures_wait_then_end_as_result_1_after_the_maximum(scenario, name, waits):
    [row] = scenario.bridge.wait_archived([scenario.ids[name]], timeout=30).values()
    assert row.result == RESULT_FAILURE
    assert row.failureCount == MAX_RETRIES + 1
    starts = scenario.starts(name)
    assert [r["failureCount"] for r in starts] == list(range(MAX_RETRIES + 1))
    assert_waits(starts, waits)


def test_a_yield_comes_back_after_its_duration(scenario):
    task_id = scenario.ids["yield"]
    [row] = scenario.bridge.wait_archived([task_id], timeout=30).values()
    assert (row.result, row.failureCount) == (RESULT_SUCCESS, 0)
    first, second = scenario.starts("yield")
    # Yield(delay=YIELD_SECONDS) on the first run, raised to Phorge's minimum of 5 s.
    assert second["time"] >= first["time"] + 5
    gap = second["time"] - first["time"]
    assert gap <= 5 + LATENESS, f"the yield came back after {gap:.2f} s"


def test_followups_appear_only_after_success_exactly_once(scenario):
    bridge = scenario.bridge
    [parent] = bridge.wait_archived([scenario.ids["parent"]], timeout=30).values()
    assert parent.result == RESULT_SUCCESS and parent.failureCount == 1
    followups = scenario.followups("parent")
    # The failed first run queued nothing: each follow-up exists once, not twice.
    assert sorted(t.data["n"] for t in followups) == [1, 2]
    assert {t.data["n"]: t.priority for t in followups} == {1: 1500, 2: 4000}
    archived = bridge.wait_archived([t.id for t in followups], timeout=30)
    assert {row.result for row in archived.values()} == {RESULT_SUCCESS}
    [last_parent_run] = bridge.runs_of(parent.id, "end")
    for task in followups:
        [run] = bridge.runs_of(task.id)
        assert run["time"] >= last_parent_run["time"]

    [failed] = bridge.wait_archived([scenario.ids["failed-parent"]], timeout=30).values()
    assert failed.result == RESULT_FAILURE
    assert scenario.followups("failed-parent") == []


def test_corrupt_task_data_fails_permanently_and_the_workers_keep_serving(scenario):
    bridge = scenario.bridge
    task_id = scenario.ids["corrupt"]
    [row] = bridge.wait_archived([task_id], timeout=30).values()
    assert row.result == RESULT_FAILURE
    assert bridge.runs_of(task_id) == [], "the handler ran on corrupt data"
    assert f"task {task_id} failed permanently: the task's data row is not valid JSON" in (
        bridge.logs()
    )
    archived = bridge.wait_archived(scenario.ordinary, timeout=30)
    assert {row.result for row in archived.values()} == {RESULT_SUCCESS}


def test_the_heartbeat_keeps_a_task_longer_than_its_dispatch_lease(scenario):
    bridge = scenario.bridge
    task_id = scenario.ids["long"]
    [row] = bridge.wait_archived([task_id], timeout=30).values()
    assert row.result == RESULT_SUCCESS
    assert row.duration >= LONG_TASK_SECONDS * 1_000_000
    [run] = bridge.runs_of(task_id)
    # The lease it was archived under was renewed well past the dispatch lease.
    assert row.leaseExpires > run["time"] + DISPATCH_LEASE
