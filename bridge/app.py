"""The Celery app: configured from ``celeryconfig``, with the poller and executor tasks."""

from celery import Celery

app = Celery("bridge", include=["bridge.poller", "bridge.execute", "bridge.lifecycle"])
app.config_from_object("celeryconfig")
