"""``list``, ``show``, ``stats --watch`` and ``enqueue --jsonl`` as an operator sees them,
on the embedded SQLite queue (the MariaDB runs are tests/integration/test_cli.py)."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from uuid import uuid4

import outcomes
import pytest
from click.testing import CliRunner, Result
from sqlalchemy import select, update

from bridge.cli import watch
from bridge.cli.main import main
from bridge.engine.reports import RunReport
from bridge.engine.tracing import TaskLogFilter, TaskTrace, new_traceparent, traced
from bridge.errors import TaskFailed
from bridge.queue import NewTask, Outcome, PhorgeQueue, TaskFilter
from bridge.queue.actions import OperatorActions
from bridge.queue.schema import lisk_counter
from bridge.queue.schema import worker_activetask as active

WORKER = "PhabricatorTestWorker"
Invoke = Callable[..., Result]


@pytest.fixture
def queue(sqlite_engine, monkeypatch) -> Iterator[PhorgeQueue]:
    """The queue ``phorge-bridge`` runs on: BRIDGE_DATABASE_URL and nothing else set."""
    url = sqlite_engine.url.render_as_string(hide_password=False)
    for name in os.environ:
        if name.startswith("BRIDGE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("BRIDGE_DATABASE_URL", url)
    queue = PhorgeQueue.from_url(url)
    yield queue
    queue.dispose()


@pytest.fixture
def cli(queue) -> Invoke:
    def invoke(*args: str, code: int = 0, input: str | None = None) -> Result:
        result = CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)
        assert result.exit_code == code, result.output
        return result

    return invoke


def celery_quote(line: str, outcome: Outcome) -> str:
    """Celery's own line about a ``bridge.execute`` message, which quotes its outcome."""
    if outcome in (Outcome.SUCCESS, Outcome.YIELD):
        return f"Task bridge.execute[{uuid4()}] succeeded in 0.01s: {line!r}"
    return f"Task bridge.execute[{uuid4()}] raised expected: {TaskFailed(line)!r}"


def run_log(path: Path, queue: PhorgeQueue, task_id: int, ran: RunReport) -> None:
    """Append the lines a worker logs for one run of ``task_id``, tagged as it tags them:
    the dispatch, the outcome, and Celery's own line quoting the outcome."""
    task = queue.get(task_id)
    assert task is not None
    logger = logging.getLogger("test_cli_tasks.worker")
    handler = logging.FileHandler(path)
    handler.addFilter(TaskLogFilter())
    logger.addHandler(handler)
    logger.propagate = False
    try:
        trace = TaskTrace(
            task.id, task.task_class, task.lease_owner or "bridge:1:1:h:1", new_traceparent()
        )
        with traced(trace):
            logger.warning("%s: dispatched to default", task.label)
            line = ran.describe(task.label)
            logger.warning("%s", line)
            logger.warning("%s", celery_quote(line, ran.outcome))
    finally:
        logger.removeHandler(handler)
        handler.close()


def _new(n: int) -> NewTask:
    return NewTask(WORKER, {"n": n})


def leased(queue: PhorgeQueue, task_id: int) -> str:
    [task] = queue.lease(1, 60, ids=[task_id])
    assert task.lease_owner is not None
    return task.lease_owner


def expire(queue: PhorgeQueue, task_id: int) -> None:
    """Let the task's lease run out, as time would."""
    with queue.engine.begin() as conn:
        conn.execute(update(active).where(active.c.id == task_id).values(leaseExpires=1))


def listed(cli: Invoke, *args: str) -> dict[int, dict]:
    rows = [json.loads(line) for line in cli("list", "--json", *args).stdout.splitlines()]
    return {row["id"]: row for row in rows}


# -- list --------------------------------------------------------------------------------


def test_list_names_an_archived_task_by_its_result(cli, queue):
    ok, broken, cancelled = (queue.enqueue(WORKER, {"n": n}) for n in range(3))
    assert outcomes.complete(queue, ok, leased(queue, ok), 1500)
    assert outcomes.fail_permanent(queue, broken, leased(queue, broken))
    cli("cancel", "--id", str(cancelled))
    rows = listed(cli)
    assert {i: (r["state"], r["result"], r["due"]) for i, r in rows.items()} == {
        ok: ("success", 0, None),
        broken: ("failed", 1, None),
        cancelled: ("cancelled", 2, None),
    }
    text = cli("list").stdout.splitlines()
    assert text[0].split() == ["TASK", "STATE", "PRIORITY", "FAILURES", "DUE", "REASON"]
    assert [line.split()[:2] for line in text[1:]] == [
        [f"{WORKER}#{cancelled}", "cancelled"],
        [f"{WORKER}#{broken}", "failed"],
        [f"{WORKER}#{ok}", "success"],
    ]


