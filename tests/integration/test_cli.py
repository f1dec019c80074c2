"""The operator CLI against MariaDB: bin/worker's actions, selectors and refusals."""

from __future__ import annotations

import json

import outcomes
import pytest
from services import url_of

from bridge.queue import PhorgeQueue
from bridge.queue.beat_lock import BeatLock, beat_lock_holder
from bridge.queue.model import RESULT_CANCELLED, TaskFilter


@pytest.fixture
def cli(cli_invoke, mysql_engine):
    """Run ``phorge-bridge`` against the test database; returns (invoke, queue)."""
    return cli_invoke, PhorgeQueue.from_url(url_of(mysql_engine))


def test_enqueue_then_list_shows_the_task_with_its_data(cli):
    invoke, _ = cli
    task_id = int(
        invoke(
            "enqueue", "PhabricatorTestWorker", '{"key": 7713765376809813936}', "--priority", "1000"
        )
    )
    rows = [
        json.loads(line) for line in invoke("list", "--id", str(task_id), "--json").splitlines()
    ]
    assert [(r["id"], r["state"], r["priority"], r["data"]) for r in rows] == [
        (task_id, "queued", 1000, {"key": 7713765376809813936})
    ]


def test_enqueue_refuses_bad_input_without_writing(cli):
    invoke, queue = cli
    assert "priority must be a positive integer" in invoke(
        "enqueue", "PhabricatorTestWorker", "{}", "--priority", "0", code=2
    )
    assert "JSON" in invoke("enqueue", "PhabricatorTestWorker", "{not json", code=2)
    assert queue.list() == []


def test_cancel_archives_as_cancelled_and_refuses_archived_tasks(cli):
    invoke, queue = cli
    task_id = queue.enqueue("PhabricatorTestWorker", {})
    out = invoke("cancel", "--id", str(task_id), "--verbose")
    assert out.splitlines() == [
        f"PhabricatorTestWorker#{task_id}: cancelled",
        "1 task(s) cancelled.",
    ]
    assert queue.get(task_id).result == RESULT_CANCELLED
    assert invoke("cancel", "--id", str(task_id)).splitlines() == [
        "0 task(s) cancelled.",
        "1 task(s) not cancelled: ARCHIVED: already archived, and can not be cancelled "
        f"(PhabricatorTestWorker#{task_id})",
    ]


def test_actions_refuse_to_run_without_a_selector(cli):
    invoke, queue = cli
    queue.enqueue("PhabricatorTestWorker", {})
    assert "select tasks" in invoke("cancel", code=2)
    assert queue.get(1).archived is False


def test_free_delay_priority_and_retry_follow_bin_worker(cli):
    invoke, queue = cli
    task_id = queue.enqueue("PhabricatorTestWorker", {})
    queue.lease(1, 60)
    assert "LEASED" in invoke("delay", "--id", str(task_id), "--until", "2000000000")
    assert "1 task(s) freed" in invoke("free", "--id", str(task_id))
    assert "1 task(s) delayed" in invoke("delay", "--id", str(task_id), "--until", "2000000000")
    assert queue.get(task_id).lease_expires == 2000000000
    assert "1 task(s) reprioritized" in invoke("priority", "--id", str(task_id), "--priority", "7")
    assert "UNCHANGED" in invoke("priority", "--id", str(task_id), "--priority", "7")
    assert "ACTIVE" in invoke("retry", "--id", str(task_id))
    invoke("cancel", "--id", str(task_id))
    assert "1 task(s) queued for retry" in invoke("retry", "--id", str(task_id))
    assert queue.get(task_id).state.value == "queued"


