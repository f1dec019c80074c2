"""The Conduit proxy: runs task classes that only exist in PHP through ``worker.execute``.

The bridge keeps the lease and records the outcome; Phorge only runs the worker and says
how it ended. Problems reaching Phorge (network, timeouts, 5xx, a bad token, a missing
extension) are never the task's fault, so they become temporary failures (a yield while
Phorge is read-only): archiving a task permanently because of them would lose work an
operator can still save.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from bridge.handlers.api import (
    Handler,
    PermanentFailure,
    TaskContext,
    TemporaryFailure,
    Yield,
    stored_data,
)
from bridge.phorge.conduit import (
    ConduitAuthError,
    ConduitClient,
    ConduitError,
    ConduitMethodNotFoundError,
    ConduitTimeoutError,
    ConduitTransportError,
)
from bridge.queue.model import (
    DEFAULT_LEASE_SECONDS,
    DEFAULT_RETRY_WAIT,
    MIN_YIELD_SECONDS,
    Outcome,
)

logger = logging.getLogger(__name__)

WORKER_EXECUTE = "worker.execute"

ERR_READ_ONLY = "ERR-BRIDGE-READ-ONLY"  # raised by the extension in read-only mode
READ_ONLY_YIELD = 300

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


def raw_task_data(task: TaskContext) -> str:
    """The task's worker_taskdata.data string, untouched when the runtime provides it.

    PHP must decode the very bytes Phorge stored; re-encoding is only a fallback (it is
    lossless for JSON's values, Python ints being exact).
    """
    raw = stored_data(task)
    return raw if isinstance(raw, str) else json.dumps(task.data)


def execute_params(task: TaskContext) -> dict[str, Any]:
    """The ``worker.execute`` parameters for one leased task."""
    return {
        "taskID": task.id,
        "taskClass": task.task_class,
        "data": raw_task_data(task),
        "failureCount": task.failure_count,
        "priority": task.priority,
        "objectPHID": task.object_phid,
        "containerPHID": task.container_phid,
    }


def _optional_int(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _queue_followups(task: TaskContext, followups: Any) -> None:
    """Queue what the PHP worker queued; a malformed entry is logged and skipped, because
    failing here would re-run a worker that already succeeded."""
    if followups in (None, []):
        return
    if not isinstance(followups, list):
        logger.error("task %s: worker.execute returned malformed followups; ignored", task.id)
        return
    for entry in followups:
        if not isinstance(entry, dict) or not isinstance(entry.get("taskClass"), str):
            logger.error("task %s: malformed follow-up %r skipped", task.id, entry)
            continue
        options = entry.get("options")
        # PHP encodes an empty options array as [].
        if not isinstance(options, dict):
            options = {}
        try:
            task.queue_task(
                entry["taskClass"],
                entry.get("data"),
                priority=_optional_int(options.get("priority")),
                object_phid=options.get("objectPHID") or None,
                container_phid=options.get("containerPHID") or None,
                delay_until=_optional_int(options.get("delayUntil")) or None,
            )
        except ValueError as exc:  # the queue would refuse it when archiving the parent
            logger.error(
                "task %s: follow-up %.64s skipped, the queue refuses it: %s",
                task.id,
                entry["taskClass"],
                exc,
            )


def apply_result(task: TaskContext, result: Any) -> None:
    """Turn a ``worker.execute`` result into the handler outcome (return or raise).

    Its ``result`` is one of the queue's :class:`Outcome` values, as the extension sends.
    """
    if not isinstance(result, dict):
        raise TemporaryFailure(f"worker.execute returned {type(result).__name__}, not a dict")
    for warning in result.get("warnings") or ():
        logger.warning("task %s (%s): Phorge: %s", task.id, task.task_class, warning)
    outcome = result.get("result")
    message = result.get("message") or ""
    if outcome == Outcome.SUCCESS:
        logger.debug(
            "task %s (%s): PHP ran it in %s us", task.id, task.task_class, result.get("duration")
        )
        _queue_followups(task, result.get("followups"))
        return
    if outcome == Outcome.YIELD:
        seconds = _optional_int(result.get("yieldDuration")) or 0
        raise Yield(max(seconds, MIN_YIELD_SECONDS))
    if outcome == Outcome.PERMANENT_FAILURE:
        raise PermanentFailure(message or "permanent failure (no message)")
    if outcome == Outcome.FAILURE:
        raise TemporaryFailure(
            message or "failure (no message)", delay=_optional_int(result.get("retryWait"))
        )
    logger.error("task %s: worker.execute returned unknown result %r", task.id, outcome)
    raise TemporaryFailure(f"worker.execute returned an unknown result: {outcome!r}")


def conduit_failure(
    exc: ConduitError, task: TaskContext, client: ConduitClient
) -> TemporaryFailure | Yield:
    """The outcome for a Conduit problem (never permanent), logged as loudly as it deserves."""
    if exc.error_code == ERR_READ_ONLY:
        # Phorge cannot run anything now; the task is not at fault, so no failure is counted.
        logger.warning("task %s (%s): Phorge is read-only; yielding", task.id, task.task_class)
        return Yield(READ_ONLY_YIELD, str(exc))
    if isinstance(exc, ConduitAuthError):
        logger.error(
            "PHORGE REFUSED THE BRIDGE'S CONDUIT TOKEN (%s): task %s (%s) will be retried, but "
            "no PHP task can run until an operator fixes BRIDGE_CONDUIT_TOKEN (it must be an "
            "API token of an administrator account): %s",
            exc.error_code,
            task.id,
            task.task_class,
            exc.error_info,
        )
        return TemporaryFailure(str(exc))
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
        # PHP may still be running the worker; the retry wait keeps a second run apart.
        return TemporaryFailure(f"{exc} (the work may still be running in PHP)")
    if isinstance(exc, ConduitTransportError):
        logger.warning("task %s (%s): %s", task.id, task.task_class, exc)
        return TemporaryFailure(str(exc))
    logger.warning("task %s (%s): %s", task.id, task.task_class, exc)
    return TemporaryFailure(str(exc))


class ConduitProxyHandler(Handler):
    """Serves every task class without a native handler by calling Phorge's worker.execute.

    ``build_registry`` makes it the registry's fallback once Conduit is configured; it
    claims no ``task_classes`` of its own, so native handlers always come first.
    """

    def __init__(
        self,
        client: ConduitClient,
        *,
        lease_overrides: Mapping[str, int] | None = None,
    ) -> None:
        self.client = client
        self.leases: dict[str, int] = {**PHORGE_REQUIRED_LEASES, **(lease_overrides or {})}

    def required_lease(self, task: TaskContext) -> int | None:
        return self.leases.get(task.task_class)

    def wait_before_retry(self, task: TaskContext) -> int | None:
        # Phorge's flat wait when PHP could not say (transport, auth): the native backoff
        # is for native handlers; a timed-out call may still be running in PHP.
        return max(DEFAULT_RETRY_WAIT, int(self.client.read_timeout))

    def _read_timeout(self, task: TaskContext) -> float:
        """Wait at least the configured read timeout; for a long-lease class, nearly the lease."""
        lease = self.required_lease(task)
        if lease is None:
            return self.client.read_timeout
        return max(self.client.read_timeout, float(lease - LEASE_MARGIN))

    def run(self, task: TaskContext) -> None:
        try:
            result = self.client.call(
                WORKER_EXECUTE, execute_params(task), read_timeout=self._read_timeout(task)
            )
        except ConduitError as exc:
            raise conduit_failure(exc, task, self.client) from None
        self._check_lease(task, result)
        apply_result(task, result)

    def _check_lease(self, task: TaskContext, result: Any) -> None:
        if not isinstance(result, dict):
            return
        wanted = _optional_int(result.get("requiredLease"))
        held = self.required_lease(task)
        if wanted is not None and wanted > (held if held is not None else DEFAULT_LEASE_SECONDS):
            logger.warning(
                "%s declares a required lease of %ss but the bridge held %s; add it to the "
                "proxy's lease overrides so a long run is not leased twice",
                task.task_class,
                wanted,
                f"{held}s" if held is not None else "the default lease",
            )
