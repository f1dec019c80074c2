"""The engine (``bridge.engine``) without Celery: importable anywhere, run with the
settings it is given, observable through its public hook."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from sqlalchemy import select

import bridge.engine
from bridge import Yield, handler
from bridge.assembly import build_runtime
from bridge.config import load_settings
from bridge.engine import batch, context, observers, poll, run
from bridge.engine.batch import Batch, run_task
from bridge.engine.context import Runtime
from bridge.engine.observers import RunObserver, observe
from bridge.engine.reports import RunReport
from bridge.handlers.api import TaskContext
from bridge.handlers.registry import Registry
from bridge.queue import Lease, Outcome, PhorgeQueue
from bridge.queue.model import Leased
from bridge.queue.schema import worker_activetask as active

HOSTILE = {
    "BRIDGE_POLL_INTERVAL": "abc",
    "BRIDGE_DATABASE_URL": "not a url",
    "BRIDGE_NO_SUCH_SETTING": "1",
}


def test_the_engine_imports_and_runs_in_a_hostile_environment_without_celery(tmp_path: Path):
    """Importing the engine reads no environment: a caller's own settings are enough."""
    program = textwrap.dedent(
        f"""
        import sys
        from bridge.engine import batch, context, poll, run, writes
        from bridge.assembly import build_runtime
        from bridge.config import load_settings
        assert "celery" not in sys.modules and "kombu" not in sys.modules, "Celery loaded"
        settings = load_settings({{"BRIDGE_DATABASE_URL": "sqlite:///{tmp_path}/q.db"}})
        rt = build_runtime(settings)
        rt.queue.enqueue("PhabricatorTestWorker", {{}})
        [task] = rt.queue.lease(1, 60)
        print(batch.run_task(rt, task.lease).outcome)
        assert "celery" not in sys.modules, "Celery loaded by a run"
        """
    )
    env = {**os.environ, **HOSTILE}
    done = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "success"


class Recorder(RunObserver):
    def __init__(self) -> None:
        self.events: list[tuple[str, int, str]] = []

    def run_started(self, lease: Lease) -> None:
        self.events.append(("started", lease.task_id, lease.owner))

    def run_ended(self, item: Leased, report: RunReport) -> None:
        self.events.append(("ended", item.id, report.outcome.value))


def test_an_observer_hears_each_run_start_and_end(tmp_path: Path):
    rt = build_runtime(load_settings({"BRIDGE_DATABASE_URL": f"sqlite:///{tmp_path}/q.db"}))
    ok = rt.queue.enqueue("PhabricatorTestWorker", {})
    failing = rt.queue.enqueue("PhabricatorTestWorker", {"doWork": "fail-permanent"})
    tasks = {t.id: t for t in rt.queue.lease(2, 60)}
    recorder = Recorder()
    remove = observe(recorder)
    try:
        assert run_task(rt, tasks[ok].lease).outcome is Outcome.SUCCESS
        assert run_task(rt, tasks[failing].lease).outcome is Outcome.PERMANENT_FAILURE
    finally:
        remove()
    assert recorder.events == [
        ("started", ok, tasks[ok].lease_owner),
        ("ended", ok, "success"),
        ("started", failing, tasks[failing].lease_owner),
        ("ended", failing, "permanent-failure"),
    ]
    again = rt.queue.enqueue("PhabricatorTestWorker", {})
    [task] = rt.queue.lease(1, 60, ids=[again])
    run_task(rt, task.lease)
    assert len(recorder.events) == 4, "a removed observer hears nothing"


def test_the_engines_seams_are_importable_from_it():
    """The names docs/architecture.md gives for running tasks without Celery."""
    from bridge.engine import (
        Batch,
        RunObserver,
        RunReport,
        Runtime,
        observe,
        open_runtime,
        poll_once,
        run_task,
    )

    assert (Batch, run_task, RunObserver, observe, RunReport) == (
        batch.Batch,
        batch.run_task,
        observers.RunObserver,
        observers.observe,
        run.RunReport,
    )
    assert (Runtime, open_runtime, poll_once) == (
        context.Runtime,
        context.open_runtime,
        poll.poll_once,
    )
    assert sorted(bridge.engine.__all__) == sorted(
        [
            "Batch",
            "RunObserver",
            "RunReport",
            "Runtime",
            "observe",
            "open_runtime",
            "poll_once",
            "run_task",
        ]
    )


@handler("ShortYield")
def yield_a_second(task: TaskContext) -> None:
    raise Yield(delay=1)


def test_a_short_yield_reports_the_5_s_it_is_held_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """The log line, Flower's result (that line) and the row agree: Phorge's floor."""
    settings = load_settings({"BRIDGE_DATABASE_URL": f"sqlite:///{tmp_path}/q.db"})
    queue = PhorgeQueue.from_url(settings.database_url)
    queue.create_tables()
    rt = Runtime(settings, queue, Registry([yield_a_second]))
    task_id = queue.enqueue("ShortYield", {})
    [task] = queue.lease(1, 60)
    ran_by = Batch(rt, task.lease_owner or "", None)
    with caplog.at_level(logging.INFO, logger="bridge.engine.batch"):
        ran_by.run([Leased(task_id, task.failure_count, "ShortYield")])
    [(_, ran, line)] = ran_by.reports
    assert (ran.outcome, ran.wait) == (Outcome.YIELD, 5)
    assert line == f"ShortYield#{task_id} [native]: yield (due again in 5 s)"
    # As logged (a worker's lines end with the task's tag, once Celery's hooks are in).
    assert any(message.startswith(line) for message in caplog.messages)
    with queue.engine.connect() as conn:
        expires = conn.execute(select(active.c.leaseExpires).where(active.c.id == task_id))
        assert int(expires.scalar_one() - time.time()) in (5, 4)
