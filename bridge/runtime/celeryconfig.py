"""Celery's settings for phorge-bridge, derived from the ``BRIDGE_*`` settings.

Importing it raises ``ConfigError`` (naming the setting) when a setting is bad.
"""

from kombu import Exchange, Queue

from bridge.config import current_settings

_settings = current_settings()

broker_url = _settings.broker_url
broker_connection_retry_on_startup = True
# After a lost broker connection, running tasks go on: their leases (renewed by the
# heartbeat) keep a redelivered copy from running twice, and cancelling them would only
# throw their work away. Survival of broker restarts is pinned in pyproject.toml (Celery
# below 5.7); a worker that still stops consuming fails `phorge-bridge health`.
worker_cancel_long_running_tasks_on_connection_loss = False
# MySQL is the source of truth; results would only duplicate the archive table.
task_ignore_result = True
task_serializer = "json"
accept_content = ["json"]
# Polls and the guard are acked as they start. ``bridge.execute`` and
# ``bridge.execute_batch`` are acked when they end (``acks_late`` and
# ``reject_on_worker_lost`` on the tasks, ``bridge.runtime.tasks``): a worker that dies
# mid-run has its message redelivered at once, and the copy hands back each lease whose
# run lock no live process holds (``bridge.engine.redelivery``), never running it under
# the same lease. RabbitMQ's ``consumer_timeout`` (30 min by default) must outlast the
# longest run, or the broker closes the channel of a long one (its copy then finds the
# run alive and leaves it be).
task_acks_late = False
worker_prefetch_multiplier = 1
# With --autoscale, Celery's scale-down could kill a task just started (issue 29); the
# bridge's autoscaler shrinks the pool only while it holds no task.
worker_autoscaler = "bridge.runtime.autoscale:Autoscaler"
# RabbitMQ gives up on a vanished worker host's connection (and requeues its unacked
# messages, whose copies hand the dead runs' leases back) after about two heartbeats:
# 5 s (the low end of the 5-20 s RabbitMQ recommends) makes that about 10 s, not the
# 240 s of Celery's default 120 s. Only the worker's consuming connection negotiates
# heartbeats (Celery's event loop sends them); producers' connections go without.
broker_heartbeat = 5
# Redis re-delivers unacked messages after visibility_timeout: it must outlast any lease,
# or a long task would be delivered twice (the fence would then drop the second copy).
if broker_url.startswith("redis"):
    broker_transport_options = {"visibility_timeout": max(3 * _settings.default_lease, 3600)}
# kombu polls a database broker for messages, once a second while its queues are empty;
# the poller keeps them short (bridge.engine.pace), so each time a queue drained a
# message would wait that second. The transport's own class says how often it polls
# (its transport options all go to SQLAlchemy's create_engine): the URL's "sqla+"
# scheme would pick kombu's, so the bridge names its subclass instead.
elif broker_url.startswith("sqla+"):
    broker_url = broker_url.removeprefix("sqla+")
    broker_transport = "bridge.runtime.sqlite_broker:Transport"

# One direct exchange per queue, so a routing key never reaches two queues.
task_queues = [
    Queue(name, Exchange(name, type="direct"), routing_key=name)
    for name in (_settings.control_queue, *_settings.router.queues)
]
task_default_queue = _settings.router.default_queue
task_routes = {
    "bridge.poll": {"queue": _settings.control_queue},
    "bridge.canary_guard": {"queue": _settings.control_queue},
}
# The schedule is two intervals: nothing worth a file, so beat keeps it in memory and
# leaves no celerybeat-schedule behind.
beat_scheduler = "bridge.runtime.beat:PollScheduler"
beat_schedule = {
    "poll-phorge-queue": {
        "task": "bridge.poll",
        "schedule": _settings.poll_interval,
        # RabbitMQ drops a poll that waited ten intervals (newer ones wait behind it), so a
        # worker back from an outage does not work through hours of polls. A TTL the
        # broker keeps, not Celery's `expires`, which compares the beat host's clock with
        # the worker's. Redis ignores it: there a stale poll costs one poll.
        "options": {"expiration": 10 * _settings.poll_interval},
    },
}
if _settings.canary:
    # The canary's guard (bridge.canary.guard): one read of the weights while no
    # class is shared. Sent, like the polls, only by the beat holding the beat lock. The
    # polls' TTL: RabbitMQ drops an expired message only at the head of the queue, so a
    # longer-lived guard ahead of them would keep every poll behind it waiting.
    beat_schedule["canary-guard"] = {
        "task": "bridge.canary_guard",
        "schedule": _settings.canary_guard_interval,
        "options": {"expiration": 10 * _settings.poll_interval},
    }

worker_send_task_events = _settings.task_events
task_send_sent_event = _settings.task_events
