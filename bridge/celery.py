"""Where ``celery -A bridge`` finds the app (Celery looks up ``<package>.celery``)."""

from bridge.app import app

__all__ = ["app"]
