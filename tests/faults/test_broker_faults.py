"""RabbitMQ and Redis restarted and SIGKILLed under load, and the whole worker SIGKILLed.

Private brokers only. A message lost with its broker comes back through its dispatch
lease (10 s here); a redelivered one runs only while its lease is still held.
"""

from __future__ import annotations

import time

import pytest

DOWN = 2.0  # seconds a restarted broker stays down


@pytest.mark.parametrize("fault", ["restart", "kill"])
def test_broker_fault(fault, fault_broker, fault_database, make_fault_bridge, fault_run):
    bridge = make_fault_bridge(fault_database, fault_broker.url)
    run = fault_run(bridge)
    run.queue(40)
    run.queue(4, fail_times=1)  # waiting to retry while the broker goes: issue 10, item 3
    bridge.serve()
    run.start()
    run.wait_fraction(0.25)
    if fault == "restart":
        fault_broker.stop()
        time.sleep(DOWN)  # the outage itself
    else:
        fault_broker.kill()
    fault_broker.start()
    run.over()
    run.check()


def test_whole_worker_kill(fault_rabbitmq, fault_database, make_fault_bridge, fault_run):
    bridge = make_fault_bridge(fault_database, fault_rabbitmq.url)
    run = fault_run(bridge)
    run.queue(40, duration=0.3)
    [worker] = bridge.serve()
    run.start()
    run.wait_fraction(0.25)
    worker.kill()  # the main process and its prefork children, mid-task
    replacement = bridge.worker(
        "replacement", [bridge.default_queue, bridge.control_queue], concurrency=2
    )
    bridge.wait_ready(replacement)
    run.over()
    run.check()
