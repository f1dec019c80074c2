"""A soak: a long stream of tasks through one worker, its memory measured.

1,000 tasks by default, 30,000 with ``--long-faults``. The resident memory of the
worker's processes (main and prefork children) is read once the first tenth has run
(imports and pools warmed) and again at the end; it must stay flat.
"""

from __future__ import annotations

import psutil

MAX_GROWTH_MB = 40.0


def rss_mb(pid: int) -> float:
    main = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [main, *main.children(recursive=True)]) / 2**20


def test_soak(fault_database, fault_rabbitmq, make_fault_bridge, fault_run, request):
    total = 30_000 if request.config.getoption("--long-faults") else 1_000
    bridge = make_fault_bridge(
        fault_database, fault_rabbitmq.url, MAX_INFLIGHT="200", DISPATCH_LEASE="60"
    )
    run = fault_run(bridge)
    for _ in range(total // 500):
        run.queue(500, duration=0)
    [worker] = bridge.serve()
    run.start()
    run.wait_fraction(0.1)
    warm = rss_mb(worker.pid)
    run.check()
    end = rss_mb(worker.pid)
    print(f"[fault] soak of {total} tasks: worker RSS {warm:.0f} MB -> {end:.0f} MB")
    assert end - warm < MAX_GROWTH_MB
