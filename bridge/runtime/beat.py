"""Beat's scheduler: Celery's in-memory scheduler, without its busy wait, sending polls
only while this beat holds the beat lock (``bridge.queue.beat_lock``), so a second beat
on another host stands by instead of doubling the polls.

Celery's ``Scheduler.adjust`` wakes 10 ms before an entry is due, and then ticks
without sleeping until it is: about 10 ms of CPU a poll, or 4% of a core at the
default 0.25 s interval. Sleeping the whole remaining time costs next to nothing and
sends the poll as close to its due time.

On a Redis broker the beat holding the lock also rescues the leases of messages a dead
worker had fetched (``bridge.runtime.rescue``). Every beat, standing by or not, is listed
in Phorge's Daemons console (``bridge.runtime.daemon_console``).
"""

from __future__ import annotations

from typing import Any, cast

from celery.beat import Scheduler

from bridge.config import current_settings
from bridge.queue import make_engine
from bridge.queue.beat_lock import CHECK_EVERY, BeatLock
from bridge.runtime.daemon_console import BEAT, ConsoleEntry
from bridge.runtime.rescue import Rescuer


class PollScheduler(Scheduler):
    lock: BeatLock | None = None
    rescuer: Rescuer | None = None  # Redis brokers only (``bridge.runtime.rescue``)
    console: ConsoleEntry | None = None

    def adjust(self, n: float, drift: float = -0.010) -> float:
        # celery-types says ``n: int``; Celery passes the float seconds until an entry is due.
        return super().adjust(cast(int, n), drift=0.0)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if self.lock is None:
            settings = current_settings()
            engine = make_engine(settings.database_url)
            self.lock = BeatLock(engine, settings.owner_prefix)
            if Rescuer.wanted(self.app):
                self.rescuer = Rescuer(self.app, engine)
                self.rescuer.start()
            self.console = ConsoleEntry.for_settings(settings, BEAT, ["beat"])
            if self.console is not None:
                self.console.start()
        held = self.lock.held()
        if self.rescuer is not None:
            self.rescuer.active = held
        if not held:
            return CHECK_EVERY  # standing by: nothing is sent
        return super().tick(*args, **kwargs)

    def close(self) -> None:
        if self.console is not None:
            self.console.stop()
        if self.rescuer is not None:
            self.rescuer.stop()
        if self.lock is not None:
            self.lock.close()
        super().close()
