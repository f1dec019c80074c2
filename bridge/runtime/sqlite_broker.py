"""kombu's SQLAlchemy transport (the embedded ``sqla+sqlite://`` broker), polling its
queues every 50 ms rather than every second: the poller keeps the broker's queues short,
so a worker finds them empty often, and would otherwise wait a second each time.

Its channel creates a queue's row safely across processes: kombu's guards the insert
with a lock of its own process only, so a worker and a beat started together (each
declaring the control queue) could both insert it, and the loser's start crashed on
the UNIQUE constraint."""

from __future__ import annotations

from typing import Any

from kombu.transport.sqlalchemy import Channel as SQLAlchemyChannel
from kombu.transport.sqlalchemy import Transport as SQLAlchemyTransport
from sqlalchemy.exc import IntegrityError

POLLING_INTERVAL = 0.05  # seconds between two reads of an empty queue


class Channel(SQLAlchemyChannel):
    def _get_or_create(self, queue: str) -> Any:
        try:
            return super()._get_or_create(queue)  # type: ignore[misc]  # untyped in the stubs
        except IntegrityError:  # another process inserted it between our read and ours
            self.session.rollback()
            return super()._get_or_create(queue)  # type: ignore[misc]  # untyped in the stubs


class Transport(SQLAlchemyTransport):
    Channel = Channel
    polling_interval = POLLING_INTERVAL
