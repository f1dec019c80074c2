"""Beat's polls that no worker takes expire in RabbitMQ instead of piling up.

Beat sends a poll every ``BRIDGE_POLL_INTERVAL`` whether or not a worker consumes the
control queue. Without a TTL, a worker back from an hour's outage would first work
through 14,400 polls (at the default 0.25 s).
"""

from __future__ import annotations

from bridge_harness import POLL_SENT
from kombu import Connection

POLL_INTERVAL = 0.05  # the TTL is ten intervals: 0.5 s
SENT = 100  # polls beat must have sent: 5 s of them, ten times what one TTL holds


def waiting(amqp_url: str, queue: str) -> int:
    with Connection(amqp_url, connect_timeout=5) as conn:
        return conn.default_channel.queue_declare(queue, passive=True).message_count


def test_polls_no_worker_takes_expire_in_rabbitmq(make_bridge, database_url, amqp_url):
    bridge = make_bridge(database_url, amqp_url, POLL_INTERVAL=str(POLL_INTERVAL))
    beat = bridge.beat(level="DEBUG")

    bridge.wait_until(
        lambda: beat.log().count(POLL_SENT) >= SENT, 120, f"beat to send {SENT} polls"
    )
    # Only polls younger than the TTL wait; a loaded machine sends fewer, never more.
    assert waiting(amqp_url, bridge.control_queue) <= SENT // 2
    assert beat.running()
