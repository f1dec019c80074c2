"""Phorge's web tier failing under the Conduit proxy: no task pays for it.

A fake Phorge (a real HTTP server) answers ``worker.execute`` with success after 0.1 s;
once a fifth of the proxied tasks is archived, it goes down (port closed), answers 502 or
an HTML page, answers slowly, closes mid-response, or refuses the token, for 6 s (30 s
with ``--long-faults``). Native tasks queued during the outage must still run; every
proxied task must end archived with no failure counted; each worker process logs the
outage once; the metric and ``doctor`` show the open breaker; and the queue moves again
within seconds of Phorge coming back.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from conduit_fakes import (
    TOKEN,
    FakeServer,
    Reply,
    Request,
    conduit_error,
    conduit_result,
    execute_answer,
)
from local_ports import free_port

from bridge.queue.model import RESULT_SUCCESS

HTML_502 = b"<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>"
MAINTENANCE = b"<html><body><h1>Down for maintenance</h1></body></html>"
RUN_SECONDS = 0.1  # what PHP takes for each task
SLOW_SECONDS = 1.5  # a slow Phorge, still well within the read timeout
UNAVAILABLE = "Conduit is unavailable; PHP-only tasks are held back"


@dataclass
class FakePhorge:
    """Answers by ``mode``; counts the runs PHP really did (answered or cut off)."""

    mode: str = "up"
    executed: Counter = field(default_factory=Counter)
    cut: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def respond(self, request: Request) -> Reply | None:
        mode = self.mode
        if mode == "down":  # kept-alive connections outlive the closed port: hang them up
            return None
        if mode == "html502":
            return Reply(502, HTML_502, {"Content-Type": "text/html"})
        if mode == "html200":
            return Reply(200, MAINTENANCE, {"Content-Type": "text/html"})
        if mode == "revoked":
            return conduit_error("ERR-INVALID-AUTH", f'API token "{TOKEN}" is not valid.')
        if request.path != "/api/worker.execute":  # the circuit breaker's probe
            reply = conduit_result({"userName": "bridge-bot", "roles": ["admin"]})
        else:
            task_id = request.params["taskID"]
            with self.lock:
                self.executed[task_id] += 1
                if mode == "cut":
                    self.cut[task_id] += 1
            reply = conduit_result(execute_answer(result="success", duration=100000))
            reply.delay = RUN_SECONDS
        if mode == "cut":
            reply.cut_after = 12
        if mode == "slow":
            reply.delay = SLOW_SECONDS
        return reply


def metric(port: int, name: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return None


@dataclass
class Deployment:
    """One bridge for the module, its Conduit URL on a port claimed for the module, and
    the fake Phorge of the case running (every server on the port answers as that one)."""

    bridge: Any
    conduit_port: int
    metrics_port: int
    phorge: FakePhorge = field(default_factory=FakePhorge)

    def metric(self) -> float | None:
        return metric(self.metrics_port, "phorge_bridge_conduit_breaker_open")

    def respond(self, request: Request) -> Reply | None:
        return self.phorge.respond(request)


@dataclass
class Phorge:
    """A case's own fake Phorge server on the deployment's Conduit port."""

    deployment: Deployment
    server: FakeServer | None = None

    def up(self) -> None:
        port = self.deployment.conduit_port
        self.server = FakeServer(self.deployment.respond, port=port).__enter__()

    def down(self) -> None:
        """Close the port (it stays claimed: nothing else takes it meanwhile)."""
        if self.server is not None:
            self.server.__exit__()
            self.server = None


@pytest.fixture(scope="module")
def deployment(
    module_fault_database, fault_redis, make_module_fault_bridge, tmp_path_factory
) -> Iterator[Deployment]:
    conduit_port, metrics_port = free_port(), free_port()
    multiproc = tmp_path_factory.mktemp("prometheus")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PROMETHEUS_MULTIPROC_DIR", str(multiproc))
        bridge = make_module_fault_bridge(
            module_fault_database,
            fault_redis.url,
            CONDUIT_URL=f"http://127.0.0.1:{conduit_port}",
            CONDUIT_TOKEN=TOKEN,
            CONDUIT_READ_TIMEOUT="10",
            METRICS_PORT=str(metrics_port),
            MAX_INFLIGHT="4",  # a slow Phorge must not leave dispatched tasks past their lease
        )
        bridge.serve()
    try:
        yield Deployment(bridge, conduit_port, metrics_port)
    finally:
        bridge.stop()


@pytest.fixture
def phorge(deployment: Deployment) -> Iterator[Phorge]:
    """Each case's own fake Phorge, new and up: a case that fails with Phorge down or
    broken leaves the next one a working Phorge. Connections a previous case's server
    kept alive are answered by this case's fake too, as one Phorge behind a port would."""
    deployment.phorge = FakePhorge()
    phorge = Phorge(deployment)
    phorge.up()
    try:
        yield phorge
    finally:
        phorge.down()


@pytest.mark.parametrize("fault", ["down", "html502", "html200", "slow", "cut", "revoked"])
def test_conduit_fault(fault, deployment, phorge, fault_run, request):
    outage = 30.0 if request.config.getoption("--long-faults") else 6.0
    bridge, fake = deployment.bridge, deployment.phorge
    logged_before = {process.name: len(process.log()) for process in bridge.processes}
    run = fault_run(bridge)
    proxied = bridge.enqueue("ProxiedWorker", {}, count=20)
    run.add(proxied, RESULT_SUCCESS)
    run.start()
    run.wait_fraction(0.2)
    started = time.monotonic()
    fake.mode = fault
    if fault == "down":
        phorge.down()
    natives = run.queue(4, duration=0)
    bridge.wait_archived(natives, timeout=60)  # native work goes on meanwhile

    def new_logs() -> str:
        return "\n".join(p.log()[logged_before[p.name] :] for p in bridge.processes)

    if fault != "slow":
        bridge.wait_until(lambda: UNAVAILABLE in new_logs(), 60, "the outage's log line")
        assert deployment.metric() == 1
    time.sleep(max(0.0, outage - (time.monotonic() - started)))  # the outage itself
    if fault != "slow":
        assert bridge.doctor()["conduit breaker"]["status"] == "fail"
    if fault == "down":
        phorge.up()
    fake.mode = "up"
    run.over()
    run.check(recover_within=None if fault == "slow" else min(outage, 60) + 15)
    rows = bridge.archived(proxied)
    assert {r.failureCount for r in rows.values()} == {0}, "an outage counted as a failure"
    for task_id in proxied:  # PHP ran each once, again only after a cut-off answer
        assert 1 <= fake.executed[task_id] <= 1 + fake.cut[task_id], task_id
    logs = new_logs()
    assert logs.count(UNAVAILABLE) <= 3 * 2, "logged per task, not per state change"
    assert TOKEN not in logs
    if fault != "slow":
        assert "is available again: resuming PHP-only tasks" in logs
        bridge.wait_until(lambda: deployment.metric() == 0, 30, "the metric to show it closed")
