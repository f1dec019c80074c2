"""What every ``phorge-bridge`` command shares, as an operator sees it: one line for a
database or broker error, summaries of bulk actions, plain help texts, settings as JSON,
shell completion (on SQLite; the MariaDB runs are tests/integration/test_cli.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import click
import outcomes
import pytest
from click.testing import CliRunner, Result

from bridge._version import __version__
from bridge.cli.main import main
from bridge.queue import NewTask, PhorgeQueue

WORKER = "PhabricatorTestWorker"
# A database that refuses connections: nothing listens on port 1.
REFUSED_MYSQL = "mysql+mysqldb://bridge:secret@127.0.0.1:1/phabricator_worker"
REFUSED_AMQP = "amqp://guest:secret@127.0.0.1:1//"


@pytest.fixture
def environment(monkeypatch):
    """No BRIDGE_* setting but those a test sets."""
    for name in os.environ:
        if name.startswith("BRIDGE_"):
            monkeypatch.delenv(name)
    return monkeypatch


def invoke(*args: str, code: int = 0, **kwargs) -> Result:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False, **kwargs)
    assert result.exit_code == code, result.output
    return result


@pytest.fixture
def queue(sqlite_engine, environment):
    url = sqlite_engine.url.render_as_string(hide_password=False)
    environment.setenv("BRIDGE_DATABASE_URL", url)
    queue = PhorgeQueue.from_url(url)
    yield queue
    queue.dispose()


# -- database and broker errors: one line naming the setting, exit 1 -----------------------

EVERY_DATABASE_COMMAND = [
    ("list",),
    ("show", "--id", "1"),
    ("stats",),
    ("stats", "--watch", "--count", "1"),
    ("enqueue", WORKER),
    ("enqueue", "--jsonl", "-"),
    ("cancel", "--id", "1"),
    ("free", "--id", "1"),
    ("retry", "--id", "1"),
    ("delay", "--id", "1", "--until", "2000000000"),
    ("priority", "--id", "1", "--priority", "5"),
    ("awaken", "1"),
]


def assert_one_line(result: Result, *words: str) -> None:
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    for word in words:
        assert word in lines[0]


@pytest.mark.parametrize("args", EVERY_DATABASE_COMMAND, ids=" ".join)
def test_a_missing_table_is_one_line_naming_the_setting(args, environment, tmp_path):
    environment.setenv("BRIDGE_DATABASE_URL", f"sqlite:///{tmp_path / 'empty.db'}")
    result = CliRunner().invoke(main, list(args), input='{"task_class": "X"}\n')
    assert_one_line(result, "BRIDGE_DATABASE_URL", "no such table", "create-tables")


@pytest.mark.parametrize("args", EVERY_DATABASE_COMMAND, ids=" ".join)
def test_a_refused_connection_is_one_line_naming_the_setting(args, environment):
    environment.setenv("BRIDGE_DATABASE_URL", REFUSED_MYSQL)
    result = CliRunner().invoke(main, list(args), input='{"task_class": "X"}\n')
    assert_one_line(result, "BRIDGE_DATABASE_URL", "Can't connect", "bridge:***@127.0.0.1:1")
    assert "secret" not in result.output


def test_an_unreachable_broker_is_named_after_what_the_database_says(queue):
    queue.enqueue(WORKER, {})
    # A process of its own: the Celery app reads BRIDGE_BROKER_URL once, as it is built.
    environ = {**os.environ, "BRIDGE_BROKER_URL": REFUSED_AMQP}
    command = [sys.executable, "-m", "bridge.cli", "stats"]
    ran = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 1, ran.stderr
    assert ran.stdout.splitlines()[0] == f"{WORKER}: queued 1"
    [error] = ran.stderr.splitlines()
    assert error.startswith("Error: queue consumers unknown: broker error: ")
    assert "check BRIDGE_BROKER_URL (amqp://guest:**@127.0.0.1:1//)" in error


# -- bulk actions: a summary, counts by result ---------------------------------------------


def test_a_bulk_action_prints_counts_by_result_not_a_line_per_task(queue):
    ids = queue.enqueue_many([NewTask(WORKER, {"n": n}) for n in range(6)])
    for task_id in ids[:5]:
        [task] = queue.lease(1, 60, ids=[task_id])
        assert outcomes.complete(queue, task_id, task.lease_owner, 10)
    assert outcomes.fail_permanent(queue, ids[5], queue.lease(1, 60, ids=[ids[5]])[0].lease_owner)
    out = invoke("retry", "--class", WORKER, "--archived").stdout
    assert out.splitlines() == [
        "1 task(s) queued for retry.",
        "5 task(s) not queued for retry: SUCCEEDED: already succeeded; use --repeat to run it "
        f"again ({WORKER}#5, {WORKER}#4, {WORKER}#3 and 2 more)",
    ]
    verbose = invoke("cancel", "--class", WORKER, "--active", "--verbose").stdout.splitlines()
    assert verbose == [f"{WORKER}#6: cancelled", "1 task(s) cancelled."]


def test_awaken_takes_selectors_and_counts_what_it_left(queue):
    yielded, queued = queue.enqueue(WORKER, {}), queue.enqueue(WORKER, {})
    [task] = queue.lease(1, 60, ids=[yielded])
    assert outcomes.yield_(queue, yielded, task.lease_owner, 3600)
    assert invoke("awaken", "--class", WORKER).stdout.splitlines() == [
        "1 task(s) awakened.",
        "1 task(s) not awakened: not yielded, or failed before",
    ]
    assert queue.get(yielded).state.value == "yield-ended"
    assert queue.get(queued).state.value == "queued"
    assert "give task IDS" in invoke("awaken", code=2).output


# -- help, version, settings, completion ---------------------------------------------------


def every_command(group: click.Group, path: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        yield (*path, name)
        if isinstance(command, click.Group):
            yield from every_command(command, (*path, name))


@pytest.mark.parametrize("path", [(), *every_command(main)], ids=" ".join)
def test_every_help_text_reads_as_plain_text(path):
    text = invoke(*path, "--help").stdout
    for markup in ("``", ":class:", ":meth:", ":func:", "use repeat"):
        assert markup not in text


def test_help_texts_name_the_options_an_operator_types():
    assert "--repeat" in invoke("retry", "--help").stdout
    assert "--until" in invoke("delay", "--help").stdout.split("Options:")[0]
    assert "[default: 50]" in " ".join(invoke("list", "--help").stdout.split())


def test_version():
    assert invoke("--version").stdout == f"phorge-bridge, version {__version__}\n"


def test_settings_json_gives_each_value_and_whether_it_is_the_default(queue, environment):
    environment.setenv("BRIDGE_CONDUIT_URL", "https://phorge.example")
    environment.setenv("BRIDGE_CONDUIT_TOKEN", "api-" + "s" * 28)
    shown = json.loads(invoke("settings", "--json").stdout)
    assert shown["BRIDGE_CONDUIT_TOKEN"] == {"value": "(set, hidden)", "default": False}
    assert shown["BRIDGE_POLL_INTERVAL"] == {"value": "0.25", "default": True}
    assert shown["BRIDGE_DATABASE_URL"]["value"].startswith("sqlite:///")
    text = invoke("settings").stdout
    assert "BRIDGE_POLL_INTERVAL=0.25 (default)" in text.splitlines()


def test_shell_completion_works_as_the_readme_says(environment):
    script = invoke(
        prog_name="phorge-bridge", env={"_PHORGE_BRIDGE_COMPLETE": "bash_source"}
    ).stdout
    assert "_phorge_bridge_completion()" in script
    words = invoke(
        prog_name="phorge-bridge",
        env={
            "_PHORGE_BRIDGE_COMPLETE": "bash_complete",
            "COMP_WORDS": "phorge-bridge sh",
            "COMP_CWORD": "1",
        },
    ).stdout
    assert "plain,show" in words.splitlines()
