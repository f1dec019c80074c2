"""The handler API: the context, follow-ups, both forms, outcomes, the registry, the helper."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import select, update

from bridge import (
    BridgeError,
    Handler,
    NewTask,
    Outcome,
    PermanentFailure,
    TaskContext,
    TemporaryFailure,
    Yield,
    handler,
)
from bridge.assembly import build_registry, instantiate
from bridge.config import load_settings
from bridge.engine import run_task
from bridge.engine.context import Runtime
from bridge.errors import DuplicateHandlerError
from bridge.handlers.api import stored_data
from bridge.handlers.outcome import policy, run_handler
from bridge.handlers.phabricator import PhabricatorTestWorker
from bridge.handlers.registry import Registry
from bridge.handlers.testing import run
from bridge.queue import PhorgeQueue
from bridge.queue.model import PRIORITY_DEFAULT
from bridge.queue.schema import worker_activetask as active

TOKEN = "api-" + "a" * 28


def context(priority: int = 1500, **fields) -> TaskContext:
    return TaskContext(
        id=1, task_class="MyWorker", data={}, failure_count=0, priority=priority, **fields
    )


# -- TaskContext and follow-ups ----------------------------------------------------------------


def test_the_context_shows_phorges_fields_and_keeps_the_stored_json_internal():
    ctx = context(object_phid="PHID-TASK-1", raw_data='{"a":1}')
    assert (ctx.object_phid, ctx.container_phid) == ("PHID-TASK-1", None)
    assert stored_data(ctx) == '{"a":1}'
    assert "raw" not in repr(ctx)
    # The lease owner is only what the run was given (issue 23): none here, so the
    # idempotency key names no lease; given one, the key is the task's and the lease's.
    assert ctx.lease_owner is None
    leased = context(lease_owner="bridge:1:1700000000:h:1")
    assert leased.idempotency_key == "phorge-task:1:bridge:1:1700000000:h:1"


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
    assert task.followups == ()


def test_a_followup_inherits_the_parents_priority_unless_given():
    task = context(priority=1500)
    task.queue_task("Child", {"n": 1})
    task.queue_task("Child", {"n": 2}, priority=4000, object_phid="PHID-X", delay_until=5)
    assert task.followups == (
        NewTask("Child", {"n": 1}),
        NewTask("Child", {"n": 2}, 4000, "PHID-X", None, 5),
    )
    assert [f.with_default_priority(task.priority).priority for f in task.followups] == [
        1500,
        4000,
    ]


@pytest.mark.parametrize("parent_priority", [0, -5])
def test_a_parent_with_an_invalid_priority_can_still_queue_followups(parent_priority):
    task = context(priority=parent_priority)
    task.queue_task("Child", {})
    assert task.followups == (NewTask("Child", {}),)


# -- outcomes ----------------------------------------------------------------------------------


class Scripted(Handler):
    task_classes = ("Scripted",)

    def __init__(self, raise_: BaseException | None = None, wait: object = None) -> None:
        self.raise_, self.wait = raise_, wait

    def wait_before_retry(self, task: TaskContext) -> int | None:
        return self.wait  # type: ignore[return-value]

    def run(self, task: TaskContext) -> None:
        task.queue_task("Child", {"from": task.id})
        if self.raise_ is not None:
            raise self.raise_


@pytest.mark.parametrize(
    ("handler_", "outcome", "delay", "reason"),
    [
        (Scripted(), Outcome.SUCCESS, None, ""),
        (Scripted(Yield(delay=30)), Outcome.YIELD, 30, ""),
        (Scripted(PermanentFailure("bad data")), Outcome.PERMANENT_FAILURE, None, "bad data"),
        (Scripted(PermanentFailure()), Outcome.PERMANENT_FAILURE, None, "PermanentFailure"),
        (Scripted(TemporaryFailure("down", delay=90), wait=10), Outcome.FAILURE, 90, "down"),
        (Scripted(TemporaryFailure("down"), wait=10), Outcome.FAILURE, 10, "down"),
        (Scripted(RuntimeError("boom"), wait=10), Outcome.FAILURE, 10, "boom"),
        (Scripted(RuntimeError("boom")), Outcome.FAILURE, None, "boom"),
        (Scripted(RuntimeError("boom"), wait="soon"), Outcome.FAILURE, None, "boom"),
    ],
)
def test_run_handler_classifies_how_the_run_ended(handler_, outcome, delay, reason):
    result = run_handler(handler_, context())
    assert (result.outcome, result.delay, result.reason) == (outcome, delay, reason)
    assert result.duration_us >= 0
    # Follow-ups are written only with a success.
    assert result.followups == ((NewTask("Child", {"from": 1}),) if outcome == "success" else ())


@pytest.mark.parametrize("answer", [-1, True, "soon", 1.5e300 * 1e300])
def test_a_nonsense_policy_answer_means_the_default(answer, caplog):
    with caplog.at_level(logging.WARNING):
        assert policy(lambda task: answer, context()) is None
    assert "using the default" in caplog.text


def test_a_policy_hook_that_raises_means_the_default():
    def broken(task: TaskContext) -> int:
        raise KeyError("getMaximumRetryCount")

    assert policy(broken, context()) is None
    assert policy(lambda task: "7", context()) == 7


# -- the decorator -------------------------------------------------------------------------------


def test_the_decorator_makes_a_handler_with_fixed_policies():
    @handler("A", "B", maximum_retry_count=5, wait_before_retry=60)
    def work(task: TaskContext) -> None:
        """Does the work."""
        task.queue_task("Child", task.data)

    assert isinstance(work, Handler) and work.task_classes == ("A", "B")
    ctx = context()
    assert (work.maximum_retry_count(ctx), work.wait_before_retry(ctx)) == (5, 60)
    assert work.required_lease(ctx) is None
    assert work.__doc__ == "Does the work." and work.name.endswith(":" + work.__qualname__)
    work(ctx)  # still callable as the function it was
    assert ctx.followups == (NewTask("Child", {}),)


def test_the_decorator_needs_a_task_class():
    with pytest.raises(TypeError):
        handler()


# -- the registry --------------------------------------------------------------------------------


@handler("Shared")
def first(task: TaskContext) -> None: ...


@handler("Shared")
def second(task: TaskContext) -> None: ...


def test_two_handlers_for_one_class_are_refused_naming_both():
    with pytest.raises(DuplicateHandlerError) as refused:
        Registry([first, second])
    assert isinstance(refused.value, BridgeError)
    assert "Shared" in str(refused.value)
    assert first.name in str(refused.value) and second.name in str(refused.value)


def test_an_entry_point_may_name_a_class_an_instance_or_a_factory():
    settings = load_settings({})
    seen = []

    def factory(settings_, conduit):
        seen.append((settings_, conduit))
        return [first, Scripted()]

    assert [type(h) for h in instantiate(Scripted, settings, None)] == [Scripted]
    assert instantiate(first, settings, None) == [first]
    assert instantiate(lambda s, c: first, settings, None) == [first]
    assert instantiate(factory, settings, None)[0] is first
    assert seen == [(settings, None)]
    with pytest.raises(BridgeError):
        instantiate(lambda s, c: ["not a handler"], settings, None)
    with pytest.raises(BridgeError):
        instantiate(42, settings, None)


def test_build_registry_adds_the_conduit_handlers_only_when_conduit_is_configured():
    plain = build_registry(load_settings({}))
    assert plain.handler_for("PhabricatorTestWorker") is not None  # the installed entry point
    assert plain.handler_for("FeedPublisherHTTPWorker") is None
    assert plain.handler_for("PhabricatorSearchWorker") is None  # left to PHP
    env = {"BRIDGE_CONDUIT_URL": "https://phorge.example", "BRIDGE_CONDUIT_TOKEN": TOKEN}
    env["BRIDGE_HANDLERS_EXCLUDE"] = "Harbormaster*"
    proxied = build_registry(load_settings(env))
    assert type(proxied.handler_for("FeedPublisherHTTPWorker")).__name__ == (
        "FeedPublisherHTTPHandler"
    )
    assert proxied.handler_for("PhabricatorSearchWorker") is proxied.fallback
    assert proxied.handler_for("HarbormasterTargetWorker") is None


# -- the testing helper --------------------------------------------------------------------------


def test_the_helper_runs_on_data_as_phorge_stores_it():
    seen = []

    @handler("Seen")
    def record(task: TaskContext) -> None:
        seen.append(task)

    result = run(record, {"ids": (1, 2)}, failure_count=3)
    assert result.outcome == Outcome.SUCCESS
    (task,) = seen
    assert (task.task_class, task.data, task.failure_count) == ("Seen", {"ids": [1, 2]}, 3)
    assert (task.priority, stored_data(task)) == (PRIORITY_DEFAULT, '{"ids":[1,2]}')
    with pytest.raises(ValueError, match="JSON"):
        run(record, {1, 2})


def test_a_handler_standing_in_for_a_phorge_class_keeps_phorges_flat_wait():
    failed = run(PhabricatorTestWorker(), {"doWork": "fail-temporary"}, failure_count=4)
    assert (failed.outcome, failed.delay) == (Outcome.FAILURE, 300)

    @handler("ExampleWorker")
    def own(task: TaskContext) -> None:
        raise RuntimeError("down")

    assert run(own, {}).delay is None  # the bridge's backoff, for classes Phorge lacks


def test_negative_waits_pass_through_as_phorge_applies_them():
    data = {"doWork": "fail-temporary", "getWaitBeforeRetry": -60}
    assert run(PhabricatorTestWorker(), data).delay == -60


# -- the helper ends a run as a worker does ------------------------------------------------------


class Policied(Handler):
    """A handler with a retry limit and a required lease, ending as ``end`` says; it
    counts its runs and calls ``during`` in each."""

    task_classes = ("Policied",)

    def __init__(
        self, limit: int | None = None, lease: object = None, end: Exception | None = None
    ) -> None:
        self.limit, self.lease, self.end = limit, lease, end
        self.runs = 0
        self.during: Callable[[TaskContext], None] = lambda task: None

    def maximum_retry_count(self, task: TaskContext) -> int | None:
        return self.limit

    def required_lease(self, task: TaskContext) -> int | None:
        return self.lease  # type: ignore[return-value]

    def run(self, task: TaskContext) -> None:
        self.runs += 1
        self.during(task)
        if self.end is not None:
            raise self.end


def worker_with(tmp_path: Path, handler: Handler) -> Runtime:
    """A worker's runtime on SQLite that serves ``handler`` alone."""
    settings = load_settings({"BRIDGE_DATABASE_URL": f"sqlite:///{tmp_path}/q.db"})
    queue = PhorgeQueue.from_url(settings.database_url)
    queue.create_tables()
    return Runtime(settings, queue, Registry([handler]))


