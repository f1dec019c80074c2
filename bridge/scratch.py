"""Scratch directories shared by a worker's processes, gone when the worker is."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile


def private_directory(prefix: str) -> str:
    """A new temporary directory, removed when the process that made it exits (never at
    a forked child's exit: the pool's children share it)."""
    directory = tempfile.mkdtemp(prefix=prefix)
    creator = os.getpid()

    def remove() -> None:
        if os.getpid() == creator:
            shutil.rmtree(directory, ignore_errors=True)

    atexit.register(remove)
    return directory
