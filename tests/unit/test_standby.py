"""When a worker stands by on a queue, and when its polls lease for the others (SQLite)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge.assembly import build_runtime
from bridge.canary.weights import CLOSED, Canary, ClassWeights
from bridge.config import load_settings
from bridge.engine.context import Runtime
from bridge.engine.outages import MIN_STANDBY, UNREAD, Report
from bridge.engine.poll import plan
from bridge.handlers.api import TaskContext
from bridge.handlers.availability import Availability
from bridge.handlers.capabilities import TransportHandler, availability_of

PHP_ONLY = "PhabricatorSearchWorker"
NATIVE = "PhabricatorTestWorker"  # the shipped native handler


class Transport(TransportHandler):
    """Stands for the PHP runner: every class no native handler claims, behind its
    availability."""

    def __init__(self) -> None:
        self.availability = Availability(lambda: "PHP is missing", min_backoff=3, max_backoff=3)

    def run(self, task: TaskContext) -> None:
        raise AssertionError("not run here")


def runtime(directory: Path, routes: str) -> Runtime:
    """A runtime (its queue in ``directory``) whose default queue is ``php``, with a
    transport to break at will."""
    settings = load_settings(
        {
            "BRIDGE_DATABASE_URL": f"sqlite:///{directory}/queue.db",
            "BRIDGE_DEFAULT_QUEUE": "php",
            "BRIDGE_ROUTES": routes,
        }
    )
    runtime = build_runtime(settings)
    runtime.registry.fallback = Transport()
    runtime.registry._served.clear()
    return runtime


@pytest.fixture
def rt(tmp_path: Path) -> Runtime:
    return runtime(tmp_path, f"{NATIVE}=native")  # only the native class elsewhere


@pytest.fixture
def one_queue(tmp_path: Path) -> Runtime:
    """Every class on the queue ``php``."""
    (tmp_path / "one").mkdir()
    return runtime(tmp_path / "one", "")


def transport(rt: Runtime) -> Availability:
    assert rt.registry.fallback is not None
    availability = availability_of(rt.registry.fallback)
    assert availability is not None
    return availability


def standby_seconds(rt: Runtime, queue: str) -> float | None:
    """How long the worker stands by on ``queue``, as its runtime's outages say."""
    return rt.outages.standby_queues(rt.queue.task_classes()).get(queue)


def test_a_queue_whose_classes_all_go_through_a_down_transport_is_stood_by(rt: Runtime) -> None:
    rt.queue.enqueue(PHP_ONLY, {})
    rt.queue.enqueue(NATIVE, {})  # routed to another queue: no reason to consume "php"
    assert standby_seconds(rt, "php") is None, "its transport is up"
    transport(rt).failure("PHP is missing")
    seconds = standby_seconds(rt, "php")
    assert seconds is not None and MIN_STANDBY <= seconds <= 3
    assert standby_seconds(rt, "native") is None, "the native handler runs those"


def test_a_queue_with_a_class_this_worker_can_run_is_not_stood_by(one_queue: Runtime) -> None:
    rt = one_queue
    rt.queue.enqueue(PHP_ONLY, {})
    rt.queue.enqueue(NATIVE, {})
    transport(rt).failure("PHP is missing")
    assert standby_seconds(rt, "php") is None


def test_a_poll_leases_for_other_workers_only_where_this_one_stands_by(
    rt: Runtime, one_queue: Runtime
) -> None:
    rt.queue.enqueue(PHP_ONLY, {})
    transport(rt).failure("PHP is missing")
    assert plan(rt) == {}, "alone, a worker leases nothing it cannot run"
    assert plan(rt, lambda task_class, queue: False) == {}, "nobody else runs it"
    assert plan(rt, lambda task_class, queue: queue == "php") == {"php": [PHP_ONLY]}
    # Sharing the queue with a class it runs, it goes by its own transport: a fleet whose
    # transport is down everywhere must not lease what every worker hands back.
    mixed = one_queue
    mixed.queue.enqueue(PHP_ONLY, {})
    mixed.queue.enqueue(NATIVE, {})
    transport(mixed).failure("PHP is missing")
    assert plan(mixed, lambda task_class, queue: True) == {"php": [NATIVE]}


def test_a_poll_asks_once_which_queues_this_worker_stands_by_on(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    for task_class in (PHP_ONLY, "PhabricatorRepositoryWorker", "PhabricatorMailWorker"):
        rt.queue.enqueue(task_class, {})
    transport(rt).failure("PHP is missing")
    asked = []
    standby_queues = rt.outages.standby_queues
    monkeypatch.setattr(
        rt.outages, "standby_queues", lambda p: asked.append(p) or standby_queues(p)
    )
    assert len(plan(rt, lambda task_class, queue: True)["php"]) == 3
    assert len(asked) == 1, "once a poll, not once a class"


def test_a_worker_announces_a_transport_down_until_its_latest_report_ends(rt: Runtime) -> None:
    outages = rt.outages
    outages.heard("runner", 60)
    outages.heard("runner", 0)  # a shorter report does not shorten the announcement
    outages.heard("conduit", 0)
    assert outages.announced_down() == ["runner"]


SHARED = Canary({PHP_ONLY: ClassWeights(celery=50)})  # half the class is phd's


def test_a_worker_that_cannot_read_the_weights_stands_by_where_it_hands_everything_back(
    rt: Runtime,
) -> None:
    """Unread, the shared class's tasks are all handed back as phd's share: its queue is
    stood by until the weights are due to be read again (at least MIN_STANDBY), told
    once a standby; read, it is not."""
    rt.queue.enqueue(PHP_ONLY, {})
    present = rt.queue.task_classes
    assert rt.outages.report_unread(PHP_ONLY, present, SHARED, 5) is None, "it read them"
    told = rt.outages.report_unread(PHP_ONLY, present, SHARED.closed(), 0.2)
    assert told == Report("php", MIN_STANDBY, UNREAD, True)
    assert rt.outages.report_unread(PHP_ONLY, present, SHARED.closed(), 5) is None, "told"


def test_a_worker_that_cannot_read_the_weights_consumes_a_queue_with_a_class_it_runs(
    one_queue: Runtime,
) -> None:
    """The native class is wholly the bridge's, and shares the queue: the closed weights
    leave it to this worker, so the queue is consumed; before any read, none is left."""
    rt = one_queue
    rt.queue.enqueue(PHP_ONLY, {})
    rt.queue.enqueue(NATIVE, {})
    present = rt.queue.task_classes
    assert rt.outages.report_unread(PHP_ONLY, present, SHARED.closed(), 5) is None
    assert rt.outages.report_unread(PHP_ONLY, present, CLOSED, 5) == Report("php", 5, UNREAD, True)
