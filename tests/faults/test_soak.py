"""A soak: a long stream of tasks through one worker, its memory measured.

2,000 tasks by default, 30,000 with ``--long-faults``. The resident memory of the
worker's processes (main and prefork children) is sampled with the count of archived
tasks every tenth of a second, and its growth per task after the warm-up (the first
third: imports, pools, caches) is the least-squares slope of those samples: a leak grows
it with every task, allocator noise does not. Here the slope is 0.2-0.3 KB a task over
the default run (caches still filling; under 0.1 KB after 6,000 tasks), and 1.4 KB with
a handler that keeps 1 KB a task: the default bound, ``PER_TASK``, sees a leak of 1 KB a
task (the old bound, 40 MB over 900 tasks, saw only those above 45 KB), and the long
run's, ``LONG_PER_TASK``, one of a few hundred bytes.
"""

from __future__ import annotations

import statistics
import threading

import psutil

from bridge.queue.schema import worker_archivetask as archive

PER_TASK = 768  # bytes of growth a task, at most, over the last two thirds of 2,000
LONG_PER_TASK = 256  # the same over the last two thirds of 30,000
SAMPLE_EVERY = 0.1  # seconds


def rss(pid: int) -> int:
    main = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [main, *main.children(recursive=True)])


class MemorySampler:
    """(archived tasks, the worker's resident bytes) pairs, read together, until stopped."""

    def __init__(self, bridge, pid: int) -> None:
        self.bridge, self.pid = bridge, pid
        self.samples: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY):
            self.samples.append((self.bridge.count(archive), rss(self.pid)))

    def stop(self) -> list[tuple[int, int]]:
        self._stop.set()
        self._thread.join(10)
        return self.samples


def test_soak(fault_database, fault_rabbitmq, make_fault_bridge, fault_run, request):
    long_run = request.config.getoption("--long-faults")
    total = 30_000 if long_run else 2_000
    bound = LONG_PER_TASK if long_run else PER_TASK
    bridge = make_fault_bridge(
        fault_database, fault_rabbitmq.url, MAX_INFLIGHT="200", DISPATCH_LEASE="60"
    )
    run = fault_run(bridge)
    worker = bridge.worker("worker", [bridge.default_queue, bridge.control_queue], concurrency=2)
    bridge.beat()
    for _ in range(total // 500):  # while they start
        run.queue(500, duration=0)
    run.start()
    bridge.wait_ready(worker)
    memory = MemorySampler(bridge, worker.pid)
    try:
        run.wait_fraction(1.0)
    finally:
        samples = memory.stop()
    run.check()
    warm = [(n, b) for n, b in samples if n >= total // 3]
    assert len({n for n, _ in warm}) >= 5, f"too few samples after the warm-up: {warm}"
    slope, _ = statistics.linear_regression([n for n, _ in warm], [b for _, b in warm])
    (first, start), (last, end) = warm[0], warm[-1]
    print(
        f"[fault] soak of {total} tasks: worker RSS {start / 2**20:.1f} MB after {first} "
        f"-> {end / 2**20:.1f} MB after {last}, {slope:.0f} bytes a task ({len(warm)} samples)"
    )
    assert slope < bound, f"the worker grows by {slope:.0f} bytes a task"
