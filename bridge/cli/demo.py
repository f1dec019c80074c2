"""The embedded first run: Phorge's tables in SQLite, a server-less broker, one worker with beat.

Nothing to install or start: the same code as production, pointed at files. A handful
of ``PhabricatorTestWorker`` tasks show every outcome, and a summary says what happened.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge.queue import PhorgeQueue
from bridge.queue.model import RESULT_CANCELLED, RESULT_FAILURE, RESULT_SUCCESS, Task

TEST_WORKER = "PhabricatorTestWorker"


@dataclass(frozen=True)
class Sample:
    what: str
    data: dict[str, Any]


def samples(now: float) -> list[Sample]:
    return [
        Sample("succeeds", {}),
        Sample("succeeds after 1 s of work", {"duration": 1}),
        Sample(
            "succeeds and queues a follow-up",
            {"followups": [{"taskClass": TEST_WORKER, "data": {"parent": "follow-up"}}]},
        ),
        Sample(
            "fails, is retried twice, then fails for good",
            {"doWork": "fail-temporary", "getWaitBeforeRetry": 1, "getMaximumRetryCount": 2},
        ),
        Sample("yields for 5 s, then succeeds", {"doWork": "yield", "yieldUntil": int(now) + 3}),
        Sample("fails permanently", {"doWork": "fail-permanent"}),
    ]


def environment(directory: Path) -> dict[str, str]:
    """The settings of the embedded run: two files in ``directory``, fast polling."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BRIDGE_")}
    env.update(
        BRIDGE_DATABASE_URL=f"sqlite:///{directory / 'phorge-worker.db'}",
        BRIDGE_BROKER_URL=f"sqla+sqlite:///{directory / 'broker.db'}",
        BRIDGE_POLL_INTERVAL="1",
        BRIDGE_DISPATCH_LEASE="30",
    )
    return env


def describe(task: Task) -> str:
    outcome = {
        RESULT_SUCCESS: "archived: success",
        RESULT_FAILURE: "archived: failure",
        RESULT_CANCELLED: "archived: cancelled",
    }
    if task.archived:
        # Archived rows have both (NOT NULL in worker_archivetask).
        assert task.result is not None and task.duration is not None
        text = outcome.get(task.result, f"archived: result {task.result}")
        return f"{text} after {task.failure_count} failure(s), ran {task.duration / 1e6:.2f} s"
    return f"still {task.state.value} (failures: {task.failure_count})"


def run(directory: Path, timeout: float, echo: Callable[[str], None]) -> bool:
    """Run the demo; True when every sample reached the archive."""
    directory.mkdir(parents=True, exist_ok=True)
    env = environment(directory)
    for name in ("phorge-worker.db", "broker.db"):
        for suffix in ("", "-wal", "-shm"):
            (directory / f"{name}{suffix}").unlink(missing_ok=True)
    queue = PhorgeQueue.from_url(env["BRIDGE_DATABASE_URL"])
    queue.create_tables()
    planned = {queue.enqueue(TEST_WORKER, s.data): s.what for s in samples(time.time())}
    echo(f"Queued {len(planned)} {TEST_WORKER} tasks in {directory / 'phorge-worker.db'}")
    echo("Starting a Celery worker with beat (polls every second)...")
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "bridge",
            "worker",
            "-B",
            "-c",
            "2",
            "-l",
            "warning",
            "-s",
            str(directory / "beat-schedule"),
        ],
        env=env,
        cwd=directory,
        stdout=open(directory / "worker.log", "wb"),  # noqa: SIM115 - the child owns it
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        done = wait_until_archived(queue, len(planned) + 1, timeout, worker)
    finally:
        stop(worker)
    echo("")
    for task in sorted(queue.list(), key=lambda t: t.id):
        what = planned.get(task.id, "follow-up queued by a successful task")
        echo(f"  {task.label:<26} {what:<46} {describe(task)}")
    echo("")
    echo(f"Worker log: {directory / 'worker.log'}")
    return done


def wait_until_archived(
    queue: PhorgeQueue, expected: int, timeout: float, worker: subprocess.Popen[bytes]
) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and worker.poll() is None:
        tasks = queue.list()
        if len(tasks) >= expected and all(t.archived for t in tasks):
            return True
        time.sleep(0.5)
    return False


def stop(worker: subprocess.Popen[bytes], grace: float = 15) -> None:
    """Warm shutdown (SIGTERM), then SIGKILL of the whole group if it lingers."""
    if worker.poll() is None:
        worker.terminate()
        try:
            worker.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
