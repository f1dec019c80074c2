"""The Celery app, where ``celery -A bridge`` looks for it (Celery's ``proj/celery.py``).

Celery's settings come from ``bridge.runtime.celeryconfig``, or from the module named
by ``CELERY_CONFIG_MODULE`` (which can star-import ours and override a few). They are
loaded here, at once, so a bad ``BRIDGE_*`` setting stops ``celery`` at start, naming
the setting, before any connection is made: in one line, as ``phorge-bridge`` says it,
where Celery's command would print its usage and a traceback. Only this module builds
the app: the rest of the bridge registers on whatever app
:func:`bridge.runtime.install` is given.
"""

import click
from celery import Celery

from bridge.errors import ConfigError
from bridge.runtime import install


def loaded_by_celery_command() -> bool:
    """Whether Celery's command line (``celery -A bridge ...``) is loading this module."""
    ctx = click.get_current_context(silent=True)
    return ctx is not None and ctx.find_root().command.name == "celery"


app = Celery("bridge")
try:
    app.config_from_object("bridge.runtime.celeryconfig", force=True)
    app.config_from_envvar("CELERY_CONFIG_MODULE", silent=True, force=True)
except ConfigError as exc:
    if loaded_by_celery_command():  # which catches exceptions, but not an exit
        raise SystemExit(f"Error: configuration error: {exc}") from None
    raise
install(app)  # the tasks, worker hooks and `celery -A bridge worker --liveness-file PATH`
