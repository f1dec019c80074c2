"""The PHP runner with real PHP processes, on the stand-in Phorge (tests/php_standin/).

Every way a run ends, every fault a task's PHP can have (each its task's temporary
failure with the worker's wait and PHP's reason, the process replaced, the next task
served), the pool's recycling rules, the runner that cannot boot (held back, never a
task's failure) and the end of orphans.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from bridge_harness import wait_until
from php_standin import STANDIN_ROOT, context, php_binary, runner_handler, runner_settings

from bridge.assembly import build_runtime
from bridge.config import load_settings
from bridge.engine.batch import Batch
from bridge.errors import RunnerBootError
from bridge.handlers.capabilities import is_available
from bridge.handlers.outcome import run_handler
from bridge.queue.model import DEFAULT_RETRY_WAIT, Leased, Outcome
from bridge.transports.php_runner.pool import PoolListener, Restart, RunnerPool
from bridge.transports.php_runner.process import RunnerCommand, RunnerProcess


def ran_by(result) -> int:
    """The pid of the process that ran a StandinPidWorker/StandinSleepWorker task."""
    [followup] = result.followups
    return int(followup.data["pid"])


class Heard(PoolListener):
    """What a pool's listener hears: the pids started, and those ended with their cause
    (and when: ``ended_at``, monotonic)."""

    def __init__(self) -> None:
        self.pids: list[int] = []
        self.endings: list[tuple[int, Restart | None]] = []
        self.ended_at: list[float] = []

    def started(self, process: RunnerProcess) -> None:
        self.pids.append(process.pid)

    def ended(self, process: RunnerProcess, cause: Restart | None) -> None:
        self.endings.append((process.pid, cause))
        self.ended_at.append(time.monotonic())

    @property
    def live(self) -> int:
        """The pool's processes booted and not retired, as its listener heard them."""
        return len(self.pids) - len(self.endings)


# -- how a run ends ---------------------------------------------------------------------------


def test_every_ordinary_outcome() -> None:
    heard = Heard()
    with runner_handler() as handler:
        handler.pool.listeners.append(heard)
        followups = [
            {"class": "StandinSucceedWorker", "data": {"n": 1}},
            {"class": "StandinSucceedWorker", "data": {"n": 2}, "options": {"priority": 900}},
        ]
        done = run_handler(handler, context("StandinSucceedWorker", {"followups": followups}))
        assert done.outcome is Outcome.SUCCESS
        assert [(f.data, f.priority) for f in done.followups] == [({"n": 1}, 1500), ({"n": 2}, 900)]
        assert done.duration_us >= 0

        failed = run_handler(handler, context("StandinFailWorker", {"wait": 42, "message": "no"}))
        assert (failed.outcome, failed.delay, failed.reason) == (
            Outcome.FAILURE,
            42,
            "Exception: no",
        )
        phorges_wait = run_handler(handler, context("StandinFailWorker"))
        assert phorges_wait.delay == DEFAULT_RETRY_WAIT

        gave_up = run_handler(handler, context("StandinPermanentWorker"))
        assert (gave_up.outcome, gave_up.reason) == (Outcome.PERMANENT_FAILURE, "standin gives up")

        yielded = run_handler(handler, context("StandinYieldWorker", {"seconds": 30}))
        assert (yielded.outcome, yielded.delay) == (Outcome.YIELD, 30)
        assert run_handler(handler, context("StandinYieldWorker", {"seconds": 1})).delay == 5

        for task_class, reason in [
            ("StandinNoSuchWorker", "does not exist"),
            ("StandinNotAWorker", "does not extend PhabricatorWorker"),
            ("StandinAbstractWorker", "is abstract"),
        ]:
            refused = run_handler(handler, context(task_class))
            assert refused.outcome is Outcome.PERMANENT_FAILURE and reason in refused.reason
        assert heard.live == len(heard.pids) == 1  # one process ran them all


