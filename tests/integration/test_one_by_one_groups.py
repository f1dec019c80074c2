"""A message's tasks of a handler that runs them one by one with one commit for their
outcomes (the PHP runner), and tasks whose transport is down, on MariaDB.

Each task of such a group is checked just before it runs, so its lease budget counts
from its own start and a task freed or cancelled meanwhile does not start (issue 31,
item 2); the group's outcomes still share one commit. A task whose handler's transport
is down is handed back at once: no owner, no failure counted, due for another worker.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from sqlalchemy import BigInteger, Engine, cast, select, update

from bridge.config import load_settings
from bridge.engine.batch import Batch
from bridge.engine.context import Runtime
from bridge.handlers.api import TaskContext
from bridge.handlers.availability import Availability
from bridge.handlers.capabilities import TransportHandler
from bridge.handlers.registry import Registry
from bridge.queue import Outcome, PhorgeQueue, make_engine
from bridge.queue.dialect import db_now
from bridge.queue.model import RESULT_SUCCESS, Leased
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_archivetask as archive

pytestmark = pytest.mark.mariadb

CLASS = "BridgeOneByOneWorker"


class OneByOne(TransportHandler):
    """Runs its tasks one by one (no ``run_batch`` of its own), their outcomes one commit.

    Data: ``sleep`` seconds, ``lease`` (its required lease), ``free`` (an id to hand back
    as an operator would, while this task runs). Each run records the seconds of lease
    its row had left as it started, read from the database."""

    task_classes = (CLASS,)
    batch_limit = 16

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.left: dict[int, int] = {}
        self.availability: Availability | None = None

    def required_lease(self, task: TaskContext) -> int | None:
        return task.data.get("lease")

    def run(self, task: TaskContext) -> None:
        self.left[task.id] = -1  # started; its lease's seconds left follow
        with self.engine.begin() as conn:
            expires = conn.execute(
                select(cast(active.c.leaseExpires, BigInteger) - db_now()).where(
                    active.c.id == task.id
                )
            ).scalar_one()
            self.left[task.id] = -1 if expires is None else int(expires)
            if "free" in task.data:
                conn.execute(
                    update(active)
                    .where(active.c.id == task.data["free"])
                    .values(leaseOwner=None, leaseExpires=None)
                )
        time.sleep(task.data.get("sleep", 0))


@pytest.fixture
def rt(mysql_engine: Engine) -> Iterator[Runtime]:
    url = mysql_engine.url.render_as_string(hide_password=False)
    settings = load_settings({"BRIDGE_DATABASE_URL": url, "BRIDGE_BROKER_URL": "amqp://x//"})
    engine = make_engine(url)
    registry = Registry([OneByOne(engine)])
    runtime = Runtime(settings, PhorgeQueue(engine), registry)
    yield runtime
    engine.dispose()


def handler(rt: Runtime) -> OneByOne:
    found = rt.registry.handler_for(CLASS)
    assert isinstance(found, OneByOne)
    return found


def leased(rt: Runtime, *data: dict, seconds: int = 60) -> tuple[str, list[Leased]]:
    ids = [rt.queue.enqueue(CLASS, d) for d in data]
    tasks = {t.id: t for t in rt.queue.lease(len(ids), seconds, ids=ids)}
    [owner] = {t.lease_owner for t in tasks.values()}
    return owner or "", [Leased(i, 0, CLASS) for i in ids]


def outcomes(batch: Batch) -> dict[int, Outcome]:
    """Each task's outcome (recorded as written: a group's all at once, at its end)."""
    return {item.id: ran.outcome for item, ran, _ in batch.reports}


def test_a_later_task_gets_its_required_lease_from_its_own_start(rt: Runtime) -> None:
    """The first task outlasts the second's required lease: claimed at the group's start,
    that lease would have expired before the second task ran."""
    owner, items = leased(rt, {"sleep": 3}, {"lease": 2})
    batch = Batch(rt, owner, None)
    batch.run(items)
    assert outcomes(batch) == dict.fromkeys([item.id for item in items], Outcome.SUCCESS)
    later = items[1].id
    assert handler(rt).left[later] >= 1, "the second task ran on a lease already spent"
    with rt.queue.engine.connect() as conn:
        results = conn.execute(select(archive.c.id, archive.c.result)).all()
    assert sorted(results) == sorted((item.id, RESULT_SUCCESS) for item in items)


def test_a_task_freed_while_its_group_runs_does_not_start(rt: Runtime) -> None:
    """The first task hands the second back as an operator would (``bin/worker free``)."""
    second = rt.queue.enqueue(CLASS, {})
    first = rt.queue.enqueue(CLASS, {"free": second})
    [owner] = {t.lease_owner for t in rt.queue.lease(2, 60, ids=[first, second])}
    batch = Batch(rt, owner or "", None)
    batch.run([Leased(first, 0, CLASS), Leased(second, 0, CLASS)])
    assert outcomes(batch) == {first: Outcome.SUCCESS, second: Outcome.LEASE_LOST}
    assert second not in handler(rt).left, "a freed task started"


def test_a_task_whose_transport_is_down_is_handed_back_at_once(rt: Runtime) -> None:
    transport = handler(rt)
    transport.availability = Availability(lambda: "PHP is missing")
    transport.availability.failure("PHP is missing")
    owner, items = leased(rt, {}, {})
    batch = Batch(rt, owner, None)
    batch.run(items)
    assert outcomes(batch) == dict.fromkeys([item.id for item in items], Outcome.HANDED_BACK)
    assert transport.left == {}, "a task ran while its transport was down"
    with rt.queue.engine.connect() as conn:
        rows = conn.execute(select(active).where(active.c.id.in_([i.id for i in items]))).all()
    assert [(r.leaseOwner, r.leaseExpires, r.failureCount) for r in rows] == [(None, None, 0)] * 2
    assert {t.id for t in rt.queue.lease(2, 60, classes=[CLASS])} == {i.id for i in items}
