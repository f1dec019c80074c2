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
    """A module may offer an error under another name (``bridge.handlers.api``'s
    ``Yield``), but only ``bridge.errors`` defines one."""
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


def test_the_handler_api_still_offers_the_outcome_exceptions():
    """Handlers import the outcome exceptions from ``bridge.handlers.api`` (its explicit
    re-exports); every other error is imported from ``bridge.errors`` (or ``bridge``)."""
    from bridge.handlers.api import HandBack, PermanentFailure, TemporaryFailure, Yield

    moved = [HandBack, PermanentFailure, TemporaryFailure, Yield]
    assert all(DECLARED[cls.__name__] is cls for cls in moved)
