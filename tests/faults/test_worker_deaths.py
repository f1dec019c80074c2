"""A task whose worker dies runs again within seconds at production defaults (issue 38).

Two workers drain a queue with the default dispatch lease (300 s); one dies mid-task: a
whole prefork worker ``kill -9``ed (on RabbitMQ and on Redis), one prefork child
``kill -9``ed, a threads worker ``kill -9``ed, a host lost (the worker frozen, on either
broker); and a PHP runner process ``kill -9``ed under a live worker of either pool.
RabbitMQ redelivers the dead one's messages (``acks_late``, ``reject_on_worker_lost``)
and their copies hand back every lease no live run holds (``bridge.engine.redelivery``);
on Redis, beat's rescue hands back the leases of messages a dead worker had fetched
(``bridge.runtime.rescue``). Either way the tasks run again in new leases; under a
canary, the dead new-side runs of a shared class fall back instead. Each scenario
prints the re-run delay of the tasks the dead worker was running and the survivor's
rate against its rate before the death; the delay is asserted with a wide margin (60 s
for a 30 s target), the rate only printed (this machine is loaded). A PHP runner process
killed from outside (the OOM killer's SIGKILL) hands its task back at once, no failure
counted (``bridge.transports.php_runner.handler``).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from canary import new_side, set_weights
from celery import Celery
from kombu import Exchange
from kombu import Queue as KombuQueue
from php_standin import STANDIN_ROOT, php_binary

from bridge.canary.guard import read_window
from bridge.canary.weights import labelled
from bridge.config import Settings
from bridge.queue import Lease
from bridge.queue.implementations import CELERY
from bridge.queue.model import RESULT_SUCCESS
from bridge.queue.run_locks import RunLocks
from bridge.queue.schema import worker_archivetask as archive
from bridge.runtime.dispatch import EXECUTE_TASK

TASKS = 120
SECONDS = 0.4  # long enough that a kill finds the victim mid-task
DEFAULT_LEASE = Settings.__dataclass_fields__["dispatch_lease"].metadata["setting"].default
# On Redis, kombu pops a message (BRPOP) before it records it in its ``unacked`` hash: a
# worker killed (or frozen) between the two loses the message, beat's rescue cannot see
# it, and its row comes back only when its dispatch lease ends (docs/faults.md). Seen in
# about 1 run of 10 of the prefork kill here. The Redis runs take 90 s for that lease, so
# such a loss ends within their wait, and a rescue that did not work still fails them:
# the killed tasks' re-run must come within RERUN_WITHIN, well before the lease.
REDIS_LEASE = 90


def dispatch_lease(broker: str) -> int:
    return REDIS_LEASE if broker == "redis" else int(DEFAULT_LEASE)


RERUN_WITHIN = 60.0  # the target is 30 s; a loaded machine gets a wide margin
WAIT = 120.0


def running_on(bridge, worker: str) -> list[dict[str, Any]]:
    """Runs started on ``worker`` whose task is not archived yet."""
    runs = [r for r in bridge.fault_runs() if r["worker"] == worker]
    done = set(bridge.archived([r["id"] for r in runs]))
    return [r for r in runs if r["id"] not in done]


def rate(runs: list[dict[str, Any]], start: float, end: float) -> float:
    return sum(start <= r["time"] < end for r in runs) / max(end - start, 1e-6)


def report(
    run, victim: str, survivor: str, killed: list[dict[str, Any]], at: float, lease: int
) -> None:
    """Print the re-run delays and the survivor's rates; assert the delays' margin."""
    bridge = run.bridge
    runs = bridge.fault_runs()
    rows = bridge.archived([dead["id"] for dead in killed])
    # A run that ended between its sighting and the kill is no victim.
    killed = [d for d in killed if rows[d["id"]].leaseOwner != labelled(d["owner"], "native")]
    assert killed, "the kill found no task mid-run"
    delays = []
    for dead in killed:
        again = [r["time"] for r in runs if r["id"] == dead["id"] and r["time"] > at]
        assert again, f"task {dead['id']} never ran again"
        delays.append(min(again) - at)
        assert {r["owner"] for r in runs if r["id"] == dead["id"]} != {dead["owner"]}
    # The survivor's rate while it had work: up to the last task that was not the dead
    # worker's (those come back later, and waiting for them is the re-run delay).
    victims = {dead["id"] for dead in killed}
    ends = [r.dateModified for i, r in bridge.archived(run.ids).items() if i not in victims]
    theirs = [r for r in runs if r["worker"] == survivor]
    first = min(r["time"] for r in runs)
    before, after = rate(theirs, first, at), rate(theirs, at, float(max(ends)))
    print(
        f"\n[fault] {victim} killed: re-run after {', '.join(f'{d:.1f}' for d in delays)} s "
        f"(dispatch lease {lease} s); survivor {before:.1f}/s before, "
        f"{after:.1f}/s after ({after / before:.2f}x)"
    )
    assert max(delays) <= RERUN_WITHIN, delays


def fleet(bridge, victim_extra: tuple[str, ...] = ()):
    queues = [bridge.default_queue, bridge.control_queue]
    victim = bridge.worker("victim", queues, concurrency=2, extra=victim_extra)
    survivor = bridge.worker("survivor", queues, concurrency=2)
    bridge.wait_ready(victim, survivor)
    bridge.beat()
    return victim, survivor


def mid_task(run, worker: str) -> list[dict[str, Any]]:
    """Once 30% is archived, the runs ``worker`` is in the middle of."""
    run.wait_fraction(0.3)
    return run.bridge.wait_until(lambda: running_on(run.bridge, worker), WAIT, "a run mid-task")


@pytest.mark.parametrize(
    ("pool", "broker"), [("prefork", "rabbitmq"), ("threads", "rabbitmq"), ("prefork", "redis")]
)
def test_a_killed_worker_s_tasks_run_again_within_seconds(
    fault_database, make_fault_bridge, fault_run, request, pool, broker
) -> None:
    url = request.getfixturevalue(f"fault_{broker}").url
    lease = dispatch_lease(broker)
    bridge = make_fault_bridge(fault_database, url, DISPATCH_LEASE=str(lease))
    victim, _ = fleet(bridge, ("-P", "threads") if pool == "threads" else ())
    run = fault_run(bridge)
    run.queue(TASKS, duration=SECONDS)
    run.start()
    killed = mid_task(run, "victim")
    at = time.time()
    victim.kill()
    run.over()
    run.check()
    report(run, f"{pool} worker on {broker}", "survivor", killed, at, lease)


@pytest.mark.parametrize("broker", ["rabbitmq", "redis"])
def test_a_lost_host_s_tasks_run_again_within_seconds(
    fault_database, make_fault_bridge, fault_run, request, broker
) -> None:
    """A host that vanishes sends nothing more, not even a connection's end: its worker is
    frozen (SIGSTOP, the whole process group). RabbitMQ gives up on its connection after
    the heartbeat (10 s) and the database ends its run locks' sessions after their
    ``wait_timeout`` (10 s); on Redis, beat's rescue hands the leases back 4 s after
    their locks were freed (``bridge.runtime.rescue``)."""
    url = request.getfixturevalue(f"fault_{broker}").url
    lease = dispatch_lease(broker)
    bridge = make_fault_bridge(fault_database, url, DISPATCH_LEASE=str(lease))
    victim, _ = fleet(bridge)
    run = fault_run(bridge)
    run.queue(TASKS, duration=SECONDS)
    run.start()
    killed = mid_task(run, "victim")
    at = time.time()
    os.killpg(victim.pid, signal.SIGSTOP)
    try:
        run.over()
        run.check()
        report(run, f"host lost on {broker}", "survivor", killed, at, lease)
    finally:
        victim.kill()


FELL_BACK = re.compile(r"rescue: redelivered: .* fallen back to the old side \(([^)]*)\)")


def rescue_lines(beat) -> list[str]:
    """Beat's lines about what its rescue did (``bridge.runtime.rescue``)."""
    return [line for line in beat.log().splitlines() if "rescue: redelivered:" in line]