def test_a_spec_php_cannot_read_fails_the_task_for_good() -> None:
    """A row PHP refuses to read (an empty class: ``newTaskFromSpec``) never runs: a
    visible permanent failure naming the field, not a retry forever."""
    with runner_handler() as handler:
        refused = run_handler(handler, context(""))
        assert refused.outcome is Outcome.PERMANENT_FAILURE
        assert "the PHP runner refused the task" in refused.reason
        assert "taskClass" in refused.reason


def test_what_a_task_prints_never_corrupts_an_answer(caplog: pytest.LogCaptureFixture) -> None:
    with runner_handler() as handler:
        for _ in range(3):
            assert run_handler(handler, context("StandinPrintWorker")).outcome is Outcome.SUCCESS
        wait_until(
            lambda: "written to stderr" in caplog.text and "written to stdout" in caplog.text,
            10,
            "the task's stdout and stderr in the log",
        )
        assert "echoed by the task" in caplog.text


def test_the_request_cache_is_destroyed_before_each_task() -> None:
    heard = Heard()
    with runner_handler() as handler:
        handler.pool.listeners.append(heard)
        for _ in range(3):
            assert run_handler(handler, context("StandinCacheWorker")).outcome is Outcome.SUCCESS
        assert heard.live == len(heard.pids) == 1


def test_the_class_says_its_lease_and_retry_limit_once() -> None:
    with runner_handler() as handler:
        assert handler.required_lease(context("StandinLoopWorker", {"lease": 900})) == 900
        # Asked once per class: the first task's answer stands.
        assert handler.required_lease(context("StandinLoopWorker", {"lease": 5})) == 900
        limited = context("StandinFailWorker", {"maximumRetries": 2})
        assert handler.maximum_retry_count(limited) == 2
        assert handler.required_lease(context("StandinSucceedWorker")) is None


def test_the_retry_limit_applies_in_php_too() -> None:
    with runner_handler() as handler:
        over = context("StandinFailWorker", {"maximumRetries": 1}, failure_count=2)
        result = run_handler(handler, over)
        assert result.outcome is Outcome.PERMANENT_FAILURE
        assert "exceeded the maximum number of failures (1)" in result.reason


# -- faults: each its task's temporary failure, the process replaced, the next task served ---

