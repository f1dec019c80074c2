"""What each worker tells the fleet's polls: the queues it consumes, the classes it can
run, and which of its transports are down.

A poll runs in whichever worker takes ``bridge.poll``; what that process can run itself
must not decide what the fleet leases (issue 29: a small control worker without PHP
beside PHP workers that scale; issue 31: a worker whose PHP is broken beside healthy
ones). Each worker's main process answers the remote-control command ``bridge_serves``
with its :class:`Announcement`; :func:`bridge.runtime.consumers.survey` gathers them, in
the same round as the consumers it already asked for, at most every 15 s.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from celery import Celery
from celery.worker.control import inspect_command

from bridge.assembly import runtime
from bridge.handlers.registry import Coverage, version_key

log = logging.getLogger(__name__)

COMMAND = "bridge_serves"


@dataclass(frozen=True)
class Announcement:
    """One live worker: the task queues it consumes now (not those it stands by on),
    what it serves, its transports that are down (``runner``, ``conduit``), and the version
    of what serves each class (``Registry.versions``; none from a worker of a release
    before versions were announced)."""

    node: str
    queues: tuple[str, ...]
    coverage: Coverage
    down: tuple[str, ...] = ()
    versions: Mapping[str, str] = field(default_factory=dict, hash=False)

    def version_for(self, task_class: str, transport: str) -> str | None:
        """The version of ``transport`` serving ``task_class`` on this worker."""
        return self.versions.get(version_key(transport, task_class))

    def runs(self, task_class: str, queue: str) -> bool:
        """Whether this worker would run ``task_class`` if a message of it reached
        ``queue`` now."""
        transport = self.coverage.transport_for(task_class)
        return queue in self.queues and transport is not None and transport not in self.down

    @classmethod
    def from_reply(cls, node: str, reply: Any) -> Announcement:
        """Read a worker's answer; raises ValueError when it is not one."""
        if not isinstance(reply, dict):
            raise ValueError(f"not an announcement: {reply!r}")
        try:
            queues, down = tuple(reply["queues"]), tuple(reply["down"])
            versions = {str(k): str(v) for k, v in reply.get("versions", {}).items()}
        except (AttributeError, KeyError, TypeError) as exc:
            raise ValueError(f"not an announcement: {reply!r}") from exc
        return cls(node, queues, Coverage.from_dict(reply.get("coverage")), down, versions)


def consumed_queues(consumer: Any) -> list[str]:
    """The task queues a worker's consumer consumes now (not those it stands by on)."""
    task_consumer = consumer.task_consumer
    return [queue.name for queue in task_consumer.queues] if task_consumer else []


@inspect_command()
def bridge_serves(state: Any, **_: Any) -> dict[str, Any]:
    """This worker's announcement, answered by its main process."""
    rt = runtime()
    return {
        "queues": consumed_queues(state.consumer),
        "coverage": rt.registry.coverage().as_dict(),
        "down": rt.outages.announced_down(),
        "versions": rt.registry.versions(),
    }


def remote_control(app: Celery) -> bool:
    """Whether the broker carries remote control (a fanout exchange: not kombu's
    SQLAlchemy transport, the embedded default)."""
    with app.connection_for_read() as connection:
        return "fanout" in connection.transport.implements.exchange_type


def announcements(app: Celery, timeout: float) -> dict[str, Announcement] | None:
    """Every live worker's announcement by node, or None when the transport cannot
    broadcast (nobody would answer). Raises kombu's OperationalError when the broker is
    unreachable; a worker whose answer makes no sense is left out, with a warning."""
    if not remote_control(app):
        return None
    replies = app.control.broadcast(COMMAND, reply=True, timeout=timeout) or []
    found: dict[str, Announcement] = {}
    for reply in replies:
        for node, answer in reply.items():
            try:
                found[node] = Announcement.from_reply(node, answer)
            except ValueError as exc:
                log.warning(
                    "worker %s answered %s oddly (another version?): %s", node, COMMAND, exc
                )
    return found