def fallen_back(lines: list[str]) -> set[int]:
    """The ids those lines say fell back."""
    return {
        int(i) for line in lines if (m := FELL_BACK.search(line)) for i in re.findall(r"\d+", m[1])
    }


def test_a_killed_worker_s_new_side_runs_of_a_shared_class_fall_back_on_redis(
    fault_database, fault_redis, make_fault_bridge, fault_run
) -> None:
    """``FaultTask`` shared at 50% with phd (none runs here), a prefork worker ``kill -9``ed
    on Redis: beat's rescue falls back what the dead worker held, as a redelivered copy
    does on RabbitMQ. Those rows go to phd (failureTime set, no failure counted) and never
    run again on the bridge, the guard's window counts each as a new-side fallback, phd's
    share is untouched and nothing is archived as failed. Then the class moves wholly to
    the bridge, and every task runs, once a lease."""
    lease = dispatch_lease("redis")
    bridge = make_fault_bridge(fault_database, fault_redis.url, DISPATCH_LEASE=str(lease))
    set_weights(bridge.engine, {"FaultTask": {"celery": 50}})
    victim, _ = fleet(bridge)
    [beat] = [process for process in bridge.processes if process.name == "beat"]
    run = fault_run(bridge)
    ids = run.queue(TASKS, duration=SECONDS)
    ours = new_side(CELERY, 50, ids)
    phds = set(ids) - ours
    assert ours and phds
    run.start()
    killed = {dead["id"] for dead in mid_task(run, "victim")}
    at = time.time()
    victim.kill()
    bridge.wait_until(lambda: fallen_back(rescue_lines(beat)), WAIT, "a fallback by the rescue")
    delay = time.time() - at

    def settled() -> bool:
        """Each row of the bridge's share archived or fallen back, none leased."""
        rows = bridge.active_rows(sorted(ours)).values()
        return all(row.failureTime is not None and row.leaseOwner is None for row in rows)

    bridge.wait_until(settled, WAIT, "the bridge's share archived or fallen back")
    lines = rescue_lines(beat)
    fell = fallen_back(lines)
    assert not any("handed back (" in line for line in lines), "none back to the new side"
    rows = bridge.active_rows(ids)
    assert {i for i, row in rows.items() if row.failureTime is not None} == fell
    assert fell <= ours and rows.keys() - fell == phds, "only the dead new-side runs fell back"
    assert {(rows[i].failureCount, rows[i].leaseOwner) for i in fell} == {(0, None)}
    assert {(rows[i].leaseOwner, rows[i].failureTime) for i in phds} == {(None, None)}
    runs = Counter(r["id"] for r in bridge.fault_runs())
    assert all(runs[i] == 1 for i in killed) and all(runs[i] <= 1 for i in fell)
    assert not runs.keys() & phds, "phd's share never ran on the bridge"
    archived = bridge.archived(ids)
    assert archived.keys() == ours - fell
    assert {row.result for row in archived.values()} == {RESULT_SUCCESS}
    window = read_window(bridge.engine, "FaultTask", CELERY, 300, 2000)
    assert (window.new.runs, window.new.fallbacks) == (len(ours), len(fell))
    print(
        f"\n[fault] prefork worker on redis, a class shared at 50%: {len(fell)} new-side "
        f"run(s) fallen back {delay:.1f} s after the kill ({len(killed)} seen mid-task)"
    )

    set_weights(bridge.engine, {"FaultTask": {"celery": 100}})  # phd's work, run here
    run.over()
    run.check()


