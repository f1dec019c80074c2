"""One worker whose PHP transport is down must not slow the fleet (issue 31, item 1).

Two workers share one queue of PHP-only tasks. One is healthy; the other cannot run
them: its PHP binary is missing (a botched upgrade on one host), or its Conduit breaker
is open (its web tier is unreachable from there). The broken worker hands each such task
back at once, no failure counted and no yield holding the row, and stops consuming the
queue until its breaker is due to probe again, so the healthy worker takes the queue.
Polls keep leasing, whichever worker runs them: the broken worker's own polls lease for
the healthy one. Each scenario prints the drain rate next to the healthy worker's alone
(a benchmark figure, not asserted: this machine may be loaded).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conduit_fakes import TOKEN, FakeServer, Request, conduit_result, execute_answer
from php_standin import STANDIN_ROOT, php_binary

from bridge.queue.model import RESULT_SUCCESS
from bridge.queue.schema import worker_activetask as active

TASKS = 3000
WAIT = 180.0
HANDED_BACK = re.compile(r"#\d+ \[(runner|conduit)\]: handed-back: held back")


def drain(bridge, run, task_class: str, count: int) -> float:
    """Queue ``count`` tasks of the run and wait until they are archived; tasks a second."""
    ids = bridge.enqueue(task_class, {}, count=count)
    run.add(ids, RESULT_SUCCESS)
    started = time.monotonic()
    bridge.wait_archived(ids, timeout=WAIT)
    return count / (time.monotonic() - started)


def keep_queueing_until(bridge, run, task_class: str, condition: Callable[[], bool]) -> None:
    """Keep work queued until ``condition`` holds (a worker must find some to show it runs)."""

    def check() -> bool:
        if condition():
            return True
        if bridge.count(active) < 50:
            run.add(bridge.enqueue(task_class, {}, count=50), RESULT_SUCCESS)
        return False

    bridge.wait_until(check, WAIT, "the broken worker to run tasks again")


def healthy_alone(bridge, run, task_class: str) -> tuple[Any, float]:
    """Start the healthy worker and beat; returns the run and its drain rate alone."""
    healthy = bridge.worker("healthy", [bridge.default_queue, bridge.control_queue], concurrency=2)
    bridge.wait_ready(healthy)
    bridge.beat()
    run.start()
    drain(bridge, run, task_class, 200)  # warm: the pace has its evidence
    return run, drain(bridge, run, task_class, TASKS)


def broken_worker(bridge, **env: str):
    """A second worker on the same queues, with this host's broken settings."""
    queues = [bridge.default_queue, bridge.control_queue]
    return bridge.worker("broken", queues, concurrency=2, env=env)


def check_broken_worker(
    run, broken, rates: tuple[float, float], what: str, *, yields: int = 0
) -> None:
    """Nothing lost, no failure counted, few hand-backs: the broken worker stood by. At
    most ``yields`` tasks yielded: the runs that found the transport down, one a process."""
    rows = run.bridge.archived(run.ids)
    assert {r.failureCount for r in rows.values()} == {0}, "a hand-back counted as a failure"
    log = broken.log()
    assert log.count(": yield (due again") <= yields, "the broken worker yielded, not handed back"
    assert "this worker can run none of its tasks now; not consuming it" in log
    handed_back = len(HANDED_BACK.findall(log))
    alone, both = rates
    print(
        f"\n[fault] {what}: healthy alone {alone:.0f}/s, with the broken worker {both:.0f}/s "
        f"({both / alone:.2f}x), {handed_back} task(s) handed back"
    )
    assert handed_back < TASKS / 4, f"{handed_back} hand-backs: the worker did not stand by"


def test_a_worker_whose_php_cannot_start_leaves_the_queue_to_the_healthy_one(
    fault_database, fault_rabbitmq, make_fault_bridge, fault_run, tmp_path: Path
) -> None:
    php = php_binary()
    bridge = make_fault_bridge(
        fault_database,
        fault_rabbitmq.url,
        PHORGE_ROOT=str(STANDIN_ROOT),
        RUNNER_CLASSES="Standin*",
        MAX_INFLIGHT="200",
    )
    run, alone = healthy_alone(bridge, fault_run(bridge), "StandinSucceedWorker")
    missing = tmp_path / "bin" / "php"  # appears later, as after a fixed upgrade
    broken = broken_worker(bridge, BRIDGE_RUNNER_PHP=str(missing))
    bridge.wait_ready(broken)
    bridge.wait_until(lambda: "The PHP runner is unavailable" in broken.log(), WAIT, "its boot")
    both = drain(bridge, run, "StandinSucceedWorker", TASKS)
    check_broken_worker(run, broken, (alone, both), "PHP runner missing on one worker")

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
    fault_database, fault_rabbitmq, make_fault_bridge, fault_run
) -> None:
    with FakeServer(FakePhorge().respond) as server:
        bridge = make_fault_bridge(
            fault_database,
            fault_rabbitmq.url,
            CONDUIT_URL=server.url,
            CONDUIT_TOKEN=TOKEN,
            CONDUIT_MAX_REQUESTS="4",
            MAX_INFLIGHT="200",
        )
        run, alone = healthy_alone(bridge, fault_run(bridge), "ProxiedWorker")
        # Its web tier is unreachable from this host: a port nothing listens on.
        with FakeServer(FakePhorge().respond) as gone:
            unreachable = gone.url
        broken = broken_worker(bridge, BRIDGE_CONDUIT_URL=unreachable)
        bridge.wait_ready(broken)
        both = drain(bridge, run, "ProxiedWorker", TASKS)
        check_broken_worker(
            run, broken, (alone, both), "Conduit unreachable from one worker", yields=2
        )
        run.over()
        run.check()