FAULTS = {
    "fatal": ("StandinFatalWorker", "PHP Fatal error: Cannot redeclare standin_twice()", 61),
    "exit": ("StandinExitWorker", "exit() or die()); it printed: about to exit", 300),
    "segfault": ("StandinSegfaultWorker", "killed by SIGSEGV", 300),
    "memory": ("StandinMemoryWorker", "PHP Fatal error: Allowed memory size", 300),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_dying_task_fails_alone_with_its_reason_and_wait(fault: str) -> None:
    task_class, reason, wait = FAULTS[fault]
    heard = Heard()
    with runner_handler() as handler:
        handler.pool.listeners.append(heard)
        before = ran_by(run_handler(handler, context("StandinPidWorker")))
        died = run_handler(handler, context(task_class))
        assert died.outcome is Outcome.FAILURE
        assert reason in died.reason and f"process {before}" in died.reason
        # The worker's own wait, asked of the fresh process (the fatal worker's depends on
        # the failure count Phorge shows it: one more than before).
        assert died.delay == wait
        assert (before, Restart.DIED) in heard.endings
        after = run_handler(handler, context("StandinPidWorker"))
        assert after.outcome is Outcome.SUCCESS and ran_by(after) != before
        assert heard.live == 1
        assert not handler.availability.is_down  # a task's fault is not the runner's
    with pytest.raises(ProcessLookupError):
        os.kill(before, 0)


def test_a_process_killed_from_outside_hands_its_task_back_once() -> None:
    """SIGKILL (the OOM killer) is not the task's crash: the first kill hands the lease
    back at once, no failure counted; the same task killed again counts as a failure with
    Phorge's wait, so a task that gets its PHP killed every time never loops for free."""
    heard = Heard()
    with runner_handler() as handler:
        handler.pool.listeners.append(heard)
        first = run_handler(handler, context("StandinKilledWorker", task_id=7))
        assert first.outcome is Outcome.HANDED_BACK, first
        assert "killed by SIGKILL" in first.reason and "no failure counted" in first.reason
        other = run_handler(handler, context("StandinKilledWorker", task_id=8))
        assert other.outcome is Outcome.HANDED_BACK, "each task has its own first kill"
        again = run_handler(handler, context("StandinKilledWorker", task_id=7))
        assert (again.outcome, again.delay) == (Outcome.FAILURE, DEFAULT_RETRY_WAIT), again
        assert "killed again" in again.reason
        assert [cause for _, cause in heard.endings] == [Restart.DIED] * 3
        assert run_handler(handler, context("StandinPidWorker")).outcome is Outcome.SUCCESS
        assert not handler.availability.is_down


def test_an_endless_loop_is_stopped_before_its_lease_ends() -> None:
    heard = Heard()
    with runner_handler() as handler:
        handler.pool.listeners.append(heard)
        loop = context("StandinLoopWorker", {"lease": 3})
        assert handler.required_lease(loop) == 3  # run.py claims this lease before the run
        started = time.monotonic()
        result = run_handler(handler, loop)
        assert result.outcome is Outcome.FAILURE
        assert "ran past its lease (3 s) and was stopped at 3 s" in result.reason
        assert [cause for _, cause in heard.endings] == [Restart.DEADLINE]
        # Killed at 90% of the lease, before it ends: timed at the kill, not at the return
        # (which waits for the replacement to boot and answer getWaitBeforeRetry()).
        # Seen on 2 loaded cores (other tests and two busy loops, 45 runs): 2.703-2.776 s.
        stopped = heard.ended_at[0] - started
        assert 2.7 <= stopped < 3.0, f"killed {stopped:.3f} s after the start"
        assert result.delay == DEFAULT_RETRY_WAIT
        assert run_handler(handler, context("StandinPidWorker")).outcome is Outcome.SUCCESS


def test_a_loop_without_a_declared_lease_gets_the_default_one() -> None:
    with runner_handler(default_lease=2) as handler:
        result = run_handler(handler, context("StandinLoopWorker"))
        assert result.outcome is Outcome.FAILURE
        assert "ran past its lease (2 s)" in result.reason


# -- the pool -----------------------------------------------------------------------------------


def test_a_process_is_replaced_after_max_tasks() -> None:
    heard = Heard()
    with runner_handler(runner_settings(max_tasks=2)) as handler:
        handler.pool.listeners.append(heard)
        pids = [ran_by(run_handler(handler, context("StandinPidWorker"))) for _ in range(5)]
        assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]
        assert [cause for _, cause in heard.endings] == [Restart.TASKS, Restart.TASKS]


def test_a_process_is_replaced_at_max_age() -> None:
    now = [time.time()]
    settings = runner_settings(max_age=60.0)
    pool = RunnerPool(settings, clock=lambda: now[0])
    with runner_handler(settings) as handler:
        handler.pool = pool
        first = ran_by(run_handler(handler, context("StandinPidWorker")))
        assert ran_by(run_handler(handler, context("StandinPidWorker"))) == first
        now[0] += 61
        assert ran_by(run_handler(handler, context("StandinPidWorker"))) != first
    pool.close()


def test_a_process_is_replaced_past_max_rss() -> None:
    heard = Heard()
    with runner_handler(runner_settings(max_rss=64 * 1024 * 1024)) as handler:
        handler.pool.listeners.append(heard)
        first = ran_by(run_handler(handler, context("StandinPidWorker")))
        assert (
            run_handler(handler, context("StandinLeakWorker", {"mb": 80})).outcome
            is Outcome.SUCCESS
        )
        assert ran_by(run_handler(handler, context("StandinPidWorker"))) != first
        assert (first, Restart.RSS) in heard.endings


