"""A worker host and a poller host whose clocks are 10 minutes apart, each way.

Only the wall clock is wrong (``sitecustomize.py`` shifts ``time.time`` in the processes
under test): the poller and beat share one host, the executing worker another. Nothing
that decides whether a task runs, or how much capacity is free, may depend on them
agreeing: the batch (with retry waits) runs as fast as on agreeing clocks.
"""

from __future__ import annotations

import time

import pytest

SKEW = 600.0
MAX_STALL = 8.0  # retry waits are 1 s; a discarded message would cost a 10 s dispatch lease


@pytest.mark.parametrize(("poller", "worker"), [(-SKEW, SKEW), (SKEW, -SKEW)])
def test_clock_skew(poller, worker, fault_database, fault_rabbitmq, make_fault_bridge, fault_run):
    bridge = make_fault_bridge(fault_database, fault_rabbitmq.url)
    bridge.clock_offsets = {"poller": poller, "beat": poller, "worker": worker}
    run = fault_run(bridge)
    run.queue(40, duration=0.05)
    run.queue(10, duration=0.05, fail_times=2)  # retry waits, counted as in flight if wrong
    started = [
        bridge.worker("poller", [bridge.control_queue]),
        bridge.worker("worker", [bridge.default_queue], concurrency=2),
    ]
    bridge.beat()
    bridge.wait_ready(*started)
    run.start()
    run.check()
    assert run.sampler is not None
    assert run.sampler.longest_stall() < MAX_STALL
    skews = {round(r["time"] - time.time(), -2) for r in bridge.fault_runs()}
    assert skews == {worker}, "the worker's clock was not shifted"
