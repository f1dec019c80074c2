"""kombu's SQLAlchemy transport (the embedded ``sqla+sqlite://`` broker), polling its
queues every 50 ms rather than every second: the poller keeps the broker's queues short,
so a worker finds them empty often, and would otherwise wait a second each time.

Its channel creates a queue's row safely across processes: kombu's guards the insert
with a lock of its own process only, so a worker and a beat started together (each
declaring the control queue) could both insert it, and the loser's start crashed on
the UNIQUE constraint.

Its waits are short: a worker on a transport without an event loop (Celery's
``synloop``) sends the acks its pool threads ask for only between two waits, and
``bridge.execute`` is acked late, so a worker that waited the full two seconds Celery
asks for sat on a spent prefetch slot and took one task every two seconds."""

from __future__ import annotations

from typing import Any

from kombu import Connection
from kombu.transport.sqlalchemy import Channel as SQLAlchemyChannel
from kombu.transport.sqlalchemy import Transport as SQLAlchemyTransport
from sqlalchemy.exc import IntegrityError

POLLING_INTERVAL = 0.05  # seconds between two reads of an empty queue
WAIT_AT_MOST = 0.1  # seconds one wait for a message lasts, so pending acks go out


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

    def drain_events(  # type: ignore[override]  # the stubs of the two bases disagree
        self, connection: Connection, timeout: float | None = None
    ) -> None:
        """Wait as asked, but no longer than :data:`WAIT_AT_MOST` when a bound is given:
        the caller's loop (Celery's ``synloop``) sends its pending acks when this
        returns."""
        if timeout is not None:
            timeout = min(timeout, WAIT_AT_MOST)
        super().drain_events(connection, timeout=timeout)
