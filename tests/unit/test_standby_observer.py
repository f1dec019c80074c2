"""The worker hears its task processes' hand-backs for a transport that is down
(``bridge.runtime.standby.Standby``), a canary's fallback for one included: a
new-side run of a shared class whose runner cannot boot falls back instead of being
handed back, and its worker must still stand by. A run that succeeded, or a class no
transport of this worker serves, tells nothing."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from bridge.engine.outages import Outages
from bridge.engine.reports import RunReport
from bridge.handlers.availability import Availability
from bridge.handlers.capabilities import TransportHandler
from bridge.handlers.registry import Registry
from bridge.queue import Outcome
from bridge.queue.implementations import RUNNER
from bridge.queue.model import Leased
from bridge.routing import Router
from bridge.runtime import standby

CLASS = "PhabricatorSearchWorker"


class Runner(TransportHandler):
    implementation = RUNNER

    def run(self, task: Any) -> None:
        raise AssertionError("not run here")


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> tuple[standby.Standby, list[dict[str, Any]]]:
    """The Standby of a worker whose PHP runner cannot boot, and what it broadcasts."""
    runner = Runner()
    runner.availability = Availability(lambda: "PHP cannot boot")
    runner.availability.failure("PHP cannot boot")
    registry = Registry([], runner=runner, runner_classes=("Phabricator*",))
    router = Router((), "php")
    # The active table read as empty: no standby, the report alone (its "stop" False).
    rt = SimpleNamespace(
        outages=Outages(registry, router), queue=SimpleNamespace(task_classes=list)
    )
    monkeypatch.setattr(standby, "runtime", lambda: rt)
    monkeypatch.setattr(
        standby, "current_task", SimpleNamespace(request=SimpleNamespace(hostname="w@h"))
    )
    sent: list[dict[str, Any]] = []
    app = SimpleNamespace(
        control=SimpleNamespace(broadcast=lambda _c, arguments, destination: sent.append(arguments))
    )
    observer = standby.Standby(app)  # type: ignore[arg-type]
    observer._remote = True  # a broker with remote control
    return observer, sent


@pytest.mark.parametrize("outcome", [Outcome.HANDED_BACK, Outcome.FALLBACK])
def test_a_hand_back_or_a_fallback_for_a_transport_down_puts_the_worker_on_standby(
    worker: tuple[standby.Standby, list[dict[str, Any]]], outcome: Outcome
) -> None:
    observer, told = worker
    observer.run_ended(Leased(1, 0, CLASS), RunReport(outcome, "held back"))
    assert [(t["queue"], t["transport"], t["stop"]) for t in told] == [("php", RUNNER, False)]


def test_a_success_or_a_class_not_served_here_tells_nothing(
    worker: tuple[standby.Standby, list[dict[str, Any]]],
) -> None:
    observer, told = worker
    observer.run_ended(Leased(1, 0, CLASS), RunReport(Outcome.SUCCESS))
    observer.run_ended(Leased(2, 0, "NotServedHere"), RunReport(Outcome.HANDED_BACK))
    assert told == []
