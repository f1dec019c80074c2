"""RequestSlots: at most N Conduit requests in flight from one worker, across its pool.

A backlog of proxied tasks must not take every PHP process of the web tier that serves
Phorge's users, so a worker holds a slot for each ``worker.execute`` request. The slots
are files locked with ``flock``: a lock belongs to its open file, so the pool's threads
and its forked processes exclude each other alike, and the kernel frees the slot of a
process that dies, even by ``kill -9``. The worker's main process makes the directory
before its pool forks (:func:`share_with_pool`); a process on its own (``phorge-bridge
execute``) gets one of its own.
"""

from __future__ import annotations

import fcntl
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bridge.scratch import private_directory

# Where a worker's slots are; inherited by the processes its pool forks.
DIRECTORY_ENV = "PHORGE_BRIDGE_CONDUIT_SLOTS"


def share_with_pool() -> str:
    """The directory of this worker's slots, made now (before its pool forks) unless it
    already is; removed when the process that made it exits."""
    directory = os.environ.get(DIRECTORY_ENV)
    if directory and os.path.isdir(directory):
        return directory
    directory = os.environ[DIRECTORY_ENV] = private_directory("phorge-bridge-conduit-")
    return directory


class RequestSlots:
    """``count`` slots shared by every process and thread of one worker."""

    def __init__(self, count: int, directory: str | None = None) -> None:
        if count < 1:
            raise ValueError(f"a worker needs at least one Conduit request slot, not {count}")
        self.count = count
        self.directory = Path(directory or share_with_pool())

    @contextmanager
    def slot(self) -> Iterator[int]:
        """Hold a free slot while the block runs (waiting for one when all are taken);
        yields its number."""
        first = random.randrange(self.count)
        order = [(first + i) % self.count for i in range(self.count)]
        for slot in order:
            fd = self._open(slot)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                yield slot
            finally:
                os.close(fd)  # closing the file frees the lock
            return
        fd = self._open(first)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield first
        finally:
            os.close(fd)

    def _open(self, slot: int) -> int:
        return os.open(self.directory / f"slot-{slot}", os.O_RDWR | os.O_CREAT, 0o600)
