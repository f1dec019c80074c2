"""Every error the bridge raises on purpose lives in ``bridge.errors``, under ``BridgeError``,
and is importable from ``bridge``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import bridge
from bridge import errors
from bridge.errors import BridgeError

DECLARED = {
    name: cls
    for name, cls in vars(errors).items()
    if inspect.isclass(cls) and cls.__module__ == errors.__name__
}


def test_each_error_is_a_bridge_error_exported_from_bridge():
    assert "Yield" in DECLARED and "WritesRefused" in DECLARED and "RunnerDied" in DECLARED
    for name, cls in DECLARED.items():
        assert issubclass(cls, BridgeError), name
        assert getattr(bridge, name) is cls, name
        assert name in bridge.__all__, name


def test_no_module_of_the_bridge_defines_an_error_of_its_own():
    """A module may offer an error under its old name (``bridge.queue.retry``'s
    ``WritesRefused``), but only ``bridge.errors`` defines one."""
    elsewhere = []
    for module in pkgutil.walk_packages(bridge.__path__, "bridge."):
        if module.name.endswith(".__main__"):  # runs the CLI
            continue
        for name, value in vars(importlib.import_module(module.name)).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BridgeError)
                and value.__module__ != errors.__name__
            ):
                elsewhere.append(f"{module.name}.{name}")
    assert elsewhere == []


def test_the_old_import_paths_still_work():
    from bridge.handlers.api import HandBack, PermanentFailure, TemporaryFailure, Yield
    from bridge.phorge.conduit import ConduitAuthError, ConduitTransportError
    from bridge.phorge.extension import PhorgeRootError
    from bridge.phorge.runner_process import RunnerBootError, RunnerDied, RunnerTimedOut
    from bridge.queue.retry import DatabaseUnavailable, WritesRefused

    moved = [HandBack, PermanentFailure, TemporaryFailure, Yield, ConduitAuthError]
    moved += [ConduitTransportError, PhorgeRootError, RunnerBootError, RunnerDied]
    moved += [RunnerTimedOut, DatabaseUnavailable, WritesRefused]
    assert all(DECLARED[cls.__name__] is cls for cls in moved)