def test_the_reload_stamp_replaces_processes_between_tasks(tmp_path: Path) -> None:
    stamp = tmp_path / "deployed"
    with runner_handler(runner_settings(reload_stamp=stamp)) as handler:
        first = ran_by(run_handler(handler, context("StandinPidWorker")))
        assert ran_by(run_handler(handler, context("StandinPidWorker"))) == first
        stamp.touch()
        second = ran_by(run_handler(handler, context("StandinPidWorker")))
        assert second != first
        assert ran_by(run_handler(handler, context("StandinPidWorker"))) == second


def test_a_threads_worker_gets_a_process_per_slot() -> None:
    heard = Heard()
    with runner_handler() as handler:
        handler.pool.listeners.append(heard)
        handler.start(4)
        assert len(heard.pids) == 4
        results = []
        gate = threading.Barrier(4)

        def one() -> None:
            gate.wait()
            results.append(run_handler(handler, context("StandinSleepWorker", {"ms": 300})))

        threads = [threading.Thread(target=one) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert [r.outcome for r in results] == [Outcome.SUCCESS] * 4
        assert {ran_by(r) for r in results} <= set(heard.pids)  # warm ones, no new boot
        assert heard.live == 4


def test_warm_processes_boot_together_before_the_first_task() -> None:
    with runner_handler() as handler:
        handler.start(1)
        [process] = handler.pool._idle
        process.ready(10)  # booted meanwhile: the first task pays no bootstrap
        assert process.php_version
        assert ran_by(run_handler(handler, context("StandinPidWorker"))) == process.pid


# -- a runner that cannot boot: held back, no task's failure -------------------------------------


def test_a_runner_that_cannot_boot_holds_its_classes_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    down = tmp_path / "database-down"
    down.touch()
    monkeypatch.setenv("STANDIN_DOWN_FILE", str(down))
    with runner_handler() as handler:
        handler.start(1)
        held = run_handler(handler, context("StandinPidWorker"))
        assert held.outcome is Outcome.HANDED_BACK  # for a worker whose PHP boots
        assert handler.availability.is_down and not is_available(handler)
        assert (
            "Unable to establish a connection to any database host" in handler.availability.reason
        )
        assert "no failure counted" in caplog.text
        errors = [r for r in caplog.records if r.levelname == "ERROR" and "PHP runner" in r.message]
        assert len(errors) == 1  # one clear line, however many tasks and probes
        down.unlink()
        wait_until(lambda: is_available(handler), 10, "the runner to come back once Phorge boots")
        assert run_handler(handler, context("StandinPidWorker")).outcome is Outcome.SUCCESS


@pytest.mark.parametrize(
    "settings, reason",
    [
        ({"root": Path("/nonexistent/phorge")}, '"/nonexistent/phorge" is not a Phorge checkout'),
        ({"php": "/nonexistent/php"}, "'/nonexistent/php' is not installed"),
    ],
    ids=["wrong-path", "php-missing"],
)
def test_a_wrong_path_or_missing_php_is_nobodys_failure(settings: dict, reason: str) -> None:
    base = runner_settings()
    broken = replace(
        base,
        php=settings.get("php", base.php),
        phorge_root=settings.get("root", base.phorge_root),
    )
    with runner_handler(broken) as handler:
        held = run_handler(handler, context("StandinPidWorker"))
        assert held.outcome is Outcome.HANDED_BACK
        assert reason in handler.availability.reason and not is_available(handler)


def test_boot_errors_say_why() -> None:
    with pytest.raises(RunnerBootError, match="not a Phorge checkout"):
        RunnerProcess(RunnerCommand(runner_settings().php, Path("/tmp"))).ready(10)


# -- no orphans -------------------------------------------------------------------------------

ORPHAN_PARENT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from bridge.transports.php_runner.process import RunnerCommand, RunnerProcess
    process = RunnerProcess(RunnerCommand(sys.argv[1], Path(sys.argv[2])))
    process.ready(30)
    if sys.argv[3] == "busy":
        import json, os, struct
        body = json.dumps({"op": "run", "task": {"taskID": 1, "taskClass": "StandinLoopWorker",
            "data": "{}", "failureCount": 0, "priority": 1}}).encode()
        os.write(process._requests, struct.pack(">I", len(body)) + body)
    print(process.pid, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("state", ["idle", "busy"])
def test_php_exits_when_its_worker_is_killed(state: str) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_PARENT, php_binary(), str(STANDIN_ROOT), state],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        php = int(parent.stdout.readline())
        os.kill(php, 0)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)

    def gone() -> bool:
        try:
            os.kill(php, 0)
        except ProcessLookupError:
            return True
        # A zombie waits for init to reap it: gone all the same.
        return Path(f"/proc/{php}/stat").read_text().split()[2] == "Z"

    wait_until(gone, 10, f"PHP runner {php} to exit after its worker was killed")