def test_a_task_whose_retry_wait_is_over_is_retry_due_not_a_crash(cli, queue):
    waiting, due_again, crashed, yielded = (queue.enqueue(WORKER, {"n": n}) for n in range(4))
    assert outcomes.fail_temporary(queue, waiting, leased(queue, waiting), 300)
    assert outcomes.fail_temporary(queue, due_again, leased(queue, due_again), -60)
    leased(queue, crashed)
    expire(queue, crashed)
    assert outcomes.yield_(queue, yielded, leased(queue, yielded), 3600)
    cli("awaken", str(yielded))
    rows = listed(cli)
    now = rows[waiting]["server_time"]
    assert {i: r["state"] for i, r in rows.items()} == {
        waiting: "waiting-to-retry",
        due_again: "retry-due",
        crashed: "lease-expired",
        yielded: "yield-ended",
    }
    assert 299 <= rows[waiting]["due"] - now <= 300
    assert rows[due_again]["due"] == rows[crashed]["due"] == now
    line = next(line for line in cli("list").stdout.splitlines() if f"#{waiting} " in line)
    assert "waiting-to-retry" in line and re.search(r" in (5 min|4 min 59 s)$", line)


def test_list_stops_at_50_by_default_and_says_more_match(cli, queue):
    queue.enqueue_many([_new(n) for n in range(51)])
    result = cli("list")
    assert len(result.stdout.splitlines()) == 1 + 50
    assert "more tasks match than --limit 50 shows" in result.stderr
    wider = cli("list", "--limit", "51")
    assert len(wider.stdout.splitlines()) == 1 + 51 and wider.stderr == ""


def test_list_reads_the_last_reason_from_the_log_and_the_data_verdict_without_one(
    cli, queue, tmp_path
):
    flaky, corrupt = queue.enqueue(WORKER, {"n": 1}), queue.enqueue(WORKER, {"n": 2})
    log = tmp_path / "worker.log"
    run_log(log, queue, flaky, RunReport(Outcome.FAILURE, "mail server down", 300))
    with queue.engine.begin() as conn:
        data_id = conn.execute(select(active.c.dataID).where(active.c.id == corrupt)).scalar_one()
        conn.exec_driver_sql("UPDATE worker_taskdata SET data = '{nope' WHERE id = ?", (data_id,))
    rows = listed(cli, "--log", str(log))
    assert rows[flaky]["reason"] == "failure: mail server down"
    assert rows[corrupt]["reason"].startswith("the task's data row is not valid JSON")
    assert listed(cli)[flaky]["reason"] is None  # without the log, the bridge knows none
    line = next(
        line for line in cli("list", "--log", str(log)).stdout.splitlines() if f"#{flaky} " in line
    )
    assert line.endswith("failure: mail server down")


# -- show --------------------------------------------------------------------------------


def test_show_tells_the_whole_story_of_one_task_from_its_row_and_its_runs(cli, queue, tmp_path):
    ids = queue.enqueue_many([_new(n) for n in range(10)])
    task_id, neighbour = ids[0], ids[9]  # ids 1 and 10: 10's lines are not 1's
    log = tmp_path / "worker.log"
    first = leased(queue, task_id)
    run_log(log, queue, task_id, RunReport(Outcome.FAILURE, "mail server down", -1))
    assert outcomes.fail_temporary(queue, task_id, first, -1)
    run_log(log, queue, neighbour, RunReport(Outcome.PERMANENT_FAILURE, "not me"))
    second = leased(queue, task_id)
    run_log(log, queue, task_id, RunReport(Outcome.PERMANENT_FAILURE, "bad address"))
    assert outcomes.fail_permanent(queue, task_id, second)

    told = json.loads(cli("show", "--id", str(task_id), "--log", str(log), "--json").stdout)
    assert (told["table"], told["state"], told["outcome"]) == (
        "worker_archivetask",
        "failed",
        "permanent failure (archived with result 1)",
    )
    assert told["data_bytes"] == len('{"n":0}') and told["data"] == {"n": 0}
    assert told["reason"] == "permanent-failure: bad address"
    assert [(run["owner"], run["outcome"], len(run["lines"])) for run in told["runs"]] == [
        (first, "failure: mail server down", 3),
        (second, "permanent-failure: bad address", 3),
    ]
    assert not any("not me" in line for run in told["runs"] for line in run["lines"])

    text = cli("show", "--id", str(task_id), "--log", str(log)).stdout
    assert text.startswith(f"{WORKER}#{task_id}: failed\n")
    assert "  data           7 bytes" in text
    assert "history: 2 run(s) in the logs" in text
    assert f"  run 2: owner {second}, permanent-failure: bad address" in text


