"""The PHP runner handler: PHP-only task classes run in long-lived PHP processes here.

When ``BRIDGE_PHORGE_ROOT`` names the host's Phorge checkout, the classes no native
handler serves (those matching ``BRIDGE_RUNNER_CLASSES``) run in this worker process's
:class:`~bridge.transports.php_runner.pool.RunnerPool`, each process Phorge bootstrapped once,
instead of paying a whole web request through Conduit. The PHP side is the same task run
as ``worker.execute``'s, so the answer is read by ``bridge.transports.task_run``.

A task whose PHP dies (a fatal error, ``exit()``, a segfault, memory exhausted) or runs
past its lease (its process is killed a little before the lease ends) fails temporarily,
with the reason in PHP's words and the worker's own wait, asked of a fresh process. A
process killed from outside mid-task (SIGKILL or SIGTERM: the OOM killer, an operator)
is no proof against the task: as under phd, where a killed taskmaster's task runs again
under a new lease with no failure counted, the lease is handed back at once, but only
the first time in :data:`KILL_MEMORY` seconds this process sees that task killed
(:class:`Kills`), so a task that gets its PHP killed every time (its own memory) counts
failures and waits as a crash does, and reaches its retry limit. A
runner that cannot boot is nobody's failure: the task is handed back at once, for a
worker whose PHP runs, and its availability holds the classes back here until a process boots
again.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

from bridge.errors import RunnerBootError, RunnerDied, RunnerKilled, RunnerTimedOut
from bridge.handlers.api import HandBack, PermanentFailure, TaskContext, TemporaryFailure, Yield
from bridge.handlers.availability import Availability
from bridge.handlers.capabilities import TransportHandler
from bridge.queue.implementations import RUNNER
from bridge.queue.model import DEFAULT_RETRY_WAIT
from bridge.transports.php_runner.pool import RunnerPool
from bridge.transports.php_runner.stamp import deploy_stamp
from bridge.transports.task_run import READ_ONLY_YIELD, apply_result, execute_params

log = logging.getLogger(__name__)

NAME = "The PHP runner"  # in its availability's log lines
# Boots are local and cheap: probe at least this often while the runner cannot boot, so
# the classes come back within seconds of a fix.
PROBE_BACKOFF_MAX = 5.0
# Stop a run this share of its lease (at most a minute) before the lease ends, so its
# failure is still written under the lease and the task never runs twice inside it.
LEASE_MARGIN_SHARE = 0.1
LEASE_MARGIN_MAX = 60.0
# How long the small requests (describe a class, ask a wait) may take.
SHORT_REQUEST = 30.0
# Seconds a process remembers a task whose PHP was killed under it: a second kill of it
# within this time counts as a failure (``Kills``).
KILL_MEMORY = 3600.0
KILLS_KEPT = 1024  # tasks remembered at most (the oldest forgotten first)


class Kills:
    """The tasks whose PHP process this worker process saw killed from outside, and when:
    the first kill of a task is handed back, a repeat within :data:`KILL_MEMORY` is a
    failure. Per process and in memory: no Phorge column can hold it (a ``failureTime``
    with no failure counted is a canary's fallback), so a fleet of N processes
    gives a task at most N free runs an hour, never an endless loop."""

    def __init__(self) -> None:
        self._seen: OrderedDict[int, float] = OrderedDict()

    def first(self, task_id: int) -> bool:
        """Record a kill of ``task_id``: whether it is the first one in the memory."""
        now = time.monotonic()
        last = self._seen.pop(task_id, None)
        self._seen[task_id] = now
        while len(self._seen) > KILLS_KEPT:
            self._seen.popitem(last=False)
        return last is None or now - last > KILL_MEMORY


class PhpRunnerHandler(TransportHandler):
    """Serves the PHP-only classes matching ``classes`` with the pool's processes."""

    phorge_defaults = True
    implementation = RUNNER
    availability: Availability  # always one: the runner can fail to boot
    batch_limit = 16  # a message's tasks run in turn, their outcomes one commit

    def __init__(self, pool: RunnerPool, classes: tuple[str, ...], default_lease: int) -> None:
        self.pool = pool
        self.classes = classes
        self.default_lease = default_lease
        self.availability = Availability(self.probe, name=NAME, max_backoff=PROBE_BACKOFF_MAX)
        self._described: dict[str, dict[str, Any]] = {}
        self.kills = Kills()

    @property
    def version(self) -> str | None:
        """The PHP code's deploy stamp (:func:`deploy_stamp`)."""
        return deploy_stamp(self.pool.settings.reload_stamp, self.pool.settings.phorge_root)

    def probe(self) -> str | None:
        """The availability's probe: None once a process is booted (booting one if none is)."""
        try:
            self.pool.check()
        except RunnerBootError as exc:
            return str(exc)
        return None

    def start(self, slots: int) -> None:
        """Start the pool's processes (one per slot); one that cannot start turns the
        availability down, which says why once."""
        try:
            self.pool.warm(slots)
        except RunnerBootError as exc:
            self.availability.failure(str(exc))

    def stop(self) -> None:
        """Stop the idle processes at once (a busy one ends with its task's pipe)."""
        self.pool.close()

    def required_lease(self, task: TaskContext) -> int | None:
        lease = self._describe(task).get("requiredLease")
        return lease if isinstance(lease, int) else None

    def maximum_retry_count(self, task: TaskContext) -> int | None:
        count = self._describe(task).get("maximumRetryCount")
        return count if isinstance(count, int) else None

    def run(self, task: TaskContext) -> None:
        if not self.availability.allow():
            raise HandBack(f"held back: {self.availability.reason}")
        lease = self.required_lease(task) or self.default_lease
        deadline = lease - min(LEASE_MARGIN_MAX, lease * LEASE_MARGIN_SHARE)
        try:
            with self.pool.checkout() as process:
                process.tasks += 1
                answer = process.request({"op": "run", "task": execute_params(task)}, deadline)
        except RunnerBootError as exc:
            self.availability.failure(str(exc))
            raise HandBack(f"held back: {exc}") from None
        except RunnerTimedOut as exc:
            reason = f"ran past its lease ({lease} s) and was stopped at {deadline:.0f} s: {exc}"
            raise self._died(task, reason) from None
        except RunnerKilled as exc:
            if not self.kills.first(task.id):
                raise self._died(task, f"{exc} (killed again)") from None
            log.warning(
                "task %s (%s): %s; handed back, no failure counted", task.id, task.task_class, exc
            )
            raise HandBack(f"{exc}; handed back once, no failure counted") from None
        except RunnerDied as exc:
            raise self._died(task, str(exc)) from None
        self.availability.success()
        if answer.get("type") == "error":
            # The task spec PHP read from this row is not one Phorge can run (an empty
            # class, a negative count): it never will be, so the task fails visibly.
            raise PermanentFailure(f"the PHP runner refused the task: {answer.get('message')}")
        if answer.get("type") == "read-only":
            log.warning("task %s (%s): Phorge is read-only; yielding", task.id, task.task_class)
            raise Yield("Phorge is read-only", delay=READ_ONLY_YIELD)
        if answer.get("output"):
            log.warning("task %s (%s) printed: %s", task.id, task.task_class, answer["output"])
        apply_result(task, answer)

    def _died(self, task: TaskContext, reason: str) -> TemporaryFailure:
        """The failure of a run whose process ended, with the worker's own wait."""
        log.error("task %s (%s): %s", task.id, task.task_class, reason)
        return TemporaryFailure(reason, delay=self._wait_after_death(task, reason))

    def _wait_after_death(self, task: TaskContext, reason: str) -> int:
        """``getWaitBeforeRetry()`` asked of a fresh process (which replaces the dead
        one), else Phorge's default."""
        request = {"op": "wait", "task": execute_params(task), "message": reason}
        try:
            answer = self._ask(request)
        except (RunnerBootError, RunnerDied) as exc:
            log.warning("task %s: no wait before retry from PHP (%s); using Phorge's", task.id, exc)
            return DEFAULT_RETRY_WAIT
        wait = answer.get("retryWait")
        return wait if isinstance(wait, int) else DEFAULT_RETRY_WAIT

    def _describe(self, task: TaskContext) -> dict[str, Any]:
        """The class's required lease and maximum retry count, asked once per class
        (a class that kills its process when made is remembered as saying nothing)."""
        try:
            return self._described[task.task_class]
        except KeyError:
            pass
        try:
            answer = self._ask({"op": "describe", "task": execute_params(task)})
        except RunnerBootError:
            return {}  # not known yet; asked again when the runner boots
        except RunnerDied as exc:
            log.warning("%s: describing the class killed its PHP process: %s", task.task_class, exc)
            answer = {}
        return self._described.setdefault(task.task_class, answer)

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        with self.pool.checkout() as process:
            return process.request(request, SHORT_REQUEST)
