"""The PHP runner end to end: a real ``celery worker`` and ``beat`` run PHP-only classes in
long-lived PHP processes on the stand-in Phorge (tests/php_standin/), on MariaDB and
RabbitMQ, with the prefork and the threads pool.

Ordinary tasks all run in the warm processes (one per slot); a task whose PHP segfaults
or dies of a fatal error waits out its worker's retry wait, alone; and when the worker's
Python processes are killed with ``kill -9``, their PHP processes end too.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from php_standin import STANDIN_ROOT, php_binary

from bridge.queue.model import RESULT_SUCCESS, YIELD_OWNER, TaskFilter

CONCURRENCY = 2
ORDINARY = 30
WAIT = 60.0


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (children first seen in /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def is_php_runner(pid: int) -> bool:
    try:
        return b"phorge-bridge-runner.php" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_php_only_classes_run_in_warm_php_processes(make_bridge, database_url, amqp_url, pool):
    php_binary()
    bridge = make_bridge(
        database_url,
        amqp_url,
        PHORGE_ROOT=str(STANDIN_ROOT),
        RUNNER_CLASSES="Standin*",
        # Follow-ups stay queued, so their data (the pid that ran the parent) can be read.
        HANDLERS_EXCLUDE="StandinSucceedWorker",
        POLL_INTERVAL="0.2",
    )
    ordinary = bridge.enqueue("StandinPidWorker", {}, count=ORDINARY)
    [failing] = bridge.enqueue("StandinFailWorker", {"wait": 1000})
    [segfault] = bridge.enqueue("StandinSegfaultWorker", {})
    [fatal] = bridge.enqueue("StandinFatalWorker", {})
    [yielding] = bridge.enqueue("StandinYieldWorker", {"seconds": 600})
    worker = bridge.worker(
        "worker",
        [bridge.default_queue, bridge.control_queue],
        concurrency=CONCURRENCY,
        extra=("-P", pool),
    )
    bridge.wait_ready(worker)

    def runner_pids() -> list[int]:
        return [p for p in descendants(worker.pid) if is_php_runner(p)]

    def one_per_slot() -> list[int] | None:
        found = runner_pids()
        return found if len(found) == CONCURRENCY else None

    # Each slot starts its own as it starts: wait for all of them, not the first.
    warm = bridge.wait_until(one_per_slot, WAIT, "a warm PHP runner process per slot")
    bridge.beat()

    archived = bridge.wait_archived(ordinary, timeout=WAIT)
    assert {row.result for row in archived.values()} == {RESULT_SUCCESS}

    def waiting(task_id: int):
        row = bridge.active_rows([task_id]).get(task_id)
        return row if row is not None and row.failureCount == 1 else None

    for task_id, wait in [(failing, 1000), (segfault, 300), (fatal, 61)]:
        row = bridge.wait_until(lambda t=task_id: waiting(t), WAIT, f"task {task_id} to fail")
        # The worker's own wait, exactly: one UPDATE sets both from one reading of the
        # database clock, so neither the machine's load nor the clock's seconds move it.
        assert row.leaseExpires - row.failureTime == wait

    def yielded():
        row = bridge.active_rows([yielding]).get(yielding)
        return row if row is not None and row.leaseOwner == YIELD_OWNER else None

    assert bridge.wait_until(yielded, WAIT, "the yield").failureCount == 0

    # Every ordinary task ran in a PHP process of this worker; the two crashes replaced
    # theirs, and nothing else did.
    followups = bridge.queue.list(TaskFilter(classes=["StandinSucceedWorker"]))
    pids = {task.data["pid"] for task in followups}
    assert len(followups) == ORDINARY and len(pids) <= CONCURRENCY + 2
    runners = set(runner_pids())
    assert len(warm) == len(runners) == CONCURRENCY
    assert "killed by SIGSEGV" in worker.log() and "PHP Fatal error" in worker.log()

    # kill -9 of every Python process of the worker (not its group): PHP ends with them.
    for pid in [worker.pid, *descendants(worker.pid)]:
        if not is_php_runner(pid):
            os.kill(pid, signal.SIGKILL)
    worker.popen.wait(10)
    bridge.wait_until(lambda: all(gone(p) for p in runners), 15, "the PHP runners to end")