def test_the_reason_is_the_bridges_outcome_line_not_celerys_quote_of_it(cli, queue, tmp_path):
    flaky, broken, waiting = (queue.enqueue(WORKER, {"n": n}) for n in range(3))
    log = tmp_path / "worker.log"
    # The outcome line names who ran the task ([native]), as a worker's does.
    failed = RunReport(Outcome.FAILURE, "mail server down", 300, implementation="native")
    run_log(log, queue, flaky, failed)
    refused = RunReport(Outcome.PERMANENT_FAILURE, "bad address", implementation="runner-fallback")
    run_log(log, queue, broken, refused)
    run_log(log, queue, waiting, RunReport(Outcome.YIELD, "import running", 60))
    quote = "raised expected: TaskFailed('PhabricatorTestWorker#1 [native]: failure: "
    assert quote in log.read_text()
    reasons = {i: row["reason"] for i, row in listed(cli, "--log", str(log)).items()}
    assert reasons == {
        flaky: "failure: mail server down",
        broken: "permanent-failure: bad address",
        waiting: "yield: import running",
    }
    text = cli("list", "--log", str(log)).stdout.splitlines()
    assert [line.split("  ")[-1] for line in text[1:]] == [
        "yield: import running",
        "permanent-failure: bad address",
        "failure: mail server down",
    ]
    shown = cli("show", "--id", str(broken), "--log", str(log)).stdout
    assert "  reason         permanent-failure: bad address\n" in shown
    assert re.search(r"\n  run 1: owner \S+, permanent-failure: bad address\n", shown)


def test_show_says_an_archived_task_holds_no_lease_and_an_active_one_when_its_runs_out(cli, queue):
    done, running = queue.enqueue(WORKER, {"n": 1}), queue.enqueue(WORKER, {"n": 2})
    assert outcomes.complete(queue, done, leased(queue, done), 1500)
    leased(queue, running)  # a 60 s lease
    archived = cli("show", "--id", str(done)).stdout
    assert "  lease expires  none (archived: the last run's lease ended with it)\n" in archived
    live = cli("show", "--id", str(running)).stdout
    assert re.search(r"\n  lease expires  \S+ \S+Z \(in (1 min|59 s)\)\n", live), live


def test_show_without_logs_says_where_the_history_comes_from(cli, queue):
    task_id = queue.enqueue(WORKER, {"n": 1})
    text = cli("show", "--id", str(task_id)).stdout
    assert "  outcome        none yet (still active)" in text
    assert "  due            now" in text
    assert "history: give the worker logs with --log FILE" in text


def test_show_names_a_task_that_does_not_exist(cli, queue):
    out = cli("show", "--id", "404", code=1).output
    assert "no task with id 404" in out and "Traceback" not in out


# -- stats --watch -----------------------------------------------------------------------


class DrainingClock:
    """Stands in for the watch's ``time``: each sleep passes the seconds asked for, and
    meanwhile the workers archive ``per_sleep`` of WORKER's tasks."""

    def __init__(self, queue: PhorgeQueue, per_sleep: int) -> None:
        self.now, self.queue, self.per_sleep = 1000.0, queue, per_sleep

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        OperatorActions(self.queue).cancel(TaskFilter(classes=[WORKER], limit=self.per_sleep))


