"""``phorge-bridge execute``: run selected tasks now, in this process (``bin/worker execute``).

As in Phorge, an archived task runs only with ``--retry`` (a succeeded one also needs
``--repeat``) and is unarchived first, and a task held back (delayed, yielded, waiting to
retry, or with an expired lease) is made due first. Unlike Phorge, which ignores leases,
a task a worker holds a live lease on is refused: running it here would run it twice
(``phorge-bridge free`` first, if that worker is gone). Each task is then leased by id
and run by ``bridge.runtime.execute.run_task``, the path a worker takes, native or
proxied, and its outcome is written as a worker would write it.
"""

from __future__ import annotations

from collections.abc import Callable

from bridge.queue import Lease, Outcome, PhorgeQueue
from bridge.queue.model import RESULT_SUCCESS, State, Task, TaskFilter, new_owner
from bridge.runtime.context import Runtime
from bridge.runtime.execute import run_task
from bridge.runtime.tracing import TaskTrace, new_traceparent, traced


def ordered(tasks: list[Task], ids: tuple[int, ...] | None) -> list[Task]:
    """In the order of ``--id`` when given, else by id (Phorge: "somewhat FIFO")."""
    if ids:
        by_id = {t.id: t for t in tasks}
        return [by_id[i] for i in dict.fromkeys(ids) if i in by_id]
    return sorted(tasks, key=lambda t: t.id)


def refusal(queue: PhorgeQueue, task: Task, retry: bool, repeat: bool) -> str | None:
    """Why ``task`` is not executed, or None once it is active and due."""
    one = TaskFilter(ids=[task.id])
    if task.archived:
        if not retry:
            return "ARCHIVED: already archived, and will not be executed; use --retry"
        if task.result == RESULT_SUCCESS and not repeat:
            return "SUCCEEDED: already succeeded, and will not be retried; use --repeat"
        [unarchived] = queue.retry(one, repeat=True)
        if not unarchived.done:
            return unarchived.reason
        return None
    if task.state is State.LEASED:
        return (
            f"LEASED: a worker holds its lease ({task.leaseOwner}) until {task.leaseExpires}; "
            f"if that worker is gone, `phorge-bridge free --id {task.id}` first"
        )
    if task.state is State.DELAYED:
        queue.delay(one, until=queue.server_time())
    elif task.state in (State.YIELDED, State.RETRY_WAIT):
        queue.free(one)
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
        reason = refusal(queue, task, retry, repeat)
        if reason is not None:
            echo(f"{task.label}: {reason}")
            all_done = all_done and reason.startswith(("ARCHIVED", "SUCCEEDED"))
            continue
        owner = new_owner(rt.settings.owner_prefix, queue.server_time())
        leased = queue.lease(1, owner, rt.settings.dispatch_lease, ids=[task.id])
        if not leased:
            echo(f"{task.label}: LEASED: another consumer leased it meanwhile")
            all_done = False
            continue
        held = leased[0]
        trace = TaskTrace(held.id, held.taskClass, owner, new_traceparent())
        with traced(trace):
            lease = Lease(held.id, owner, held.failureCount)
            ran = run_task(rt, lease, None, trace.traceparent, held.taskClass)
        echo(f"{ran.describe(held.label)} [traceparent={trace.traceparent}]")
        all_done = all_done and ran.outcome is Outcome.SUCCESS
    return all_done
