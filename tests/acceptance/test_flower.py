"""Flower started as docs/monitoring.md says, over real workers and beat: it shows Phorge's
tasks and only them, finds each by its id alone, a yield leads to its next run, and its
counts are Phorge's: a temporary failure is Retried, not Failed, and a failure's
traceback is the handler's.

Flower is queried through the endpoint its task list reads (``/tasks/datatable``), so a
search here is what an operator's search box returns. Task events are on from the start
(``BRIDGE_TASK_EVENTS``), beat's task-sent events included.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from bridge_harness import Bridge, CeleryProcess, deployments
from prometheus_client.parser import text_string_to_metric_families

from bridge.queue.model import RESULT_FAILURE, RESULT_SUCCESS

ROOT = Path(__file__).resolve().parents[2]
FLOWER_CONFIG = ROOT / "compose" / "flowerconfig.py"
TASK_CLASS = "RecordedA"
BACKLOG = 130  # ids 2-131 beside the first task's 1: #12 beside #120-#129
METRICS_PORTS = "19500-19599"  # the worker serves on the first free one, and logs it
# Flower's counts of a worker's task events, as its Workers page shows them.
COUNTS = {"succeeded": "task-succeeded", "failed": "task-failed", "retried": "task-retried"}


class FlowerBridge(Bridge):
    def flower(self) -> CeleryProcess:
        """``celery -A bridge flower --conf=compose/flowerconfig.py``, docs/monitoring.md's, on a
        port of the system's choosing."""
        return self._start(
            "flower", ["flower", f"--conf={FLOWER_CONFIG}", "--address=127.0.0.1", "--port=0"]
        )


def logged_address(process: CeleryProcess, pattern: str) -> str | None:
    found = re.search(pattern, process.log())
    return found and found.group(1)


@dataclass
class Flower:
    url: str

    def rows(self, query: str = "") -> list[dict]:
        """The task list's rows for ``query``, as Flower's search box gets them."""
        params = {
            "draw": 1,
            "start": 0,
            "length": 10_000,
            "search[value]": query,
            "order[0][column]": 0,
            "order[0][dir]": "asc",
            "columns[0][data]": "received",
        }
        reply = requests.get(f"{self.url}/tasks/datatable", params=params, timeout=10)
        reply.raise_for_status()
        return reply.json()["data"]

    def counts(self) -> dict[str, int]:
        """The Workers page's Succeeded, Failed and Retried, summed over the workers."""
        reply = requests.get(f"{self.url}/workers", params={"json": 1}, timeout=10)
        reply.raise_for_status()
        workers = reply.json()["data"]
        return {name: sum(w.get(event, 0) for w in workers) for name, event in COUNTS.items()}

    def up(self) -> bool:
        try:
            return requests.get(f"{self.url}/healthcheck", timeout=2).ok
        except requests.ConnectionError:
            return False


@dataclass
class Deployment:
    bridge: FlowerBridge
    flower: Flower
    worker: CeleryProcess
    metrics_url: str

    def ran(self, ids: list[int]) -> list[dict]:
        """Once each task of ``ids`` has run to its end, Flower's rows (every one)."""
        self.bridge.wait_archived(ids)

        def shown() -> list[dict] | None:
            rows = self.flower.rows()
            done = [row for row in rows if row["state"] == "SUCCESS"]
            return rows if set(ids) <= {i for row in done for i in carried(row)} else None

        return self.bridge.wait_until(shown, 30, f"Flower to show {len(ids)} task(s) done")


def carried(row: dict) -> list[int]:
    """The Phorge task ids a row's message carried, read off its args' labels."""
    return [int(label.split("#")[1]) for label in ast.literal_eval(row["args"])]


@pytest.fixture
def deployment(tmp_path, database_url, amqp_url) -> Iterator[Deployment]:
    with deployments(tmp_path, FlowerBridge) as make:
        bridge = make(database_url, amqp_url, TASK_EVENTS="true", METRICS_PORT=METRICS_PORTS)
        process = bridge.flower()
        address = bridge.wait_until(
            lambda: logged_address(process, r"Visit me at (http://[\d.:]+)"), 30, "Flower's port"
        )
        flower = Flower(address)
        bridge.wait_until(flower.up, 30, "Flower to answer")
        worker = bridge.worker(
            "worker", [bridge.default_queue, bridge.control_queue], concurrency=2
        )
        bridge.beat()
        bridge.wait_ready(worker)
        metrics = bridge.wait_until(
            lambda: logged_address(worker, r"metrics on ([\d.]+:\d+)"), 30, "the metrics port"
        )
        found = Deployment(bridge, flower, worker, f"http://{metrics}/metrics")
        # Flower misses what ran before it listened: one task shown means it listens.
        found.ran(bridge.enqueue(TASK_CLASS))
        yield found


