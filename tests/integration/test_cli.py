"""The operator CLI against MariaDB: bin/worker's actions, selectors and refusals."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from bridge.cli.main import main
from bridge.queue import PhorgeQueue
from bridge.queue.model import RESULT_CANCELLED, new_owner


@pytest.fixture
def cli(mysql_engine, monkeypatch):
    """Run ``phorge-bridge`` against the test database; returns (invoke, queue)."""
    url = mysql_engine.url.render_as_string(hide_password=False)
    for name in os.environ:
        if name.startswith("BRIDGE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("BRIDGE_DATABASE_URL", url)
    runner = CliRunner()

    def invoke(*args: str, code: int = 0) -> str:
        result = runner.invoke(main, list(args), catch_exceptions=False)
        assert result.exit_code == code, result.output
        return result.output

    return invoke, PhorgeQueue.from_url(url)


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
    out = invoke("cancel", "--id", str(task_id))
    assert f"PhabricatorTestWorker#{task_id}: cancelled" in out
    assert queue.get(task_id).result == RESULT_CANCELLED
    assert "ARCHIVED" in invoke("cancel", "--id", str(task_id))


def test_actions_refuse_to_run_without_a_selector(cli):
    invoke, queue = cli
    queue.enqueue("PhabricatorTestWorker", {})
    assert "select tasks" in invoke("cancel", code=2)
    assert queue.get(1).archived is False


def test_free_delay_priority_and_retry_follow_bin_worker(cli):
    invoke, queue = cli
    task_id = queue.enqueue("PhabricatorTestWorker", {})
    owner = new_owner()
    queue.lease(1, owner, 60)
    assert "LEASED" in invoke("delay", "--id", str(task_id), "--until", "2000000000")
    assert "1 task(s) freed" in invoke("free", "--id", str(task_id))
    assert "1 task(s) delayed" in invoke("delay", "--id", str(task_id), "--until", "2000000000")
    assert queue.get(task_id).leaseExpires == 2000000000
    assert "1 task(s) reprioritized" in invoke("priority", "--id", str(task_id), "--priority", "7")
    assert "UNCHANGED" in invoke("priority", "--id", str(task_id), "--priority", "7")
    assert "ACTIVE" in invoke("retry", "--id", str(task_id))
    invoke("cancel", "--id", str(task_id))
    assert "1 task(s) queued for retry" in invoke("retry", "--id", str(task_id))
    assert queue.get(task_id).state.value == "queued"


def test_stats_counts_per_class_and_state(cli):
    invoke, queue = cli
    queue.enqueue("A", {})
    queue.enqueue("A", {}, delay_until=2000000000)
    queue.enqueue("B", {})
    stats = json.loads(invoke("stats", "--json"))
    assert stats["by_class"] == {"A": {"queued": 1, "delayed": 1}, "B": {"queued": 1}}


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


def test_doctor_lists_served_classes_and_warns_about_running_taskmasters(cli, mysql_engine):
    invoke, queue = cli
    queue.enqueue("PhabricatorTestWorker", {})
    queue.enqueue("PhabricatorSearchWorker", {})
    out = invoke("doctor")
    assert "served by the bridge: PhabricatorTestWorker" in out
    assert "left to PHP (no handler, or excluded): PhabricatorSearchWorker" in out

    # Phorge's daemon log lives beside the worker database: {namespace}_daemon.
    daemon_db = mysql_engine.url.database.rsplit("_", 1)[0] + "_daemon"
    with mysql_engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE `{daemon_db}`")
    try:
        with mysql_engine.begin() as conn:
            conn.exec_driver_sql(
                f"CREATE TABLE `{daemon_db}`.daemon_log (daemon VARCHAR(255), status VARCHAR(8))"
            )
            conn.exec_driver_sql(
                f"INSERT INTO `{daemon_db}`.daemon_log VALUES"
                " ('PhabricatorTaskmasterDaemon', 'run'), ('PhabricatorTaskmasterDaemon', 'exit'),"
                " ('PhabricatorTriggerDaemon', 'run')"
            )
        assert "warning: 1 PHP taskmaster(s) are running" in invoke("doctor")
    finally:
        with mysql_engine.begin() as conn:
            conn.exec_driver_sql(f"DROP DATABASE `{daemon_db}`")
