"""OperatorActions: ``bin/worker``'s operator actions on Phorge's queue, as its PHP does them.

cancel, free, delay, priority and retry act on the tasks a ``TaskFilter`` selects, each
task in a transaction of its own, and report per task what they did or why not, in
``bin/worker``'s words (``ActionResult``); awaken is ``awakenTaskIDs``. None of them is
on a worker's path: ``PhorgeQueue`` runs that one, and these run through its
transactions (``PhorgeQueue.transaction``, retried through transient errors).

    actions = OperatorActions(queue)
    actions.cancel(TaskFilter(ids=[42]))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sqlalchemy import Connection

from bridge.queue import statements as sql
from bridge.queue.model import (
    RESULT_SUCCESS,
    ActionResult,
    Task,
    TaskFilter,
    check_priority,
    check_seconds,
)
from bridge.queue.phorge_queue import PhorgeQueue


class OperatorActions:
    """``bin/worker``'s actions on the tasks of one queue."""

    def __init__(self, queue: PhorgeQueue) -> None:
        self.queue = queue

    def _act(
        self,
        selector: TaskFilter,
        act: Callable[[Connection, Task], str],
    ) -> list[ActionResult]:
        if not selector.constrained:
            raise ValueError("select the tasks to act on (ids, classes, ...): refusing all tasks")
        results = []
        for task in self.queue.list(selector):
            # A def, not a lambda: mypy cannot type a lambda with defaults (mypy#15459).
            def work(conn: Connection, task: Task = task) -> str:
                return act(conn, task)

            reason = self.queue.transaction(work)
            results.append(ActionResult(task.id, task.label, not reason, reason))
        return results

    def cancel(self, selector: TaskFilter) -> list[ActionResult]:
        """Archive active tasks as cancelled (result 2), breaking any lease."""

        def act(conn: Connection, task: Task) -> str:
            if task.archived:
                return "ARCHIVED: already archived, and can not be cancelled"
            row = conn.execute(sql.lock_active(task.id)).first()
            if row is None:
                return "ARCHIVED: archived meanwhile"
            conn.execute(sql.cancel_archive(row))
            conn.execute(sql.delete_active(task.id))
            return ""

        return self._act(selector, act)

    def free(self, selector: TaskFilter) -> list[ActionResult]:
        """Break the leases of leased active tasks (owner NULL, expires now)."""

        def act(conn: Connection, task: Task) -> str:
            if task.archived:
                return "ARCHIVED: archived tasks do not have leases"
            if conn.execute(sql.free_lease(task.id)).rowcount != 1:
                return "FREE: has no active lease"
            return ""

        return self._act(selector, act)

    def delay(self, selector: TaskFilter, until: int) -> list[ActionResult]:
        """Hold unleased active tasks back until the epoch ``until``."""
        check_seconds("until", until)

        def act(conn: Connection, task: Task) -> str:
            if task.archived:
                return "ARCHIVED: already archived, and can not be delayed"
            if conn.execute(sql.delay_until(task.id, until)).rowcount != 1:
                return "LEASED: already leased, and can not be delayed"
            return ""

        return self._act(selector, act)

    def set_priority(self, selector: TaskFilter, priority: int) -> list[ActionResult]:
        """Reprioritize active tasks (a positive integer; smaller runs first)."""
        check_priority(priority)

        def act(conn: Connection, task: Task) -> str:
            if task.archived:
                return "ARCHIVED: already archived, and can not be reprioritized"
            if conn.execute(sql.set_priority(task.id, priority)).rowcount != 1:
                return f"UNCHANGED: already has priority {priority}"
            return ""

        return self._act(selector, act)

    def retry(self, selector: TaskFilter, repeat: bool = False) -> list[ActionResult]:
        """Re-queue archived tasks under their own id; succeeded ones only with ``repeat``."""

        def act(conn: Connection, task: Task) -> str:
            if not task.archived:
                return "ACTIVE: already in the active task queue"
            row = conn.execute(sql.lock_archived(task.id)).first()
            if row is None:
                return "ACTIVE: re-queued meanwhile"
            if row.result == RESULT_SUCCESS and not repeat:
                return "SUCCEEDED: already succeeded; use repeat to run it again"
            conn.execute(sql.reinsert_active(row))
            conn.execute(sql.delete_archived(task.id))
            return ""

        return self._act(selector, act)

    def awaken(self, ids: Sequence[int]) -> int:
        """Bring yielded, never-failed tasks forward (``awakenTaskIDs``); returns how many."""
        if not ids:
            return 0
        return self.queue.transaction(lambda conn: conn.execute(sql.awaken(ids)).rowcount)