def test_flower_shows_each_phorge_task_once_found_by_its_id_and_no_poll(deployment):
    bridge, flower = deployment.bridge, deployment.flower
    ids = [1, *bridge.enqueue(TASK_CLASS, count=BACKLOG)]
    assert ids == list(range(1, BACKLOG + 2))
    rows = deployment.ran(ids)

    assert {row["name"] for row in rows} <= {"bridge.execute", "bridge.execute_batch"}
    assert sorted(i for row in rows for i in carried(row)) == ids, "each task in one message"
    for task_id in (1, 12, 13):
        found = flower.rows(f"kwargs:{task_id}={TASK_CLASS}")
        assert [carried(row) for row in found] == [
            carried(row) for row in rows if task_id in carried(row)
        ]
    # What the pair replaces: the label as a substring also finds #120-#129.
    assert len(flower.rows(f"{TASK_CLASS}#12")) > 1

    # The polls ran, and are counted, but neither Flower nor the worker's INFO lines show them.
    polls = {
        sample.name: sample.value
        for family in text_string_to_metric_families(requests.get(deployment.metrics_url).text)
        for sample in family.samples
    }["phorge_bridge_poll_duration_seconds_count"]
    assert polls > 1
    assert flower.rows("bridge.poll") == []
    assert "bridge.poll[" not in deployment.worker.log()
    assert f"Task bridge.execute[{rows[0]['uuid']}] received" in deployment.worker.log()

    # The task list shows which Phorge tasks a row carried, and how they ended.
    page = requests.get(f"{flower.url}/tasks", timeout=10).text
    for column in ("args", "kwargs", "result", "exception"):
        assert f'<th data-column="{column}">' in page


def test_a_yield_is_done_in_flower_and_its_result_finds_its_next_run(deployment):
    bridge, flower = deployment.bridge, deployment.flower
    [task_id] = bridge.enqueue(TASK_CLASS, {"yieldFirst": 1})
    query = f"kwargs:{task_id}={TASK_CLASS}"
    deployment.ran([task_id])

    def both_runs() -> list[dict] | None:
        found = flower.rows(query)
        return found if len(found) == 2 and all(r["state"] == "SUCCESS" for r in found) else None

    yielded, next_run = bridge.wait_until(both_runs, 30, "the yield and its next run")
    assert next_run["result"] == f"'{TASK_CLASS}#{task_id} [native]: success'"
    assert yielded["uuid"] != next_run["uuid"]
    result = ast.literal_eval(yielded["result"])
    # A 1 s yield lasts Phorge's 5 s, and its result says so, as the row does.
    assert result.startswith(f"{TASK_CLASS}#{task_id} [native]: yield (due again in 5 s); ")
    # The query the yield's result names is the one that found both.
    assert result.endswith(f"search {query}")


def phorges_counts(bridge: FlowerBridge) -> dict[str, int]:
    """What Phorge's archive says: tasks succeeded and failed, and the temporary failures
    counted on the way (``failureCount``)."""
    rows = bridge.archived().values()
    return {
        "succeeded": sum(row.result == RESULT_SUCCESS for row in rows),
        "failed": sum(row.result == RESULT_FAILURE for row in rows),
        "retried": sum(row.failureCount for row in rows),
    }


def test_flowers_counts_are_phorges_and_a_failure_shows_the_handlers_traceback(deployment):
    bridge, flower = deployment.bridge, deployment.flower
    now = {"getWaitBeforeRetry": 0}
    ids = [
        *bridge.enqueue(TASK_CLASS, count=4),
        *(flaky := bridge.enqueue(TASK_CLASS, {"failTimes": 2, **now}, count=3)),
        *(refused := bridge.enqueue(TASK_CLASS, {"doWork": "fail-permanent"}, count=2)),
        # Two temporary failures, then the maximum retry count fails it for good.
        *bridge.enqueue(TASK_CLASS, {"doWork": "fail-temporary", "getMaximumRetryCount": 1, **now}),
    ]
    bridge.wait_archived(ids)
    expected = phorges_counts(bridge)
    assert expected == {"succeeded": 8, "failed": 3, "retried": 8}  # the fixture's task too

    bridge.wait_until(
        lambda: sum(flower.counts().values()) >= sum(expected.values()),
        30,
        "Flower to count every message",
    )
    assert flower.counts() == expected

    [retried, *_] = [r for r in flower.rows(f"kwargs:{flaky[0]}={TASK_CLASS}") if r["retried"]]
    assert retried["state"] == "RETRY"
    reason = (
        f"{TASK_CLASS}#{flaky[0]} [native]: failure: failing on purpose (1 of 2) (due again in 0 s)"
    )
    assert retried["exception"] == f"TaskFailed({reason!r})"
    assert "in fail_on_purpose" in retried["traceback"]
    assert "RuntimeError: failing on purpose (1 of 2)" in retried["traceback"]
    [failed] = flower.rows(f"kwargs:{refused[0]}={TASK_CLASS}")
    assert failed["state"] == "FAILURE"
    assert "PermanentFailure: Permanent failure!" in failed["traceback"]
    assert 'phabricator.py", line' in failed["traceback"]  # PhabricatorTestWorker.run
    # Celery logs each in one line, without a traceback, the reason as Flower shows it.
    log = deployment.worker.log()
    assert f"] retry: {reason} [task={flaky[0]} " in log
    assert "Traceback" not in log