def test_a_killed_prefork_child_s_task_runs_again_within_seconds(
    fault_database, fault_rabbitmq, make_fault_bridge, fault_run
) -> None:
    bridge = make_fault_bridge(fault_database, fault_rabbitmq.url, DISPATCH_LEASE=DEFAULT_LEASE)
    fleet(bridge)
    run = fault_run(bridge)
    run.queue(TASKS, duration=SECONDS)
    run.start()
    [dead, *_] = mid_task(run, "victim")
    at = time.time()
    os.kill(dead["pid"], signal.SIGKILL)
    run.over()
    run.check()
    assert bridge.count(archive, archive.c.id.in_(run.ids)) == TASKS
    report(run, "prefork child", "survivor", [dead], at, int(DEFAULT_LEASE))


def test_a_copy_leaves_a_live_run_alone_and_hands_its_lease_back_once_it_is_gone(
    fault_database, fault_rabbitmq, make_fault_bridge
) -> None:
    """A copy of a message whose run lock a live process holds (a partition, a broker
    restart) never runs the task, and watches: once the lock is free (that process died
    after all), a later copy hands the lease back and the task runs once, in a new lease."""
    bridge = make_fault_bridge(fault_database, fault_rabbitmq.url, DISPATCH_LEASE=DEFAULT_LEASE)
    worker = bridge.worker("worker", [bridge.default_queue, bridge.control_queue])
    bridge.wait_ready(worker)
    [task_id] = bridge.enqueue("FaultTask", {}, count=1)
    owner, [item] = bridge.queue.lease_to_send(1, "bridge", int(DEFAULT_LEASE), ["FaultTask"], 1024)
    lease = Lease(item.id, owner, item.failure_count)
    live = RunLocks(bridge.queue.engine)  # the run that goes on, cut off from the broker
    assert live.hold([lease]) == [True]
    target = KombuQueue(bridge.default_queue, Exchange(bridge.default_queue, "direct"))
    app = Celery(broker=bridge.broker_url)
    try:
        app.send_task(
            EXECUTE_TASK,
            (item.id, owner, item.failure_count),
            {"task_class": "FaultTask", "watch": 1},  # as the first copy's watch sends it
            queue=target,
            routing_key=bridge.default_queue,
        )
        bridge.wait_until(
            lambda: worker.log().count(f"[task={task_id} ") >= 2, WAIT, "two watching copies"
        )
        assert not bridge.fault_runs(), "a copy never runs a task a live run holds"
        assert bridge.active_rows([task_id])[task_id].leaseOwner == owner
    finally:
        live.close()  # its process dies: the server frees its locks
    bridge.wait_archived([task_id], timeout=WAIT)
    [run] = bridge.fault_runs()
    assert run["owner"] != owner, "run once, in a new lease"