def lease_left(rt: Runtime, task_id: int) -> int:
    with rt.queue.engine.connect() as conn:
        expires = conn.execute(select(active.c.leaseExpires).where(active.c.id == task_id))
        return int(expires.scalar_one() - time.time())


@pytest.mark.parametrize(
    ("make", "failure_count", "outcome", "delay"),
    [
        (lambda: Policied(limit=5), 6, Outcome.PERMANENT_FAILURE, None),
        (lambda: Policied(limit=5), 5, Outcome.SUCCESS, None),
        (lambda: Policied(end=Yield(delay=1)), 0, Outcome.YIELD, 5),
        (lambda: Policied(end=Yield(delay=-60)), 0, Outcome.YIELD, 5),
        (lambda: Policied(end=Yield(delay=30)), 0, Outcome.YIELD, 30),
        (lambda: Policied(end=TemporaryFailure("down", delay=90)), 2, Outcome.FAILURE, 90),
        (lambda: Policied(end=PermanentFailure("bad data")), 0, Outcome.PERMANENT_FAILURE, None),
    ],
    ids=["past-the-limit", "at-the-limit", "short-yield", "negative-yield", "yield", "fail", "bad"],
)
def test_the_helper_ends_a_run_as_a_worker_does(
    tmp_path: Path, make, failure_count: int, outcome: Outcome, delay: int | None
):
    tested, worked = make(), make()
    rt = worker_with(tmp_path, worked)
    task_id = rt.queue.enqueue("Policied", {})
    with rt.queue.engine.begin() as conn:
        conn.execute(update(active).values(failureCount=failure_count))
    [task] = rt.queue.lease(1, 60)
    ran = run_task(rt, task.lease)
    result = run(tested, {}, failure_count=failure_count, task_id=task_id)
    assert (result.outcome, result.delay) == (outcome, delay)
    assert (ran.outcome, ran.wait, ran.reason) == (result.outcome, result.delay, result.reason)
    if failure_count > 5:  # refused its run, in both
        assert "has exceeded the maximum number of failures (5)" in result.reason
    assert tested.runs == worked.runs == (0 if failure_count > 5 else 1)


@pytest.mark.parametrize(("asked", "required"), [(120, 120), (5, 5), (-1, None), (None, None)])
def test_the_helper_reports_the_lease_a_worker_claims_before_the_run(
    tmp_path: Path, asked: object, required: int | None
):
    worked = Policied(lease=asked)
    rt = worker_with(tmp_path, worked)
    claimed: list[int] = []
    worked.during = lambda task: claimed.append(lease_left(rt, task.id))
    rt.queue.enqueue("Policied", {})
    [task] = rt.queue.lease(1, 60)
    assert run_task(rt, task.lease).outcome is Outcome.SUCCESS
    # Whole seconds left on the database clock, read during the run: a loaded machine may
    # take a few seconds from the lease to the run (60, the poll's lease, stays far apart).
    claim = required or 60
    assert claim - 4 <= claimed[0] <= claim
    assert run(Policied(lease=asked), {}).required_lease == required
    refused = run(Policied(limit=0, lease=asked), {}, failure_count=1)
    assert (refused.outcome, refused.required_lease) == (Outcome.PERMANENT_FAILURE, None)