def test_stats_watch_shows_the_drain_rate_and_an_eta_until_drained(cli, queue, monkeypatch):
    queue.enqueue_many([_new(n) for n in range(4)])
    queue.enqueue("Later", {}, delay_until=2_000_000_000)  # held back: no part of the backlog
    monkeypatch.setattr(watch, "time", DrainingClock(queue, per_sleep=2))
    lines = cli("stats", "--watch", "--interval", "5", "--count", "3").stdout.splitlines()
    assert [line.split("  ", 1)[1] for line in lines] == [
        "backlog 4 (delayed 1, queued 4)  rate: measuring",
        "backlog 2 (delayed 1, queued 2)  draining 0.4/s, ETA 5 s",
        "backlog 0 (delayed 1)  drained",
    ]


def test_stats_watch_json_has_a_line_per_refresh(cli, queue, monkeypatch):
    queue.enqueue_many([_new(n) for n in range(3)])
    monkeypatch.setattr(watch, "time", DrainingClock(queue, per_sleep=1))
    out = cli("stats", "--watch", "--json", "--interval", "2", "--count", "2").stdout
    samples = [json.loads(line) for line in out.splitlines()]
    assert [(s["backlog"], s["rate"], s["eta"]) for s in samples] == [
        (3, None, None),
        (2, 0.5, 4.0),
    ]


# -- enqueue --jsonl ---------------------------------------------------------------------


def test_enqueue_jsonl_queues_every_line_with_ids_from_lisk_counter(cli, queue):
    queue.enqueue(WORKER, {})  # id 1: the counter goes on from there
    lines = [
        json.dumps({"task_class": WORKER, "data": {"key": 7713765376809813936}}),
        "",
        json.dumps(
            {"task_class": "PhabricatorSearchWorker", "priority": 3500, "object_phid": "PHID-X"}
        ),
    ]
    out = cli("enqueue", "--jsonl", "-", "--priority", "1000", input="\n".join(lines) + "\n").stdout
    assert out.split() == ["2", "3"]
    tasks = {t.id: t for t in queue.list()}
    assert (tasks[2].data, tasks[2].priority) == ({"key": 7713765376809813936}, 1000)
    assert (tasks[3].task_class, tasks[3].priority, tasks[3].object_phid) == (
        "PhabricatorSearchWorker",
        3500,
        "PHID-X",
    )
    with queue.engine.connect() as conn:
        assert conn.execute(select(lisk_counter.c.counterValue)).scalar_one() == 3


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"data": 1}', "line 2: task_class is missing"),
        ('{"task_class": "X", "prio": 1}', "line 2: unknown field(s) prio"),
        ('{"task_class": "X", "priority": 0}', "line 2: priority must be a positive integer"),
        ("[1]", "line 2: expected a JSON object, got list"),
        ("{nope", "line 2: Expecting property name"),
    ],
)
def test_enqueue_jsonl_refuses_a_bad_line_and_writes_nothing(cli, queue, line, problem):
    good = json.dumps({"task_class": WORKER})
    out = cli("enqueue", "--jsonl", "-", input=f"{good}\n{line}\n", code=2).output
    assert problem in out
    assert queue.list() == []


def test_enqueue_wants_a_class_or_jsonl_but_not_both(cli, queue):
    assert "give either TASK_CLASS [DATA] or --jsonl FILE" in cli("enqueue", code=2).output
    both = cli("enqueue", WORKER, "--jsonl", "-", input="", code=2).output
    assert "give either" in both


class FillingClock(DrainingClock):
    """Each sleep, ``per_sleep`` new tasks arrive and none is run."""

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.queue.enqueue_many([_new(n) for n in range(self.per_sleep)])


def test_stats_watch_says_when_the_backlog_grows_instead(cli, queue, monkeypatch):
    queue.enqueue(WORKER, {})
    monkeypatch.setattr(watch, "time", FillingClock(queue, per_sleep=1))
    lines = cli("stats", "--watch", "--interval", "20", "--count", "3").stdout.splitlines()
    assert lines[-1].endswith("backlog 3 (queued 3)  growing 3.0/min")


class InterruptedClock(DrainingClock):
    def sleep(self, seconds: float) -> None:
        raise KeyboardInterrupt


def test_ctrl_c_stops_stats_watch_quietly(cli, queue, monkeypatch):
    monkeypatch.setattr(watch, "time", InterruptedClock(queue, per_sleep=0))
    result = cli("stats", "--watch")  # no --count: until Ctrl-C
    assert result.stdout.endswith("backlog 0  drained\n") and len(result.stdout.splitlines()) == 1