PHP_TASKS = 40
PHP_MS = 1000  # each slot is busy all but milliseconds of a second: a kill finds a run
KILL_TRIES = 5


def php_runners() -> list[int]:
    """The pids of every PHP runner process on this host."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and b"phorge-bridge-runner.php" in (entry / "cmdline").read_bytes()
            ):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def handed_back_after_kill(log: str, pid: int) -> int | None:
    """The task the killed process ``pid`` was running, as the worker's log names it."""
    line = rf"task (\d+) \(StandinSleepWorker\): PHP runner process {pid}: .*handed back"
    found = re.search(line, log)
    return int(found.group(1)) if found else None


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_killed_php_runner_process_s_task_runs_again_within_seconds(
    fault_database, fault_rabbitmq, make_fault_bridge, fault_run, pool
) -> None:
    php_binary()
    bridge = make_fault_bridge(
        fault_database,
        fault_rabbitmq.url,
        DISPATCH_LEASE=DEFAULT_LEASE,
        PHORGE_ROOT=str(STANDIN_ROOT),
        RUNNER_CLASSES="Standin*",
        HANDLERS_EXCLUDE="StandinSucceedWorker",  # follow-ups stay queued, never leased
    )
    others = set(php_runners())  # another engineer's suite may run PHP runners too
    worker = bridge.worker(
        "worker",
        [bridge.default_queue, bridge.control_queue],
        concurrency=2,
        extra=("-P", "threads") if pool == "threads" else (),
    )
    bridge.wait_ready(worker)
    bridge.beat()
    run = fault_run(bridge)
    run.add(bridge.enqueue("StandinSleepWorker", {"ms": PHP_MS}, count=PHP_TASKS), RESULT_SUCCESS)
    run.start()
    run.wait_fraction(0.3)
    tried: set[int] = set()
    for _ in range(KILL_TRIES):  # a runner idle between two tasks dies harmlessly
        [victim, *_] = sorted(set(php_runners()) - others - tried)
        tried.add(victim)
        at, archived_at = time.time(), time.monotonic()
        os.kill(victim, signal.SIGKILL)
        task_id = bridge.wait_until(
            lambda v=victim: (
                handed_back_after_kill(worker.log(), v)
                or (f"PHP runner {v} replaced (died)" in worker.log() and -1)
            ),
            WAIT,
            "the killed run handed back, or an idle runner replaced",
        )
        if task_id != -1:
            break
    else:
        pytest.fail(f"{KILL_TRIES} kills found no runner mid-task")
    bridge.wait_archived([task_id], timeout=WAIT)
    delay = time.time() - at
    run.over()
    run.check()
    [row] = bridge.archived([task_id]).values()
    assert row.failureCount == 0, "a kill from outside counts no failure"
    print(
        f"\n[fault] PHP runner process killed ({pool} worker): task #{task_id} archived "
        f"{delay:.1f} s after the kill (a {PHP_MS / 1000:.0f} s run; was 300 s, Phorge's "
        f"retry wait, and one failure counted); queue {sampler_rate_ratio(run, archived_at):.2f}x "
        "its rate before"
    )
    assert delay <= RERUN_WITHIN, delay


def sampler_rate_ratio(run, at: float) -> float:
    """The queue's archive rate after ``at`` (monotonic) against its rate before."""
    assert run.sampler is not None
    samples = run.sampler.samples
    moving = [(t, n) for t, n in samples if 0 < n < len(run.ids)]
    before = [(t, n) for t, n in moving if t <= at]
    after = [(t, n) for t, n in moving if t > at]
    if len(before) < 2 or len(after) < 2:
        return float("nan")
    rate_before = (before[-1][1] - before[0][1]) / max(before[-1][0] - before[0][0], 1e-6)
    rate_after = (after[-1][1] - after[0][1]) / max(after[-1][0] - after[0][0], 1e-6)
    return rate_after / max(rate_before, 1e-6)