def test_read_only_phorge_yields_without_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = tmp_path / "read-only"
    flag.touch()
    monkeypatch.setenv("STANDIN_READ_ONLY_FILE", str(flag))
    with runner_handler() as handler:
        held = run_handler(handler, context("StandinFailWorker"))
        assert (held.outcome, held.delay) == (Outcome.YIELD, 300)
        flag.unlink()
        assert run_handler(handler, context("StandinFailWorker")).outcome is Outcome.FAILURE


def test_a_long_or_invalid_reason_is_cut_on_a_character_and_made_utf8() -> None:
    with runner_handler() as handler:
        data = {"message": "é", "repeat": 5000, "invalidUTF8": True}
        failed = run_handler(handler, context("StandinFailWorker", data))
        assert failed.outcome is Outcome.FAILURE
        assert failed.reason.startswith("Exception: \ufffdé")
        assert len(failed.reason.encode()) <= 4096 and failed.reason.endswith("é")


# -- a message's tasks: run in turn, outcomes written together, a death its task's alone -----


def test_a_message_with_dying_tasks_fails_them_alone_and_writes_every_outcome(
    tmp_path: Path,
) -> None:
    rt = build_runtime(
        load_settings(
            {
                "BRIDGE_DATABASE_URL": f"sqlite:///{tmp_path}/q.db",
                "BRIDGE_PHORGE_ROOT": str(STANDIN_ROOT),
                "BRIDGE_RUNNER_PHP": php_binary(),
            }
        )
    )
    runner = rt.registry.runner
    assert runner is not None and runner.batch_limit > 1
    try:
        ok = "StandinSucceedWorker"
        classes = [ok, "StandinFatalWorker", ok, "StandinExitWorker", "StandinSegfaultWorker", ok]
        ids = [rt.queue.enqueue(c, {}) for c in classes]
        leased = {t.id: t for t in rt.queue.lease(len(ids), 600, ids=ids)}
        (owner,) = {t.lease_owner for t in leased.values()}
        batch = Batch(rt, owner or "", None)
        batch.run([Leased(i, 0, c) for i, c in zip(ids, classes, strict=True)])
        ended = [ran.outcome for _, ran, _ in batch.reports]
        assert ended == [Outcome.SUCCESS, Outcome.FAILURE, Outcome.SUCCESS,
                         Outcome.FAILURE, Outcome.FAILURE, Outcome.SUCCESS]  # fmt: skip
        rows = {i: rt.queue.get(i) for i in ids}
        for task_id, task_class in zip(ids, classes, strict=True):
            row = rows[task_id]
            if task_class == ok:
                assert row.archived and row.result == 0
            else:
                assert not row.archived and row.failure_count == 1, task_class
        assert "killed by SIGSEGV" in batch.reports[4][1].reason
    finally:
        runner.pool.close()
