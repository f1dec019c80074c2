"""The Celery app, where ``celery -A bridge`` looks for it (Celery's ``proj/celery.py``).

Celery's settings come from ``bridge.runtime.celeryconfig``, or from the module named
by ``CELERY_CONFIG_MODULE`` (which can star-import ours and override a few). They are
loaded here, at once, so a bad ``BRIDGE_*`` setting stops ``celery`` at start, naming
the setting, before any connection is made. Only this module builds the app: the rest
of the bridge registers on whatever app :func:`bridge.runtime.install` is given.
"""

from celery import Celery

from bridge.runtime import install

app = Celery("bridge")
app.config_from_object("bridge.runtime.celeryconfig", force=True)
app.config_from_envvar("CELERY_CONFIG_MODULE", silent=True, force=True)
install(app)  # the tasks, worker hooks and `celery -A bridge worker --liveness-file PATH`
