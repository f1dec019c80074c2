"""The handler API: follow-ups are checked when a handler queues them, not after it ran."""

from __future__ import annotations

import pytest

from bridge.handlers.base import FollowUp, TaskContext


def context(priority: int = 1500) -> TaskContext:
    return TaskContext(id=1, taskClass="MyWorker", data={}, failureCount=0, priority=priority)


@pytest.mark.parametrize(
    ("args", "options"),
    [
        (("", {}), {}),
        (("C" * 65, {}), {}),
        (("Child", {}), {"priority": 0}),
        (("Child", {1, 2}), {}),
        (("Child", {}), {"object_phid": "P" * 65}),
        (("Child", {}), {"delay_until": 2**32}),
    ],
)
def test_a_followup_the_queue_would_refuse_is_refused_when_queued(args, options):
    task = context()
    with pytest.raises(ValueError):
        task.queue_task(*args, **options)
    assert task.followups == []


def test_a_followup_inherits_the_parents_priority_unless_given():
    task = context(priority=1500)
    task.queue_task("Child", {"n": 1})
    task.queue_task("Child", {"n": 2}, priority=4000, object_phid="PHID-X", delay_until=5)
    assert task.followups == [
        FollowUp("Child", {"n": 1}),
        FollowUp("Child", {"n": 2}, 4000, "PHID-X", None, 5),
    ]
    assert [f.as_new_task(task.priority).priority for f in task.followups] == [1500, 4000]
