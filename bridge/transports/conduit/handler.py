"""The Conduit proxy: runs task classes that only exist in PHP through ``worker.execute``.

The bridge keeps the lease and records the outcome; Phorge only runs the worker and says
how it ended. Problems reaching Phorge are never archived permanently: that would lose
work an operator can still save. An outage (the web tier down, a refused token) is not
the task's failure at all: the task is handed back, no failure counted, and the
process's :class:`~bridge.handlers.availability.Availability` of Conduit holds proxied
work back until Conduit answers again. What PHP reports for the task (a 500, an error
answer) keeps Phorge's semantics.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

from bridge.errors import (
    ConduitAuthError,
    ConduitError,
    ConduitMethodNotFoundError,
    ConduitTimeoutError,
    ConduitTransportError,
)
from bridge.handlers.api import HandBack, TaskContext, TemporaryFailure, Yield
from bridge.handlers.availability import Availability
from bridge.handlers.capabilities import BatchHandler, run_each
from bridge.queue.implementations import CONDUIT
from bridge.queue.model import DEFAULT_LEASE_SECONDS, DEFAULT_RETRY_WAIT, MIN_YIELD_SECONDS
from bridge.transports.conduit.client import ConduitClient
from bridge.transports.conduit.request_slots import RequestSlots
from bridge.transports.task_run import READ_ONLY_YIELD, apply_result, execute_params, optional_int

logger = logging.getLogger(__name__)

WORKER_EXECUTE = "worker.execute"

ERR_READ_ONLY = "ERR-BRIDGE-READ-ONLY"  # raised by the extension in read-only mode
ERR_PARAMETER = "ERR-BRIDGE-PARAMETER"  # the extension refused the request's parameters
# A task of a handler without an availability (the feed hook) yields this long in an outage.
OUTAGE_YIELD = MIN_YIELD_SECONDS
PROBE_METHOD = "user.whoami"
PROBE_TIMEOUT = 5.0

# Phorge workers that declare getRequiredLeaseTime(): the lease must be held before the
# call, and PHP only tells us afterwards. Keep in step with Phorge (the response's
# "requiredLease" is checked against this and logged when it is larger).
PHORGE_REQUIRED_LEASES: Mapping[str, int] = {
    "PhabricatorRepositoryGitCommitChangeParserWorker": 24 * 3600,
    "PhabricatorRepositoryMercurialCommitChangeParserWorker": 24 * 3600,
    "PhabricatorRepositorySvnCommitChangeParserWorker": 24 * 3600,
    "PhabricatorRepositoryCommitPublishWorker": 4 * 3600,
    "HarbormasterTargetWorker": 24 * 3600,
}

# Stop waiting for PHP a little before the lease runs out, so the outcome can still be
# recorded under it.
LEASE_MARGIN = 60


def trace_headers(task: TaskContext) -> dict[str, str]:
    """The W3C trace context header of the execution, for whatever the handler calls."""
    return {"traceparent": task.traceparent} if task.traceparent else {}


def outage_reason(exc: ConduitError, client: ConduitClient) -> str | None:
    """Why ``exc`` means Conduit is unusable for every task, or None when it is this task's.

    Refused, reset, connect timeouts, 3xx, 502/503/504 and pages that are not Conduit JSON
    come from the web tier, and a refused token from the bridge's setup: neither is the
    task's failure. A 500 is PHP failing on this task, and a read timeout may be this
    task's own slowness: those keep Phorge's semantics.
    """
    if isinstance(exc, ConduitAuthError):
        return (
            f"PHORGE REFUSED THE BRIDGE'S CONDUIT TOKEN ({exc.error_code}): no PHP task can run "
            f"until an operator fixes {client.token_setting} (it must be an API token of an "
            f"administrator account): {exc.error_info}"
        )
    if isinstance(exc, ConduitTimeoutError):
        return None if exc.sent else str(exc)
    if isinstance(exc, ConduitTransportError) and exc.http_status != 500:
        return str(exc)
    return None


def conduit_failure(
    exc: ConduitError,
    task: TaskContext,
    client: ConduitClient,
    availability: Availability | None = None,
) -> TemporaryFailure | Yield | HandBack:
    """The outcome for a Conduit problem (never permanent), logged as loudly as it deserves.

    An outage turns ``availability`` down, which logs it once, and hands the task back
    (no failure counted) for a worker that reaches Phorge; without one (nothing holds
    the class back meanwhile: the feed hook) the task yields instead.
    """
    if exc.error_code == ERR_READ_ONLY:
        # Phorge cannot run anything now; the task is not at fault, so no failure is counted.
        logger.warning("task %s (%s): Phorge is read-only; yielding", task.id, task.task_class)
        return Yield(str(exc), delay=READ_ONLY_YIELD)
    reason = outage_reason(exc, client)
    if reason is not None:
        if availability is not None:
            availability.failure(reason)
            return HandBack(f"Conduit unavailable: {exc}")
        logger.error("task %s (%s): %s", task.id, task.task_class, reason)
        return Yield(f"Conduit unavailable: {exc}", delay=OUTAGE_YIELD)
    if availability is not None:
        availability.success()  # Phorge answered: the problem is this task's
    if isinstance(exc, ConduitMethodNotFoundError):
        logger.error(
            "Phorge at %s has no %s method: install the extension "
            "(phorge-bridge phorge install-extension); task %s (%s) will be retried",
            client.base_url,
            exc.method,
            task.id,
            task.task_class,
        )
        return TemporaryFailure(str(exc))
    if isinstance(exc, ConduitTimeoutError):
        # PHP may still be running the worker: wait that long again before a second run,
        # without counting a failure (the task may just be slow, as phd would let it be).
        message = f"{exc} (the work may still be running in PHP)"
        logger.warning("task %s (%s): %s", task.id, task.task_class, message)
        return Yield(message, delay=max(DEFAULT_RETRY_WAIT, int(client.read_timeout)))
    logger.warning("task %s (%s): %s", task.id, task.task_class, exc)
    return TemporaryFailure(str(exc))


class ConduitProxyHandler(BatchHandler):
    """Serves every task class without a native handler by calling Phorge's worker.execute.

    ``build_registry`` makes it the registry's fallback once Conduit is configured; it
    claims no ``task_classes`` of its own, so native handlers always come first. Up to
    ``batch`` tasks of a message go in one request (``run_batch``), and every request
    holds one of the worker's ``slots`` while it is in flight.
    """

    implementation = CONDUIT
    availability: Availability  # always one: the transport is Conduit
    # The PHP it runs is Phorge's on its web hosts, whose version this worker cannot see.
    version = None

    def __init__(
        self,
        client: ConduitClient,
        *,
        lease_overrides: Mapping[str, int] | None = None,
        batch: int = 1,
        slots: RequestSlots | None = None,
    ) -> None:
        self.client = client
        self.leases: dict[str, int] = {**PHORGE_REQUIRED_LEASES, **(lease_overrides or {})}
        self.availability = Availability(self.probe)
        self.batch_limit = batch
        self.slots = slots

    def probe(self) -> str | None:
        """The availability's probe: None when Conduit answers and accepts the token, else why not.

        ``user.whoami`` rather than ``conduit.ping``: Phorge answers ping without checking
        the token, so a revoked token would look healthy.
        """
        try:
            self.client.call(PROBE_METHOD, read_timeout=PROBE_TIMEOUT)
        except ConduitError as exc:
            return outage_reason(exc, self.client)
        return None

    def required_lease(self, task: TaskContext) -> int | None:
        return self.leases.get(task.task_class)

    def wait_before_retry(self, task: TaskContext) -> int | None:
        # Phorge's flat wait when PHP could not say (a 500, an unknown answer): the native
        # backoff is for native handlers.
        return max(DEFAULT_RETRY_WAIT, int(self.client.read_timeout))

    def _read_timeout(self, task: TaskContext) -> float:
        """Wait at least the configured read timeout; for a long-lease class, nearly the lease."""
        lease = self.required_lease(task)
        if lease is None:
            return self.client.read_timeout
        return max(self.client.read_timeout, float(lease - LEASE_MARGIN))

    def _execute(self, params: dict[str, Any], read_timeout: float, task: TaskContext) -> Any:
        """One ``worker.execute`` request, in one of the worker's slots."""
        with self.slots.slot() if self.slots is not None else nullcontext():
            return self.client.call(
                WORKER_EXECUTE, params, read_timeout=read_timeout, headers=trace_headers(task)
            )

    def _held_back(self) -> HandBack:
        return HandBack(f"held back while Conduit is unavailable: {self.availability.reason}")

    def run(self, task: TaskContext) -> None:
        if not self.availability.allow():
            raise self._held_back()
        try:
            result = self._execute(execute_params(task), self._read_timeout(task), task)
        except ConduitError as exc:
            raise conduit_failure(exc, task, self.client, self.availability) from None
        self.availability.success()
        self._check_lease(task, result)
        apply_result(task, result)

    def run_batch(self, tasks: Sequence[TaskContext]) -> list[Exception | None]:
        """The tasks in one request, each with its own outcome. A class with a long
        required lease goes alone (it would hold the others back for hours), and so does
        every task when the installed extension predates batches."""
        if self.batch_limit == 1 or any(self.required_lease(t) is not None for t in tasks):
            return run_each(self, tasks)
        if not self.availability.allow():
            return [self._held_back() for _ in tasks]
        params = {"tasks": [execute_params(task) for task in tasks]}
        try:
            answer = self._execute(params, self.client.read_timeout, tasks[0])
        except ConduitError as exc:
            if exc.error_code == ERR_PARAMETER and "taskID" in (exc.error_info or ""):
                logger.warning(
                    "the worker.execute installed at %s runs one task a request: its "
                    "extension predates batches (phorge-bridge phorge install-extension)",
                    self.client.base_url,
                )
                self.batch_limit = 1
                return run_each(self, tasks)
            failure = conduit_failure(exc, tasks[0], self.client, self.availability)
            return [failure for _ in tasks]
        self.availability.success()
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list) or len(results) != len(tasks):
            logger.error("worker.execute answered a batch of %d with %.200r", len(tasks), answer)
            wrong = TemporaryFailure(f"worker.execute answered a batch of {len(tasks)} wrongly")
            return [wrong for _ in tasks]
        return [self._ended(task, result) for task, result in zip(tasks, results, strict=True)]

    def _ended(self, task: TaskContext, result: Any) -> Exception | None:
        try:
            self._check_lease(task, result)
            apply_result(task, result)
        except Exception as exc:
            return exc
        return None

    def _check_lease(self, task: TaskContext, result: Any) -> None:
        if not isinstance(result, dict):
            return
        wanted = optional_int(result.get("requiredLease"))
        held = self.required_lease(task)
        if wanted is not None and wanted > (held if held is not None else DEFAULT_LEASE_SECONDS):
            logger.warning(
                "%s declares a required lease of %ss but the bridge held %s; add it to the "
                "proxy's lease overrides so a long run is not leased twice",
                task.task_class,
                wanted,
                f"{held}s" if held is not None else "the default lease",
            )
