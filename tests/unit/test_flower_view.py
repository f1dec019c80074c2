"""What Flower shows: the shipped config read as ``celery flower --conf`` reads it, polls
kept out of Celery's INFO lines, and a batch's result naming each task and message.
(tests/acceptance/test_flower.py runs Flower itself over real workers.)"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from celery import Celery
from celery.events.dispatcher import EventDispatcher
from flower.command import apply_options
from flower.options import options
from flower.views.tasks import visible_task_columns

from bridge.engine.reports import RunReport
from bridge.queue import Outcome
from bridge.queue.model import Leased
from bridge.runtime.dispatch import EXECUTE_BATCH, EXECUTE_TASK, Sent, ids_repr, search_term
from bridge.runtime.quiet_polls import QuietLines, QuietTask
from bridge.runtime.tasks import batch_summary

ROOT = Path(__file__).parents[2]
CONFIG = ROOT / "compose" / "flowerconfig.py"


@pytest.fixture
def flower_options() -> Iterator[None]:
    """Flower's options, as they were before the test."""
    saved = {name: getattr(options, name) for name in ("conf", "tasks_columns", "max_tasks")}
    yield
    for name, value in saved.items():
        setattr(options, name, value)


def test_the_shipped_config_shows_which_phorge_tasks_a_row_carried(flower_options):
    apply_options("celery", [f"--conf={CONFIG}"])
    shown = [name for name, _ in visible_task_columns(options.tasks_columns)]
    assert shown == options.tasks_columns.split(","), "every column is one Flower knows"
    assert {"args", "kwargs", "result", "exception"} <= set(shown)
    assert options.max_tasks == 50_000


def test_compose_and_the_operations_guide_start_flower_with_the_shipped_config():
    flower = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())["services"][
        "flower"
    ]
    [conf] = [arg.split("=", 1)[1] for arg in shlex.split(flower["command"]) if "--conf=" in arg]
    assert f"./{CONFIG.name}:{conf}:ro" in flower["volumes"]
    guide = (ROOT / "docs" / "monitoring.md").read_text()
    assert "celery -A bridge flower --conf=compose/flowerconfig.py" in guide


def test_a_task_is_searched_by_the_exact_pair_its_message_shows():
    tasks = [Leased(12, 0, "PhabricatorTestWorker"), Leased(120, 0, "PhabricatorTestWorker")]
    assert ids_repr(tasks) == "{12: 'PhabricatorTestWorker', 120: 'PhabricatorTestWorker'}"
    assert search_term(tasks[0]) == "kwargs:12=PhabricatorTestWorker"


def nothing() -> None:
    pass


def test_a_quiet_task_is_sent_without_the_task_sent_event_others_get(monkeypatch):
    published: list[tuple[str, str]] = []
    monkeypatch.setattr(
        EventDispatcher,
        "publish",
        lambda self, kind, fields, *args, **kwargs: published.append((kind, fields["name"])),
    )
    app = Celery(set_as_current=False, broker="memory://")
    app.conf.task_send_sent_event = True  # BRIDGE_TASK_EVENTS
    loud = app.task(name="loud")(nothing)
    quiet = app.task(name="quiet", base=QuietTask)(nothing)
    assert quiet.send_events is False  # nor does the worker send its events
    loud.apply_async()
    quiet.apply_async()
    assert published == [("task-sent", "loud")]


def celery_line(level: int, message: str, args: object) -> logging.LogRecord:
    record = logging.LogRecord("celery.app.trace", level, __file__, 1, message, None, None)
    record.args = args  # a mapping, as Celery passes it (LogRecord would unwrap a dict)
    return record


@pytest.mark.parametrize(
    ("level", "args", "shown"),
    [
        (logging.INFO, {"name": "bridge.poll", "id": "u"}, False),  # received, succeeded
        (logging.INFO, {"name": "bridge.execute", "id": "u"}, True),
        (logging.ERROR, {"name": "bridge.poll", "id": "u"}, True),  # a poll that failed
        (logging.DEBUG, {"name": "bridge.poll", "id": "u"}, True),
    ],
)
def test_only_celerys_info_lines_about_a_poll_are_dropped(level, args, shown):
    assert QuietLines().filter(celery_line(level, "Task %(name)s[%(id)s]", args)) is shown


@pytest.mark.parametrize(
    ("task", "shown"),
    [("bridge.poll", False), ("bridge.canary_guard", False), ("nightly.report", True)],
)
def test_beats_info_line_about_sending_a_poll_is_dropped(task, shown):
    line = celery_line(logging.INFO, "Scheduler: Sending due task %s (%s)", ("entry", task))
    assert QuietLines().filter(line) is shown


def test_a_batch_result_names_each_outcome_and_where_the_rest_went():
    a, b, c, d, e, f = (Leased(n, 0, "Worker") for n in (1, 2, 3, 4, 5, 6))
    ran = [
        (a, RunReport(Outcome.SUCCESS), ""),
        (b, RunReport(Outcome.YIELD, wait=5), ""),
        (c, RunReport(Outcome.SUCCESS), ""),
    ]
    sent = [Sent(EXECUTE_BATCH, "m1", [d, e])]
    assert batch_summary(ran, sent, [f]) == (
        "3 task(s): 2 success (#1, #3), 1 yield (#2); "
        f"2 sent on: {EXECUTE_BATCH}[m1] (#4, #5); 1 handed back (#6)"
    )
    assert batch_summary(ran[:1], [Sent(EXECUTE_TASK, "m2", [b])], []) == (
        f"1 task(s): 1 success (#1); 1 sent on: {EXECUTE_TASK}[m2] (#2)"
    )
