"""The embedded SQLite broker polls its queues every 50 ms, not kombu's second: the pace
keeps a queue's messages few, so a worker finds it empty often (``sqlite_broker``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from kombu import Connection
from sqlalchemy import create_engine, event, text

from bridge.runtime.sqlite_broker import POLLING_INTERVAL, Transport

PROBE = """
import json
from bridge.celery import app
with app.connection_for_write() as conn:
    queue = conn.SimpleQueue("probe")
    queue.put({"n": 1})
    message = queue.get(timeout=5)
    message.ack()
    print(json.dumps([type(conn.transport).__module__, conn.transport.polling_interval,
                      message.payload]))
"""


def test_the_default_broker_is_the_bridges_sqlite_transport(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("BRIDGE_")}
    env["BRIDGE_BROKER_URL"] = f"sqla+sqlite:///{tmp_path / 'broker.db'}"
    env["BRIDGE_DATABASE_URL"] = f"sqlite:///{tmp_path / 'queue.db'}"
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    module, interval, payload = json.loads(done.stdout.strip().splitlines()[-1])
    assert (module, interval) == ("bridge.runtime.sqlite_broker", POLLING_INTERVAL)
    assert POLLING_INTERVAL <= 0.05
    assert payload == {"n": 1}, "a message goes through it as through kombu's"


def test_a_queue_another_process_creates_meanwhile_is_used_not_a_crash(tmp_path):
    """A worker and a beat started together both declare the control queue: the one
    whose insert comes second finds the other's row (it crashed at start on the UNIQUE
    constraint). The other process is a second engine inserting just before ours."""
    path = tmp_path / "broker.db"
    with Connection(f"sqlite:///{path}", transport=Transport) as conn:  # as celeryconfig
        assert isinstance(conn.default_channel, Transport.Channel)
        channel = conn.default_channel
        channel._get_or_create("warm-up")  # the tables exist
        other = create_engine(f"sqlite:///{path}")
        raced: list[str] = []

        @event.listens_for(channel.session.get_bind(), "before_cursor_execute")
        def insert_first(_conn, _cursor, statement, *_args):
            if statement.startswith("INSERT INTO kombu_queue") and not raced:
                raced.append(statement)
                with other.begin() as theirs:
                    theirs.execute(text("INSERT INTO kombu_queue (name) VALUES ('control')"))

        created = channel._get_or_create("control")
        assert raced, "the other process's insert came first"
        assert created.name == "control"
        with other.connect() as theirs:
            rows = theirs.execute(text("SELECT count(*) FROM kombu_queue WHERE name='control'"))
            assert rows.scalar_one() == 1


def test_a_bounded_wait_on_an_empty_queue_ends_soon_so_the_worker_sends_its_acks(tmp_path):
    """Celery's loop for this transport sends the late acks its pool threads queued only
    when a wait ends: a wait of the full bound it asks for (2 s) left a worker with a
    spent prefetch slot, taking one task every two seconds."""
    url = f"sqlite:///{tmp_path / 'broker.db'}"
    with Connection(url, transport=Transport) as conn, conn.SimpleQueue("empty"):
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=60)
        assert time.monotonic() - started < 30, "the wait lasted the bound asked for"
