"""A worker whose transport is down says so, and stops consuming a queue it can run
nothing of, for a while (issue 31).

A task process whose transport is down hands its tasks back (``bridge.engine.run``) and
tells its own worker, through Celery's remote control (the ``bridge_standby`` command,
addressed to its node alone), which transport is down and until when: the worker's
announcement then says so (``bridge.runtime.announce``), so the fleet's polls stop
leasing for it. When the process can run none of the classes queued for that Celery
queue, the worker also cancels its consumer of the queue until the transport is due to
probe again, then consumes it again by itself; the next message it takes probes the
transport, and either runs or starts another standby. Other workers, meanwhile, take
every message. Brokers without remote control (kombu's SQLAlchemy transport, the
embedded default) only hand back. What each process knows of it is its runtime's
:class:`~bridge.engine.outages.Outages`.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from celery import Celery, current_task
from celery.worker.control import control_command

from bridge.assembly import runtime
from bridge.engine.observers import RunObserver, observe
from bridge.engine.outages import UNREAD, Resume
from bridge.engine.reports import RunReport
from bridge.engine.sides import PHD_SHARE
from bridge.queue import Outcome
from bridge.queue.model import Leased
from bridge.runtime.announce import remote_control

log = logging.getLogger(__name__)

COMMAND = "bridge_standby"


def standing_by() -> list[str]:
    """Queues this worker stopped consuming on purpose (liveness counts them consumed)."""
    return list(runtime().outages.standing_by)


@control_command(
    args=[("queue", str), ("seconds", float), ("transport", str), ("stop", bool)],
    signature="<queue> <seconds> <transport> <stop>",
)
def bridge_standby(
    state: Any, queue: str, seconds: float, transport: str, stop: bool, **_: Any
) -> dict[str, str]:
    """``transport`` is down here for ``seconds`` (empty: none is, the weights are
    unread); with ``stop``, stop consuming ``queue`` that long (a later request extends
    it)."""
    outages = runtime().outages
    if transport != UNREAD:
        outages.heard(transport, float(seconds))
    if stop:
        consumer = state.consumer
        consumer.call_soon(_stand_by, consumer, outages.standing_by, queue, float(seconds))
    why = f"{transport} down" if transport != UNREAD else "the canary's weights unread"
    return {"ok": f"{why} for {seconds:g} s" + (f", standing by on {queue}" if stop else "")}


def _stand_by(consumer: Any, standing: dict[str, Resume], queue: str, seconds: float) -> None:
    entry = standing.pop(queue, None)
    if entry is not None:
        entry.cancel()
    elif consumer.task_consumer is not None and consumer.task_consumer.consuming_from(queue):
        log.warning(
            "queue %s: this worker can run none of its tasks now; not consuming it for %.0f s",
            queue,
            seconds,
        )
        consumer.cancel_task_queue(queue)
    else:
        return  # not consumed here (an operator cancelled it): nothing to resume later
    standing[queue] = consumer.timer.call_after(seconds, lambda: _resume(consumer, standing, queue))


def _resume(consumer: Any, standing: dict[str, Resume], queue: str) -> None:
    standing.pop(queue, None)
    queues = consumer.app.amqp.queues
    if queue in queues:
        queues.select_add(queues[queue])  # so a reconnection consumes it too
    consumer.add_task_queue(queue)


class Standby(RunObserver):
    """Hears the hand-backs of a task process and tells its worker."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._remote: bool | None = None

    def run_ended(self, item: Leased, report: RunReport) -> None:
        # A new-side run of a shared class falls back where it would be handed back.
        given_back = report.outcome in (Outcome.HANDED_BACK, Outcome.FALLBACK)
        if not given_back or item.task_class is None:
            return
        node = getattr(getattr(current_task, "request", None), "hostname", None)
        if not node or not self.remote_control():
            return
        rt = runtime()
        if report.reason == PHD_SHARE:
            canary, seconds = rt.canary.current(), rt.settings.canary_refresh
            told = rt.outages.report_unread(item.task_class, rt.queue.task_classes, canary, seconds)
        else:
            told = rt.outages.report(item.task_class, rt.queue.task_classes)
        if told is None:
            return
        try:
            self.app.control.broadcast(COMMAND, arguments=asdict(told), destination=[node])
        except Exception as exc:  # the broker's trouble: the hand-back itself is done
            log.warning("could not tell %s to stand by on %s: %s", node, told.queue, exc)

    def remote_control(self) -> bool:
        if self._remote is None:
            self._remote = remote_control(self.app)
        return self._remote


def install(app: Celery) -> None:
    """Hear this app's runs (the commands are registered by importing the modules)."""
    observe(Standby(app))
