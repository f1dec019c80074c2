"""``phorge-bridge execute``: run selected tasks now, in this process (``bin/worker execute``).

As in Phorge, an archived task runs only with ``--retry`` (a succeeded one also needs
``--repeat``) and is unarchived first, and a task held back (delayed, yielded, waiting to
retry, or with an expired lease) is made due first. Unlike Phorge, which ignores leases,
a task a worker holds a live lease on is refused: running it here would run it twice
(``phorge-bridge free`` first, if that worker is gone). Each task is then leased by id
and run by ``bridge.engine.batch.run_task``, the path a worker takes, native or
proxied, and its outcome is written as a worker would write it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from bridge.engine.batch import run_task
from bridge.engine.context import Runtime
from bridge.engine.tracing import TaskTrace, new_traceparent, traced
from bridge.queue import OperatorActions, Outcome, PhorgeQueue
from bridge.queue.model import RESULT_SUCCESS, State, Task, TaskFilter


def ordered(tasks: list[Task], ids: Sequence[int] | None) -> list[Task]:
    """In the order of ``--id`` when given, else by id (Phorge: "somewhat FIFO")."""
    if ids:
        by_id = {t.id: t for t in tasks}
        return [by_id[i] for i in dict.fromkeys(ids) if i in by_id]
    return sorted(tasks, key=lambda t: t.id)


def make_due(queue: PhorgeQueue, task: Task, retry: bool, repeat: bool) -> str | None:
    """Make ``task`` active and due, as ``bin/worker execute`` does (unarchive it with
    ``retry``, end its delay, yield or wait); returns why it is not executed, or None
    once it is ready to lease."""
    one = TaskFilter(ids=[task.id])
    actions = OperatorActions(queue)
    if task.archived:
        if not retry:
            return "ARCHIVED: already archived, and will not be executed; use --retry"
        if task.result == RESULT_SUCCESS and not repeat:
            return "SUCCEEDED: already succeeded, and will not be retried; use --repeat"
        [unarchived] = actions.retry(one, repeat=True)
        if not unarchived.done:
            return unarchived.reason
        return None
    if task.state is State.LEASED:
        return (
            f"LEASED: a worker holds its lease ({task.lease_owner}) until {task.lease_expires}; "
            f"if that worker is gone, `phorge-bridge free --id {task.id}` first"
        )
    if task.state is State.DELAYED:
        actions.delay(one, until=queue.server_time())
    elif task.state in (State.YIELDED, State.RETRY_WAIT):
        actions.free(one)
    return None


def execute_tasks(
    rt: Runtime, selector: TaskFilter, retry: bool, repeat: bool, echo: Callable[[str], None]
) -> bool:
    """Run the selected tasks one by one, echoing one line each; True when all succeeded."""
    queue = rt.queue
    tasks = ordered(queue.list(selector), selector.ids)
    if selector.ids:
        found = {t.id for t in tasks}
        missing = [i for i in selector.ids if i not in found]
        if missing:
            raise ValueError(f'No task with ID "{missing[0]}" matches the constraints!')
    all_done = True
    for task in tasks:
        reason = make_due(queue, task, retry, repeat)
        if reason is not None:
            echo(f"{task.label}: {reason}")
            all_done = all_done and reason.startswith(("ARCHIVED", "SUCCEEDED"))
            continue
        leased = queue.lease(
            1, rt.settings.dispatch_lease, owner_prefix=rt.settings.owner_prefix, ids=[task.id]
        )
        if not leased:
            echo(f"{task.label}: LEASED: another consumer leased it meanwhile")
            all_done = False
            continue
        lease = leased[0]
        trace = TaskTrace(lease.id, lease.task_class, lease.lease.owner, new_traceparent())
        with traced(trace):
            report = run_task(rt, lease.lease, None, trace.traceparent, lease.task_class)
        echo(f"{report.describe(lease.label)} [traceparent={trace.traceparent}]")
        all_done = all_done and report.outcome is Outcome.SUCCESS
    return all_done
