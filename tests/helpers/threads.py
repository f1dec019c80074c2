"""Running work concurrently in tests: callables released at the same instant."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def run_together(*workers: Callable[[], Any]) -> list:
    """Run the callables in threads, released at once; returns their results in order."""
    barrier = threading.Barrier(len(workers))

    def start(work: Callable[[], Any]) -> Any:
        barrier.wait()
        return work()

    with ThreadPoolExecutor(len(workers)) as pool:
        futures = [pool.submit(start, work) for work in workers]
        return [future.result() for future in futures]
