"""The bridge's error hierarchy: one root, so callers can catch what the bridge raises on purpose.

``ConfigError`` is also a ``ValueError`` (a bad value is what it is), and names the setting
first, so the last line of any traceback says which variable to fix.
"""

from __future__ import annotations


class BridgeError(Exception):
    """Root of every error the bridge raises deliberately."""


class ConfigError(BridgeError, ValueError):
    """A ``BRIDGE_*`` setting that cannot be used; ``str()`` is ``"NAME: problem"``."""

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"{setting}: {problem}")
        self.setting = setting
        self.problem = problem


class DuplicateHandlerError(BridgeError):
    """Two handlers claim one task class: which one runs must not depend on load order."""
