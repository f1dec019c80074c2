"""MariaDB restarted, SIGKILLed and frozen (SIGSTOP) under load: the queue resumes by itself.

Runs on the suite's private MariaDB only. The frozen server stalls 5 s by default and
30 s with ``--long-faults``.
"""

from __future__ import annotations

import signal
import time

import pytest

DOWN = 2.0  # seconds the server stays down when restarted or killed


@pytest.mark.parametrize("fault", ["restart", "kill", "stall"])
def test_database_fault(
    fault, fault_mariadb, fault_database, fault_redis, make_fault_bridge, fault_run, request
):
    bridge = make_fault_bridge(fault_database, fault_redis.url)
    run = fault_run(bridge)
    run.queue(40)
    run.queue(4, fail_times=1)  # some wait to retry through the fault
    bridge.serve()
    run.start()
    run.wait_fraction(0.25)
    if fault == "stall":
        fault_mariadb.signal(signal.SIGSTOP)
        time.sleep(30 if request.config.getoption("--long-faults") else 5)  # the fault itself
        fault_mariadb.signal(signal.SIGCONT)
    else:
        if fault == "restart":
            fault_mariadb.stop()
        else:
            fault_mariadb.kill()
        time.sleep(DOWN)  # the outage itself
        fault_mariadb.start()
    run.over()
    run.check()
