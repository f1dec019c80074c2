"""kombu's SQLAlchemy transport (the embedded ``sqla+sqlite://`` broker), polling its
queues every 50 ms rather than every second: the poller keeps the broker's queues short,
so a worker finds them empty often, and would otherwise wait a second each time."""

from __future__ import annotations

from kombu.transport.sqlalchemy import Transport as SQLAlchemyTransport

POLLING_INTERVAL = 0.05  # seconds between two reads of an empty queue


class Transport(SQLAlchemyTransport):
    polling_interval = POLLING_INTERVAL
