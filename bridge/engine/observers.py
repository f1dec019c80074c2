"""The engine's events, for whatever measures it (metrics, the benchmark kit, standby).

The engine imports no metrics library: it tells every :class:`RunObserver` added with
:func:`observe` what happened, and ``bridge.metrics`` turns that into Prometheus series.
Each event is a method doing nothing here; override the ones you need.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bridge.engine.reports import RunReport
    from bridge.handlers.outcome import HandlerResult
    from bridge.queue import Lease
    from bridge.queue.model import Leased


class RunObserver:
    """Hears the runs of this process."""

    def run_started(self, lease: Lease) -> None:
        """The run's check is done and the handler is about to be looked up."""

    def handler_returned(
        self, task_class: str, wall_seconds: float, result: HandlerResult, implementation: str
    ) -> None:
        """A handler call ended: its wall time here (a call for several tasks: each one's
        share), what it reported (``result.duration_us``: the run time archived; a new
        side's failure as the fallback written instead) and what ran it (``native``,
        ``runner`` or ``conduit``)."""

    def run_ended(self, item: Leased, report: RunReport) -> None:
        """The run's outcome was written (or why none was is known); ``report.
        implementation`` names who ran it."""

    def outcome_unwritten(self, item: Leased, result: HandlerResult) -> None:
        """The database did not take an outcome (the run ends unreported)."""

    def lease_renewed(self, result: str) -> None:
        """A lease extension (a required lease claimed, a heartbeat): ``renewed``,
        ``lost`` or ``error``."""

    def writes_refused(self, refused: bool) -> None:
        """The database started (True) or stopped (False) refusing this process's writes."""


_observers: list[RunObserver] = []


def observe(observer: RunObserver) -> Callable[[], None]:
    """Add ``observer`` to every run of this process; returns what removes it."""
    _observers.append(observer)
    return lambda: _observers.remove(observer)


def observers() -> list[RunObserver]:
    return _observers
