"""One worker whose PHP transport is down must not slow the fleet (issue 31, item 1).

Two workers share one queue of PHP-only tasks. One is healthy; the other cannot run
them: its PHP binary is missing (a botched upgrade on one host), or its Conduit breaker
is open (its web tier is unreachable from there). The broken worker hands each such task
back at once, no failure counted and no yield holding the row, and stops consuming the
queue until its breaker is due to probe again, so the healthy worker takes the queue.
Polls keep leasing, whichever worker runs them: the broken worker's own polls lease for
the healthy one.

The drain rates: on a loaded 2-core machine one drain of each says little, so the phases
alternate in one run, the healthy worker alone (the broken one set aside: no consumer,
nothing held, frozen) and the pair, ``pairs`` of each and one more alone. Each pair phase
is compared with the mean of the alone phases either side of it (a drift of the
machine's load cancels out), each phase timed from its first archived task to its last
(not the wait for beat's next poll), and the median of those ratios is asserted.

The target is 0.8x the healthy worker alone (issue 31 measured 0.01x before the
stand-by). A pair phase starts with the broken worker's probe (its stand-by ran out while
it was set aside), so the short phases of the default run see a probe every half second
or so, several times its real rate: there the pair's median measures 0.7-1.0x, and the
bound is ``SHORT_BOUND``, which the issue's regression, or a hand-back that held its row,
fail by far. ``--long-faults`` runs phases of seconds, where the target itself is
asserted.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from bridge_harness import Bridge, CeleryProcess, wait_until
from celery import Celery
from conduit_fakes import TOKEN, FakeServer, Request, conduit_result, execute_answer
from php_standin import STANDIN_ROOT, php_binary

from bridge.queue.model import RESULT_SUCCESS
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_archivetask as archive

TARGET = 0.8  # the pair's drain rate over the healthy worker's alone, at least (long run)
SHORT_BOUND = 0.5  # the same in the default run's short phases, a probe at each one's start
WAIT = 180.0
HANDED_BACK = re.compile(r"#\d+ \[(runner|conduit)\]: handed-back: held back")


@dataclass(frozen=True)
class Phases:
    """How the rates are measured: ``pairs`` phases with the broken worker, ``tasks`` a
    phase, and the median ratio asserted."""

    pairs: int
    tasks: int
    bound: float


def phases(request: pytest.FixtureRequest, tasks: int, long_tasks: int) -> Phases:
    """The default run's (half a second to a second a phase here), or ``--long-faults``'s."""
    if request.config.getoption("--long-faults"):
        return Phases(pairs=5, tasks=long_tasks, bound=TARGET)
    return Phases(pairs=3, tasks=tasks, bound=SHORT_BOUND)


def drain(bridge, run, task_class: str, count: int) -> float:
    """Queue ``count`` tasks of the run and wait until they are archived; tasks a second,
    from the first archived to the last (the wait for the first poll is beat's phase)."""
    ids = bridge.enqueue(task_class, {}, count=count)
    run.add(ids, RESULT_SUCCESS)
    first: list[float] = []

    def archived() -> bool:
        done = bridge.count(archive, archive.c.id.in_(ids))
        if done and not first:
            first.append(time.monotonic())
        return done == count

    wait_until(archived, WAIT, f"{count} tasks archived", interval=0.02, diagnose=bridge.diagnose)
    return (count - 1) / max(time.monotonic() - first[0], 0.02)


def keep_queueing_until(bridge, run, task_class: str, condition: Callable[[], bool]) -> None:
    """Keep work queued until ``condition`` holds (a worker must find some to show it runs)."""

    def check() -> bool:
        if condition():
            return True
        if bridge.count(active) < 50:
            run.add(bridge.enqueue(task_class, {}, count=50), RESULT_SUCCESS)
        return False

    bridge.wait_until(check, WAIT, "the broken worker to run tasks again")


def healthy_alone(bridge, run, task_class: str) -> Any:
    """Start the healthy worker and beat, and warm them up (the pace has its evidence)."""
    healthy = bridge.worker("healthy", [bridge.default_queue, bridge.control_queue], concurrency=2)
    bridge.wait_ready(healthy)
    bridge.beat()
    run.start()
    drain(bridge, run, task_class, 200)
    return run


def broken_worker(bridge, **env: str):
    """A second worker on the same queues, with this host's broken settings."""
    queues = [bridge.default_queue, bridge.control_queue]
    return bridge.worker("broken", queues, concurrency=2, env=env)


class SetAside:
    """Takes a worker out of the fleet and puts it back as it was, through Celery's remote
    control and SIGSTOP: meanwhile it consumes neither queue, holds no message, runs no
    task (a poll frozen mid-run would hold the poll lock for good) and spends no CPU, and
    its own stand-by (a timer that consumes the task queue again) stands still with it.

    Whether it consumes the task queue is read from its log (Celery's ``Canceling queue``
    and ``Started consuming from`` lines) once it is stopped, so that the timer cannot
    change it meanwhile: on stand-by it stays frozen as it is; consuming, it is woken to
    stop consuming, and made to consume again when put back.
    """

    def __init__(self, bridge: Bridge, worker: CeleryProcess) -> None:
        self.worker, self.node = worker, bridge.node(worker.name)
        self.tasks, self.control = bridge.default_queue, bridge.control_queue
        self.app = Celery(broker=bridge.broker_url)  # a client only, for remote control
        self.consumed_tasks = False

    def consumes(self, queue: str) -> bool:
        log = self.worker.log()
        return log.rfind(f"Started consuming from {queue}\n") >= log.rfind(
            f"Canceling queue {queue}\n"
        )

    def _command(self, command: str, queue: str, logged: str) -> None:
        line = f"{logged} {queue}\n"
        before = self.worker.log().count(line)
        self.app.control.broadcast(
            command, arguments={"queue": queue}, destination=[self.node], reply=True, timeout=10
        )
        wait_until(lambda: self.worker.log().count(line) > before, 30, f"{command} {queue}")

    def _idle(self) -> bool:
        """Nothing running, nothing reserved (asked of the worker itself)."""
        inspect = self.app.control.inspect(destination=[self.node], timeout=5)
        held = [inspect.active(), inspect.reserved()]
        return all(answer is not None and not any(answer.values()) for answer in held)

    def _signal(self, sig: int) -> None:
        os.killpg(self.worker.pid, sig)

    def take_out(self) -> None:
        self._command("cancel_consumer", self.control, "Canceling queue")
        self.consumed_tasks = False
        while True:
            wait_until(self._idle, 30, f"{self.worker.name} to be idle", interval=0.05)
            self._signal(signal.SIGSTOP)
            if not self.consumes(self.tasks):
                return  # idle, on stand-by or not consuming: frozen as it is
            self._signal(signal.SIGCONT)
            self._command("cancel_consumer", self.tasks, "Canceling queue")
            self.consumed_tasks = True

    def put_back(self) -> None:
        self._signal(signal.SIGCONT)
        self._command("add_consumer", self.control, "Started consuming from")
        if self.consumed_tasks:
            self._command("add_consumer", self.tasks, "Started consuming from")

    def close(self) -> None:
        self.app.close()


def interleaved(
    bridge, run, broken, task_class: str, how: Phases
) -> tuple[list[float], list[float]]:
    """Drain rates (tasks a second) of the phases alone and with the broken worker, in
    turn: alone, pair, alone, ..., alone."""
    aside = SetAside(bridge, broken)
    alone: list[float] = []
    pair: list[float] = []
    try:
        for phase in range(2 * how.pairs + 1):
            if phase % 2 == 0:
                aside.take_out()
                alone.append(drain(bridge, run, task_class, how.tasks))
                aside.put_back()
            else:
                pair.append(drain(bridge, run, task_class, how.tasks))
    finally:
        aside.close()
    return alone, pair


def check_broken_worker(
    run, broken, how: Phases, rates: tuple[list[float], list[float]], what: str, *, yields=0
) -> None:
    """Nothing lost, no failure counted, few hand-backs: the broken worker stood by, and
    the pair drained the queue at least ``how.bound`` times as fast as the healthy worker
    alone. At most ``yields`` tasks yielded: the runs that found the transport down, one a
    process."""
    alone, pair = rates
    ratios = [both / ((alone[i] + alone[i + 1]) / 2) for i, both in enumerate(pair)]
    ratio = statistics.median(ratios)
    log = broken.log()
    handed_back = len(HANDED_BACK.findall(log))
    print(
        f"\n[fault] {what}: healthy alone {statistics.median(alone):.0f}/s "
        f"({', '.join(f'{r:.0f}' for r in alone)}), with the broken worker "
        f"{statistics.median(pair):.0f}/s ({', '.join(f'{r:.0f}' for r in pair)}); "
        f"ratios {', '.join(f'{r:.2f}' for r in ratios)}, median {ratio:.2f}x; "
        f"{handed_back} task(s) handed back"
    )
    rows = run.bridge.archived(run.ids)
    assert {r.failureCount for r in rows.values()} == {0}, "a hand-back counted as a failure"
    assert log.count(": yield (due again") <= yields, "the broken worker yielded, not handed back"
    assert "this worker can run none of its tasks now; not consuming it" in log
    # A few messages a probe; without the stand-by, a good share of every dispatch, again
    # and again.
    tasks = how.pairs * how.tasks
    assert handed_back < tasks / 2, f"{handed_back} hand-backs: the worker did not stand by"
    assert ratio >= how.bound, f"the pair drains at {ratio:.2f}x the healthy worker alone"


def test_a_worker_whose_php_cannot_start_leaves_the_queue_to_the_healthy_one(
    fault_database, fault_rabbitmq, make_fault_bridge, fault_run, tmp_path: Path, request
) -> None:
    php = php_binary()
    how = phases(request, tasks=500, long_tasks=3000)
    bridge = make_fault_bridge(
        fault_database,
        fault_rabbitmq.url,
        PHORGE_ROOT=str(STANDIN_ROOT),
        RUNNER_CLASSES="Standin*",
        MAX_INFLIGHT="200",
    )
    run = healthy_alone(bridge, fault_run(bridge), "StandinSucceedWorker")
    missing = tmp_path / "bin" / "php"  # appears later, as after a fixed upgrade
    broken = broken_worker(bridge, BRIDGE_RUNNER_PHP=str(missing))
    bridge.wait_ready(broken)
    bridge.wait_until(lambda: "The PHP runner is unavailable" in broken.log(), WAIT, "its boot")
    rates = interleaved(bridge, run, broken, "StandinSucceedWorker", how)
    check_broken_worker(run, broken, how, rates, "PHP runner missing on one worker")

    missing.parent.mkdir()
    missing.symlink_to(php)
    ran_here = re.compile(r"StandinSucceedWorker#\d+ \[runner\]: success")
    keep_queueing_until(
        bridge, run, "StandinSucceedWorker", lambda: bool(ran_here.search(broken.log()))
    )
    run.over()
    run.check()


class FakePhorge:
    """Answers every ``worker.execute`` task with success, and the breaker's probe."""

    def respond(self, request: Request):
        if request.path != "/api/worker.execute":
            return conduit_result({"userName": "bridge-bot", "roles": ["admin"]})
        tasks = request.params.get("tasks")
        if tasks is None:
            return conduit_result(execute_answer(result="success", duration=1000))
        answers = [execute_answer(result="success", duration=1000) for _ in tasks]
        return conduit_result({"results": answers})


def test_a_worker_whose_conduit_breaker_is_open_leaves_the_queue_to_the_healthy_one(
    fault_database, fault_rabbitmq, make_fault_bridge, fault_run, request
) -> None:
    how = phases(request, tasks=400, long_tasks=1500)  # Conduit's fake: half the pace
    with FakeServer(FakePhorge().respond) as server:
        bridge = make_fault_bridge(
            fault_database,
            fault_rabbitmq.url,
            CONDUIT_URL=server.url,
            CONDUIT_TOKEN=TOKEN,
            CONDUIT_MAX_REQUESTS="4",
            MAX_INFLIGHT="200",
        )
        run = healthy_alone(bridge, fault_run(bridge), "ProxiedWorker")
        # Its web tier is unreachable from this host: a port nothing listens on.
        with FakeServer(FakePhorge().respond) as gone:
            unreachable = gone.url
        broken = broken_worker(bridge, BRIDGE_CONDUIT_URL=unreachable)
        bridge.wait_ready(broken)
        rates = interleaved(bridge, run, broken, "ProxiedWorker", how)
        what = "Conduit unreachable from one worker"
        check_broken_worker(run, broken, how, rates, what, yields=2)
        run.over()
        run.check()