def test_list_shows_each_result_due_time_and_waiting_to_retry_on_mariadb(cli):
    invoke, queue = cli
    ok = queue.enqueue("PhabricatorTestWorker", {})
    flaky = queue.enqueue("PhabricatorTestWorker", {"doWork": "fail-temporary"})
    broken = queue.enqueue("PhabricatorTestWorker", {"doWork": "fail-permanent"})
    invoke("execute", "--id", str(ok), "--id", str(flaky), "--id", str(broken), code=1)
    rows = {row["id"]: row for row in map(json.loads, invoke("list", "--json").splitlines())}
    assert {i: row["state"] for i, row in rows.items()} == {
        ok: "success",
        flaky: "waiting-to-retry",
        broken: "failed",
    }
    assert rows[flaky]["due"] - rows[flaky]["failure_time"] == 300
    text = invoke("show", "--id", str(broken))
    assert text.startswith(f"PhabricatorTestWorker#{broken}: failed\n")
    assert "  outcome        permanent failure (archived with result 1)" in text


def test_a_missing_table_on_mariadb_is_one_line_naming_the_setting(
    cli, make_mysql_database, monkeypatch
):
    invoke, _ = cli
    empty = make_mysql_database(create_tables=False)
    monkeypatch.setenv("BRIDGE_DATABASE_URL", empty.url.render_as_string(hide_password=False))
    for command in (["list"], ["stats"], ["enqueue", "X"], ["retry", "--class", "X"]):
        [line] = invoke(*command, code=1).splitlines()
        assert line.startswith("Error: database error: ") and "doesn't exist" in line
        assert "check BRIDGE_DATABASE_URL (mysql+mysqldb://" in line


def test_stats_counts_per_class_and_state(cli):
    invoke, queue = cli
    queue.enqueue("A", {})
    queue.enqueue("A", {}, delay_until=2000000000)
    queue.enqueue("B", {})
    stats = json.loads(invoke("stats", "--json"))
    assert stats["by_class"] == {"A": {"queued": 1, "delayed": 1}, "B": {"queued": 1}}


NO_BEAT = (
    "no beat holds the beat lock, so no poll is sent: start `celery -A bridge beat` "
    "(or a worker with -B); a second one on another host stands by"
)


def test_stats_says_whether_a_beat_sends_the_polls(cli, mysql_engine):
    invoke, queue = cli
    queue.enqueue("PhabricatorTestWorker", {})
    lines = invoke("stats").splitlines()
    assert lines[1].startswith("oldest queued task: ") and lines[2] == f"beat: {NO_BEAT}", lines
    assert json.loads(invoke("stats", "--json"))["beat"] == {"status": "fail", "detail": NO_BEAT}
    lock = BeatLock(mysql_engine, "bridge")
    try:
        assert lock.held()
        holder = beat_lock_holder(mysql_engine, "bridge")
        sending = f"a beat sends the polls (database connection {holder})"
        assert f"beat: {sending}" in invoke("stats").splitlines()
        assert json.loads(invoke("stats", "--json"))["beat"] == {"status": "ok", "detail": sending}
    finally:
        lock.close()


def test_stats_presents_the_control_queue_as_the_polls_it_carries(cli):
    invoke, queue = cli
    queue.enqueue("PhabricatorTestWorker", {})
    queues = [line for line in invoke("stats").splitlines() if line.startswith("queue ")]
    assert [line.split(", consumed by ")[0] for line in queues] == [
        "queue bridge.control: polls (needed while any task is due)",
        "queue phorge: 1 due",
    ]


def test_a_bad_setting_stops_the_cli_with_its_name(cli, monkeypatch):
    invoke, _ = cli
    monkeypatch.setenv("BRIDGE_POLL_INTERVAL", "-1")
    assert "BRIDGE_POLL_INTERVAL" in invoke("stats", code=1)


def test_settings_hides_secrets(cli, monkeypatch, tmp_path):
    invoke, _ = cli
    monkeypatch.setenv("BRIDGE_CONDUIT_URL", "https://phorge.example")
    monkeypatch.setenv("BRIDGE_CONDUIT_TOKEN", "api-" + "s" * 28)
    out = invoke("settings")
    assert "api-" + "s" * 28 not in out
    assert "BRIDGE_CONDUIT_TOKEN=(set, hidden)" in out
    assert "bridge:" not in out.split("BRIDGE_DATABASE_URL=")[1].split("\n")[0]


