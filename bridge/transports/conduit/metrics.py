"""The Conduit proxy's gauge: whether its availability holds PHP-only tasks back."""

from __future__ import annotations

from prometheus_client import Gauge

from bridge.handlers.availability import Availability

CONDUIT_BREAKER_OPEN = Gauge(
    "phorge_bridge_conduit_breaker_open",
    "1 while Conduit's circuit breaker holds PHP-only tasks back (max over processes)",
    multiprocess_mode="livemax",
)


def watch(availability: Availability) -> None:
    """Show Conduit's ``availability`` in :data:`CONDUIT_BREAKER_OPEN`."""
    CONDUIT_BREAKER_OPEN.set(int(availability.is_down))
    availability.listeners.append(lambda down: CONDUIT_BREAKER_OPEN.set(int(down)))
