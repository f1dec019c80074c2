"""Worker liveness: a file refreshed only while the worker consumes from its broker.

A live process proves little: a worker can stay up, even connected, and consume nothing
(issue 11: kombu's Redis transport crashed the consumer after a broker restart while
beat went on sending polls). With ``celery -A bridge worker --liveness-file PATH`` the
worker's consumer sends itself a message through the broker every
``ALIVE_INTERVAL`` seconds, on a queue of its own node, and touches ``PATH`` when that
message comes back while it still consumes a task queue (or stands by on one on
purpose, ``bridge.runtime.standby``). The file stays fresh only while
the broker connection works both ways, the consumer's event loop takes messages and a
task consumer is there; ``phorge-bridge health`` turns its age into the exit status a
supervisor (docker, systemd) acts on.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, cast

import click
from celery import Celery, bootsteps
from kombu import Consumer, Exchange, Message, Producer, Queue

from bridge.runtime.standby import standing_by

log = logging.getLogger(__name__)

ALIVE_INTERVAL = 5.0  # seconds between two self-sent messages; health's --max-age must exceed it


class Liveness(bootsteps.ConsumerStep):
    """Consumer bootstep: heartbeat messages to the node's own queue refresh the file."""

    def __init__(self, parent: Any, liveness_file: str | None = None, **kwargs: Any) -> None:
        self.path = Path(liveness_file) if liveness_file else None
        self.enabled = self.path is not None
        self.timer_entry: Any = None
        self.worker_consumer: Any = None
        self.producer: Producer | None = None
        super().__init__(parent, **kwargs)

    def get_consumers(self, channel: Any) -> list[Consumer]:
        return [Consumer(channel, [self.queue], callbacks=[self.on_message], accept=["json"])]

    def start(self, c: Any) -> None:
        # A queue per node, gone with the node: no other worker can take its heartbeats.
        self.queue = Queue(
            f"bridge.alive.{c.hostname}",
            Exchange(""),
            routing_key=f"bridge.alive.{c.hostname}",
            durable=False,
            auto_delete=True,
            message_ttl=3 * ALIVE_INTERVAL,
            expires=10 * ALIVE_INTERVAL,
        )
        self.worker_consumer = c
        super().start(c)
        self.producer = Producer(c.connection.channel())
        self.timer_entry = c.timer.call_repeatedly(ALIVE_INTERVAL, self.send)
        self.send()

    def stop(self, c: Any) -> None:
        if self.timer_entry is not None:
            self.timer_entry.cancel()
            self.timer_entry = None
        self.producer = None
        super().stop(c)

    def _close(self, c: Any, cancel_consumers: bool = True) -> None:
        if c.connection is None:  # gone with the broker: nothing left to cancel or close
            self.consumers = None
            return
        # ``ConsumerStep._close`` is private: celery-types does not declare it.
        cast(Any, super())._close(c, cancel_consumers)

    def send(self) -> None:
        if self.producer is None:
            return
        try:
            self.producer.publish(
                {"sent": time.time()},
                exchange="",
                routing_key=self.queue.name,
                serializer="json",
                retry=False,
                expiration=3 * ALIVE_INTERVAL,
            )
        except Exception as exc:  # the consumer's own reconnection handles a lost broker
            log.warning("liveness heartbeat not sent: %s", exc)

    def on_message(self, _body: Any, message: Message) -> None:
        message.ack()
        task_consumer = getattr(self.worker_consumer, "task_consumer", None)
        consuming = task_consumer is not None and (task_consumer.queues or standing_by())
        if self.path is not None and consuming:
            self.path.touch()


def install(app: Celery) -> None:
    """Add the bootstep and the worker's ``--liveness-file`` option to ``app``."""
    app.steps["consumer"].add(Liveness)
    app.user_options["worker"].add(
        click.Option(
            ["--liveness-file"],
            default=None,
            help="Touch this file whenever a heartbeat sent through the broker comes back "
            "(see `phorge-bridge health`).",
        )
    )


def staleness(path: Path, max_age: float) -> str | None:
    """Why ``path`` shows no consumption within ``max_age`` seconds, or None when it does."""
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return f"{path} does not exist: the worker has not consumed a heartbeat yet"
    if age > max_age:
        return f"{path} is {age:.0f} s old (more than {max_age:g} s): the worker is not consuming"
    return None