# -- execute (bin/worker execute) -----------------------------------------------------------


def outcome_lines(out: str) -> list[str]:
    """``execute``'s lines without the trace context each one ends with."""
    return [line.split(" [traceparent=00-")[0] for line in out.splitlines()]


def test_execute_runs_tasks_now_in_the_order_given_and_writes_their_outcomes(cli):
    invoke, queue = cli
    ok = queue.enqueue("PhabricatorTestWorker", {})
    flaky = queue.enqueue("PhabricatorTestWorker", {"doWork": "fail-temporary"})
    broken = queue.enqueue("PhabricatorTestWorker", {"doWork": "fail-permanent"})
    out = invoke("execute", "--id", str(flaky), "--id", str(ok), "--id", str(broken), code=1)
    assert outcome_lines(out) == [
        f"PhabricatorTestWorker#{flaky} [native]: failure: Temporary failure! (due again in 300 s)",
        f"PhabricatorTestWorker#{ok} [native]: success",
        f"PhabricatorTestWorker#{broken} [native]: permanent-failure: Permanent failure!",
    ]
    states = {t.id: (t.state.value, t.result, t.failure_count) for t in queue.list()}
    assert states == {
        ok: ("archived", 0, 0),
        flaky: ("waiting-to-retry", None, 1),
        broken: ("archived", 1, 0),
    }
    # Waiting to retry does not stop an operator: it runs again at once.
    assert "failure: Temporary failure!" in invoke("execute", "--id", str(flaky), code=1)
    assert queue.get(flaky).failure_count == 2


def test_execute_refuses_archived_tasks_unless_retried_and_successes_unless_repeated(cli):
    invoke, queue = cli
    task_id = queue.enqueue("PhabricatorTestWorker", {})
    invoke("execute", "--id", str(task_id))
    assert "ARCHIVED: already archived" in invoke("execute", "--id", str(task_id))
    assert "SUCCEEDED: already succeeded" in invoke("execute", "--id", str(task_id), "--retry")
    out = invoke("execute", "--id", str(task_id), "--retry", "--repeat")
    assert out.startswith(f"PhabricatorTestWorker#{task_id} [native]: success")
    assert len(queue.list(TaskFilter(ids=[task_id]))) == 1


def test_execute_runs_delayed_and_yielded_tasks_but_not_one_a_worker_holds(cli):
    invoke, queue = cli
    delayed = queue.enqueue("PhabricatorTestWorker", {}, delay_until=queue.server_time() + 3600)
    yielded = queue.enqueue("PhabricatorTestWorker", {})
    held = queue.enqueue("PhabricatorTestWorker", {})
    [leased] = queue.lease(1, ids=[yielded])
    assert outcomes.yield_(queue, yielded, leased.lease_owner, 3600)
    [worker_lease] = queue.lease(1, ids=[held])
    worker = worker_lease.lease_owner
    out = invoke("execute", "--class", "PhabricatorTestWorker", code=1)
    assert outcome_lines(out)[:2] == [
        f"PhabricatorTestWorker#{delayed} [native]: success",
        f"PhabricatorTestWorker#{yielded} [native]: success",
    ]
    assert f"PhabricatorTestWorker#{held}: LEASED: a worker holds its lease ({worker})" in out
    assert queue.get(held).lease_owner == worker


def test_execute_names_an_id_that_matches_nothing(cli):
    invoke, queue = cli
    queue.enqueue("PhabricatorTestWorker", {})
    out = invoke("execute", "--id", "99", code=2)
    assert 'No task with ID "99" matches the constraints!' in out
    assert "select tasks" in invoke("execute", code=2)
