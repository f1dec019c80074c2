"""``--autoscale`` under a backlog: the pool grows to its maximum, shrinks back once the
backlog has drained, and no scale-down kills a task (issue 29).

Celery's scale-down terminates the processes billiard finds inactive, and a process
that has just started a task is one until the main process reads its ack: a shrink at
that moment killed the task, whose message was acked already, and its row waited out the
dispatch lease (300 s) while the rest drained in 17 s. Celery's own scale-downs meet
that moment only now and then (at the edges of a burst), so the test provokes it: while
the backlog drains it asks the worker to shrink to one process and grow back
(``celery control autoscale 1 1``, then ``8 1``) twice a second, and a keepalive of
5 s (Celery's ``AUTOSCALE_KEEPALIVE``, 30 s by default) has the autoscaler try its own
scale-downs all along. With Celery's autoscaler each of three runs had 2 to 5 messages
killed this way (WorkerLostError), and their stranded leases, counted as in flight, held
the queue's pace back: none drained within 120 s. The bridge's autoscaler
(``bridge.runtime.autoscale``) puts every shrink off until the pool is idle. Without an
event loop (the SQLite broker) Celery's autoscaling loses tasks in other ways, so the
bridge refuses it there.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from bridge_harness import Bridge, wait_until
from celery import Celery

from bridge.queue.model import RESULT_SUCCESS
from bridge.queue.schema import worker_archivetask as archive
from bridge.runtime.autoscale import WITHOUT_EVENT_LOOP

TASKS, SECONDS = 1500, 0.05  # the backlog
MAX, MIN = 8, 1  # --autoscale=8,1
DRAINED = 0.99  # the backlog has drained when this much of it is archived
TAIL = 10  # seconds the last task may take beyond the drain (it took 285 more)
SHRINK_EVERY = 0.5  # seconds between two shrinks asked for
KEEPALIVE = 5  # seconds after its last growth before the autoscaler tries a scale-down
GROW_TIMEOUT = 60  # seconds each wait may take on a busy two-core machine
DRAIN_TIMEOUT = 120


class Pool:
    """The worker's pool as its autoscaler reports it, over the control API."""

    def __init__(self, app: Celery, node: str) -> None:
        self.control = app.control
        self.node = node
        self.shrinks = 0  # shrinks to MIN the worker confirmed

    def size(self) -> int | None:
        stats = self.control.inspect(destination=[self.node], timeout=2).stats() or {}
        info = stats.get(self.node, {}).get("autoscaler")
        return None if info is None else int(info["current"])

    def autoscale(self, high: int, low: int) -> bool:
        replies = self.control.autoscale(high, low, destination=[self.node], reply=True, timeout=2)
        return any("ok" in reply.get(self.node, {}) for reply in replies or ())

    @contextmanager
    def shrinking(self) -> Iterator[None]:
        """Ask for a shrink to MIN, and the maximum back at once, every SHRINK_EVERY
        seconds until the block ends."""
        stop = threading.Event()

        def shrink() -> None:
            while not stop.wait(SHRINK_EVERY):
                self.shrinks += self.autoscale(MIN, MIN)
                self.autoscale(MAX, MIN)

        thread = threading.Thread(target=shrink, name="shrinks", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.autoscale(MAX, MIN)


def stranded(bridge: Bridge, ids: list[int]) -> str:
    """What a failed wait shows: the tasks not archived (leased ones first) with their
    runs, and how many tasks the worker lost."""
    rows = bridge.active_rows(ids)
    starts = Counter(r["id"] for r in bridge.runs())
    ends = Counter(r["id"] for r in bridge.runs("end"))
    lines = [
        f"  #{i} owner={row.leaseOwner} expires={row.leaseExpires} "
        f"started={starts[i]} ended={ends[i]}"
        for i, row in sorted(rows.items(), key=lambda item: item[1].leaseOwner is None)[:20]
    ]
    lost = bridge.logs().count("WorkerLostError('Worker exited prematurely")
    return "\n".join([f"{len(rows)} task(s) not archived, {lost} WorkerLostError:", *lines])


def test_autoscale_grows_shrinks_back_and_no_shrink_kills_a_task(
    make_bridge, database_url, amqp_url
):
    bridge = make_bridge(database_url, amqp_url)
    worker = bridge.worker(
        "worker",
        [bridge.control_queue, bridge.default_queue],
        extra=(f"--autoscale={MAX},{MIN}",),
        env={"AUTOSCALE_KEEPALIVE": str(KEEPALIVE)},
    )
    bridge.beat()
    bridge.wait_ready(worker)
    with Celery(broker=bridge.broker_url) as app:
        pool = Pool(app, bridge.node("worker"))
        # RecordedA: PhabricatorTestWorker's behaviour, and a line for each run.
        ids = bridge.enqueue("RecordedA", {"duration": SECONDS}, count=TASKS)
        started = time.monotonic()

        def archived() -> int:
            return bridge.count(archive, archive.c.id.in_(ids))

        def wait(condition: Callable[[], object], timeout: float, what: str) -> None:
            wait_until(condition, timeout, what, diagnose=lambda: stranded(bridge, ids))

        wait(lambda: pool.size() == MAX, GROW_TIMEOUT, f"the pool to grow to {MAX}")
        with pool.shrinking():
            wait(lambda: archived() >= DRAINED * TASKS, DRAIN_TIMEOUT, "the backlog to drain")
            drain = time.monotonic() - started
        wait(
            lambda: archived() == TASKS,
            drain + TAIL - (time.monotonic() - started),
            f"the last tasks, within drain + {TAIL} s",
        )
        finished = time.monotonic() - started

        assert pool.shrinks >= drain / SHRINK_EVERY / 2, "too few shrinks to provoke the race"
        rows = bridge.archived(ids)
        assert {row.result for row in rows.values()} == {RESULT_SUCCESS}
        assert Counter(r["id"] for r in bridge.runs()) == Counter(ids), "a task ran twice"
        assert "WorkerLostError" not in worker.log()
        # Seconds in the database: a row created late in one second and archived early in
        # another counts up to a second longer.
        longest = max(row.dateModified - row.dateCreated for row in rows.values())
        assert longest <= drain + TAIL + 1

        wait(lambda: pool.size() == MIN, GROW_TIMEOUT, f"the pool to shrink back to {MIN}")
        print(
            f"\n--autoscale={MAX},{MIN}, {TASKS} tasks of {SECONDS * 1000:.0f} ms, "
            f"{pool.shrinks} shrinks to {MIN} asked for while draining: {DRAINED:.0%} archived "
            f"in {drain:.1f} s, all in {finished:.1f} s, longest enqueue-to-archive {longest} s; "
            f"back to {MIN} process {time.monotonic() - started - finished:.0f} s later"
        )


def test_autoscale_is_refused_without_an_event_loop(make_bridge, database_url, tmp_path):
    bridge = make_bridge(database_url, f"sqla+sqlite:///{tmp_path / 'broker.db'}")
    worker = bridge.worker(
        "worker", [bridge.control_queue, bridge.default_queue], extra=(f"--autoscale={MAX},{MIN}",)
    )
    assert worker.wait(timeout=GROW_TIMEOUT) != 0
    assert f"Error: {WITHOUT_EVENT_LOOP}" in worker.log()
