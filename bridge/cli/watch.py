"""``stats --watch``: how fast a backlog drains, and when it will be gone.

Each refresh reads the queue's counts (one ``PhorgeQueue.stats``: the database only, not
the broker). The backlog is the active rows less the delayed ones, which wait for their
date whatever the workers do; its net fall over the last refreshes is the drain rate,
and the backlog over that rate the ETA. New tasks arriving count against the rate: a
backlog that grows says so.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from bridge.cli.tasks import span
from bridge.queue.model import QueueStats, State

RATE_SAMPLES = 12  # the rate is taken over this many refreshes (a minute at 5 s)
NOT_BACKLOG = (State.DELAYED.value,)


@dataclass(frozen=True)
class Sample:
    at: float  # monotonic seconds
    server_time: int
    by_state: dict[str, int]

    @property
    def backlog(self) -> int:
        return sum(n for state, n in self.by_state.items() if state not in NOT_BACKLOG)


def sample(stats: QueueStats, at: float) -> Sample:
    """The active rows per state (every class) of one ``stats`` reading."""
    by_state: dict[str, int] = {}
    for states in stats.by_class.values():
        for state, n in states.items():
            if not state.startswith("archived-"):
                by_state[state] = by_state.get(state, 0) + n
    return Sample(at, stats.server_time, dict(sorted(by_state.items())))


class Drain:
    """The last refreshes' samples, and the rate and ETA they give."""

    def __init__(self) -> None:
        self.samples: deque[Sample] = deque(maxlen=RATE_SAMPLES)

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)

    @property
    def rate(self) -> float | None:
        """Backlog rows drained per second (negative: growing); None before two samples."""
        first, last = self.samples[0], self.samples[-1]
        elapsed = last.at - first.at
        return (first.backlog - last.backlog) / elapsed if elapsed > 0 else None

    @property
    def eta(self) -> float | None:
        """Seconds until the backlog is gone at this rate; None unless it drains."""
        rate, backlog = self.rate, self.samples[-1].backlog
        return backlog / rate if rate is not None and rate > 0 else None

    def as_json(self) -> str:
        last = self.samples[-1]
        return json.dumps(
            {
                "server_time": last.server_time,
                "backlog": last.backlog,
                "by_state": last.by_state,
                "rate": self.rate,
                "eta": self.eta,
            }
        )

    def as_text(self) -> str:
        last = self.samples[-1]
        clock = datetime.fromtimestamp(last.server_time, UTC).strftime("%H:%M:%SZ")
        states = ", ".join(f"{state} {n}" for state, n in last.by_state.items())
        backlog = f"backlog {last.backlog}" + (f" ({states})" if states else "")
        return f"{clock}  {backlog}  {self.progress()}"

    def progress(self) -> str:
        rate, eta = self.rate, self.eta
        if not self.samples[-1].backlog:
            return "drained"
        if rate is None:
            return "rate: measuring"
        if eta is not None:
            return f"draining {pace(rate)}, ETA {span(round(eta))}"
        return f"growing {pace(-rate)}" if rate < 0 else "not draining"


def pace(rate: float) -> str:
    """Rows per second, or per minute when slower than one every 10 s."""
    return f"{rate:.1f}/s" if rate >= 0.1 else f"{rate * 60:.1f}/min"


def watch(
    read: Callable[[], QueueStats],
    interval: float,
    count: int | None,
    as_json: bool,
    echo: Callable[[str], None],
) -> None:
    """Print one line each ``interval`` seconds, ``count`` times (None: until Ctrl-C)."""
    drain = Drain()
    shown = 0
    try:
        while count is None or shown < count:
            if shown:
                time.sleep(interval)
            drain.add(sample(read(), time.monotonic()))
            echo(drain.as_json() if as_json else drain.as_text())
            shown += 1
    except KeyboardInterrupt:
        return
