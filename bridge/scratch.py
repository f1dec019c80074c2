"""Scratch directories shared by a worker's processes, gone when the worker is.

A worker that exits removes its own (``atexit``). One killed (``kill -9``, the OOM
killer, a container stopped hard) cannot, so each directory carries a lock its worker
holds for as long as any of its processes lives (``flock`` on an open file: the pool's
children inherit it, and the kernel frees it when the last of them dies); the next
worker to make a directory of the same kind removes those whose lock it can take.
"""

from __future__ import annotations

import atexit
import fcntl
import glob
import os
import shutil
import tempfile

OWNER = ".owner"  # locked while the directory's worker lives
OWNED = ".owned"  # made once OWNER is locked: a directory without it is still being made


def private_directory(prefix: str) -> str:
    """A new temporary directory, removed when the process that made it exits (never at
    a forked child's exit: the pool's children share it); the directories of this
    ``prefix`` that killed workers left behind are removed first."""
    _remove_abandoned(prefix)
    directory = tempfile.mkdtemp(prefix=prefix)
    owner = os.open(os.path.join(directory, OWNER), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(owner, fcntl.LOCK_EX)  # held, by this fd, until every process closes it
    open(os.path.join(directory, OWNED), "w").close()
    creator = os.getpid()

    def remove() -> None:
        if os.getpid() == creator:
            shutil.rmtree(directory, ignore_errors=True)

    atexit.register(remove)
    return directory


def _remove_abandoned(prefix: str) -> None:
    """Remove the directories of ``prefix`` whose worker is gone (their lock is free)."""
    for directory in glob.glob(os.path.join(tempfile.gettempdir(), glob.escape(prefix) + "*")):
        if not os.path.exists(os.path.join(directory, OWNED)):
            continue  # being made, or made before directories had an owner
        try:
            owner = os.open(os.path.join(directory, OWNER), os.O_RDWR)
        except OSError:
            continue  # removed meanwhile
        try:
            fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(directory, ignore_errors=True)  # under the lock: one sweeper does
        except BlockingIOError:
            pass  # its worker lives
        finally:
            os.close(owner)
