"""The embedded SQLite broker polls its queues every 50 ms, not kombu's second: the pace
keeps a queue's messages few, so a worker finds it empty often (``sqlite_broker``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bridge.runtime.sqlite_broker import POLLING_INTERVAL

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
