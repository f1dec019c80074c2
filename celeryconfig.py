"""Celery's settings for phorge-bridge, derived from the ``BRIDGE_*`` environment.

Celery loads this module by name (``app.config_from_object("celeryconfig")``), so an
operator can shadow it with their own ``celeryconfig.py`` on the path. A bad setting
stops the process here, at start, naming the setting.
"""

import sys

from kombu import Exchange, Queue

from bridge.config import ConfigError, current_settings

try:
    _settings = current_settings()
except ConfigError as exc:
    sys.exit(f"phorge-bridge: configuration error: {exc}")

broker_url = _settings.broker_url
broker_connection_retry_on_startup = True
# MySQL is the source of truth; results would only duplicate the archive table.
task_ignore_result = True
task_serializer = "json"
accept_content = ["json"]
# A message is acked after its task ran, and re-queued if the worker died under it: the
# lease owner in the message, not the broker, decides whether anything runs again.
task_acks_late = True
task_reject_on_worker_lost = True
worker_prefetch_multiplier = 1
# Redis re-delivers unacked messages after visibility_timeout: it must outlast any lease,
# or a long task would be delivered twice (the fence would then drop the second copy).
if broker_url.startswith("redis"):
    broker_transport_options = {"visibility_timeout": max(3 * _settings.default_lease, 3600)}

# One direct exchange per queue, so a routing key never reaches two queues.
task_queues = [
    Queue(name, Exchange(name, type="direct"), routing_key=name)
    for name in (_settings.control_queue, *_settings.router.queues)
]
task_default_queue = _settings.router.default_queue
task_routes = {"bridge.poll": {"queue": _settings.control_queue}}
beat_schedule = {
    "poll-phorge-queue": {
        "task": "bridge.poll",
        "schedule": _settings.poll_interval,
        # A poll that waited longer than its interval is stale: the next one is coming.
        "options": {"expires": max(_settings.poll_interval, 1.0)},
    }
}

worker_send_task_events = _settings.task_events
task_send_sent_event = _settings.task_events
