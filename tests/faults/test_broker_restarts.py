"""Broker restarts under load: the same workers finish every task, each archived once.

A round queues a batch, restarts the suite's private broker (never a shared one) for
``OUTAGE`` seconds once a quarter is archived, and ends with the fault suite's checks.
The same two workers must survive every round, and their liveness files (what
``phorge-bridge health`` reads for a supervisor) must be fresh again after it.
``--long-faults`` runs the evidence behind the pinned Celery (issue 11): 10 rounds of
2,000 tasks per broker; by default one round of 200 tasks of 0.1 s.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from bridge_harness import CLI_INTERVAL

from bridge.queue.schema import worker_archivetask as archive

OUTAGE = 5.0  # seconds the broker stays down in each round
LIVENESS_MAX_AGE = 20


def rounds_tasks_duration(config: pytest.Config) -> tuple[int, int, float]:
    """The evidence runs instant tasks; the short run slows them so that a round is still
    under way when a RabbitMQ node has taken its seconds to stop."""
    return (10, 2000, 0.0) if config.getoption("--long-faults") else (1, 200, 0.1)


def healthy(liveness_file: Path) -> bool:
    """``phorge-bridge health`` on a worker's liveness file, as a supervisor runs it."""
    command = [sys.executable, "-m", "bridge.cli", "health", "--liveness-file",
               str(liveness_file), "--max-age", str(LIVENESS_MAX_AGE)]  # fmt: skip
    return subprocess.run(command, capture_output=True, check=False).returncode == 0


def test_workers_survive_broker_restarts(
    fault_broker, fault_database, make_fault_bridge, fault_run, tmp_path: Path, request
) -> None:
    rounds, tasks, duration = rounds_tasks_duration(request.config)
    bridge = make_fault_bridge(fault_database, fault_broker.url, MAX_INFLIGHT="200")
    liveness = {name: tmp_path / f"{name}.alive" for name in ("poller", "worker")}
    workers = [
        bridge.worker("poller", [bridge.control_queue],
                      extra=("--liveness-file", str(liveness["poller"]))),
        bridge.worker("worker", [bridge.default_queue], concurrency=2,
                      extra=("--liveness-file", str(liveness["worker"]))),
    ]  # fmt: skip
    bridge.wait_ready(*workers)
    bridge.beat()

    def unless_dead(condition: Callable[[], bool]) -> Callable[[], bool]:
        """``condition``, ending the wait at once when a worker exited (issue 11's crash)."""
        return lambda: condition() or any(not p.running() for p in workers)

    for round_no in range(1, rounds + 1):
        run = fault_run(bridge)
        run.name += f" round {round_no}/{rounds}"
        run.queue(tasks, duration=duration)
        run.start()
        run.wait_fraction(0.25)
        fault_broker.restart(OUTAGE)
        run.over()
        at_restart = bridge.count(archive)
        bridge.wait_until(
            # The round may have ended while the broker was stopping: then the next round,
            # and the liveness files below, prove consumption after the restart.
            unless_dead(
                lambda n=at_restart, ids=run.ids: (
                    bridge.count(archive) > n
                    or bridge.count(archive, archive.c.id.in_(ids)) == len(ids)
                )
            ),
            120,
            f"progress after restart {round_no}",
        )
        run.check()  # fails naming any worker that exited
        for name, path in liveness.items():
            bridge.wait_until(
                lambda p=path: healthy(p), 60, f"{name}'s liveness file", interval=CLI_INTERVAL
            )
