"""``bridge.poll`` in process, on MariaDB: what is leased, how much, and where it is sent.

``poll_once`` runs against a real database; the ``bridge.execute`` messages it would
send are recorded instead of published (the acceptance tests publish them for real).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import outcomes
import pytest
from bad_rows import corrupt_data
from conduit_fakes import TOKEN, FakeServer, Reply, conduit_result
from sqlalchemy import Engine, event, text, update

from bridge.celery import app
from bridge.config import load_settings
from bridge.engine import pace, poll
from bridge.engine.context import Runtime
from bridge.handlers.api import Handler, TaskContext
from bridge.handlers.registry import Registry
from bridge.queue import PhorgeQueue, make_engine
from bridge.queue.dialect import LOCK_IDLE_TIMEOUT, db_now, lock_engine
from bridge.queue.model import Lease, NewTask, TaskFilter, lease_epoch
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_archivetask as archive
from bridge.runtime import dispatch
from bridge.transports.conduit.client import ConduitClient
from bridge.transports.conduit.handler import ConduitProxyHandler

pytestmark = pytest.mark.mariadb

FAST, SLOW, OTHER = "FastWorker", "SlowWorker", "OtherWorker"
DISPATCH_LEASE, POLL_INTERVAL = 300, 1.0


class Noop(Handler):
    task_classes = (FAST, SLOW, OTHER)

    def run(self, task: TaskContext) -> None:
        pass


@dataclass
class Message:
    task_id: int
    owner: str
    failure_count: int
    data: str | None
    task_class: str
    queue: str
    argsrepr: str
    kwargsrepr: str
    repoll: bool
    batch: int  # how many tasks its message carried


@pytest.fixture
def sent(monkeypatch) -> list[Message]:
    """The tasks polls send, in order, one entry a task (a batch message gives several)."""
    messages: list[Message] = []

    def publish(_app, producer, queue, name, args, kwargs, argsrepr, kwargsrepr, traceparent):
        # Every message carries a trace context of its own for the execution to keep.
        assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", traceparent)
        repoll = kwargs.get("repoll", False)
        if name == dispatch.EXECUTE_TASK:
            task_id, owner, failure_count = args
            tasks = [[task_id, failure_count, kwargs["task_class"], kwargs.get("data")]]
        else:
            assert name == dispatch.EXECUTE_BATCH and set(kwargs) <= {"repoll"}
            owner, tasks = args
        for task_id, failure_count, task_class, data in tasks:
            messages.append(
                Message(
                    task_id,
                    owner,
                    failure_count,
                    data,
                    task_class,
                    queue.name,
                    argsrepr,
                    kwargsrepr,
                    repoll,
                    len(tasks),
                )
            )

    monkeypatch.setattr(dispatch, "publish", publish)
    return messages


@pytest.fixture
def make_runtime(mysql_engine: Engine) -> Iterator[Callable[..., Runtime]]:
    """``make_runtime(ROUTES="FastWorker=fast", ...)``: a Runtime on the test database."""
    url = mysql_engine.url.render_as_string(hide_password=False)
    queues: list[PhorgeQueue] = []

    def make(**settings: str) -> Runtime:
        env = {
            "BRIDGE_DATABASE_URL": url,
            "BRIDGE_BROKER_URL": "amqp://unused//",
            "BRIDGE_DISPATCH_LEASE": str(DISPATCH_LEASE),
            "BRIDGE_POLL_INTERVAL": str(POLL_INTERVAL),
            # Most tests here pin the capacity rules; the pace's own tests turn it on.
            "BRIDGE_DISPATCH_AHEAD": "off",
            **{f"BRIDGE_{name}": value for name, value in settings.items()},
        }
        config = load_settings(env)
        registry = Registry(
            [Noop()], include=config.handlers_include, exclude=config.handlers_exclude
        )
        queues.append(PhorgeQueue(make_engine(url)))
        return Runtime(config, queues[-1], registry)

    yield make
    for queue in queues:
        queue.engine.dispose()


def poll_once(rt: Runtime) -> int:
    """One poll, sending through the Celery runtime's dispatch (its publish recorded)."""
    return poll.poll_once(rt, partial(dispatch.send, app))


def enqueue(rt: Runtime, task_class: str, count: int = 1, data: Any = None, **options) -> list[int]:
    return rt.queue.enqueue_many([NewTask(task_class, data, **options)] * count)


def per_queue(messages: list[Message]) -> Counter:
    return Counter((m.task_class, m.queue) for m in messages)


def test_each_leased_task_goes_to_its_class_queue_with_its_lease_and_label(make_runtime, sent):
    rt = make_runtime(ROUTES="Fast*=fast")
    [fast] = enqueue(rt, FAST, data={"n": 1})
    [slow] = enqueue(rt, SLOW)
    assert poll_once(rt) == 2
    by_id = {m.task_id: m for m in sent}
    assert (by_id[fast].queue, by_id[slow].queue) == ("fast", "phorge")
    for task_id, message in by_id.items():
        [task] = rt.queue.list(TaskFilter(ids=[task_id]))
        assert message.owner == task.lease_owner and message.owner.startswith("bridge:")
        assert message.failure_count == task.failure_count
        assert message.data == task.raw_data
        assert message.argsrepr == repr((task.label,))
        assert message.kwargsrepr == repr({task.id: task.task_class})
        assert task.lease_expires - task.server_time in (DISPATCH_LEASE, DISPATCH_LEASE - 1)


def test_large_data_stays_in_the_database(make_runtime, sent):
    rt = make_runtime(INLINE_DATA_MAX="20")
    [small] = enqueue(rt, FAST, data={"n": 1})
    [large] = enqueue(rt, FAST, data={"text": "x" * 100})
    poll_once(rt)
    data = {m.task_id: m.data for m in sent}
    assert data == {small: '{"n":1}', large: None}


def test_the_inline_limit_counts_bytes_not_characters(make_runtime, sent):
    rt = make_runtime(INLINE_DATA_MAX="20")
    [ascii_] = enqueue(rt, FAST, data={"t": "x" * 12})  # {"t":"xxxxxxxxxxxx"}: 20 bytes
    [accented] = enqueue(rt, FAST, data={"t": "é" * 12})  # 20 characters, 32 bytes
    poll_once(rt)
    data = {m.task_id: m.data for m in sent}
    assert data == {ascii_: '{"t":"' + "x" * 12 + '"}', accented: None}


def test_a_non_utf8_data_row_is_sent_without_its_data_and_leases_the_rest(make_runtime, sent):
    rt = make_runtime()
    ids = enqueue(rt, FAST, 3, data={"n": 1})
    corrupt_data(rt.queue, ids[1])
    assert poll_once(rt) == 3
    data = {m.task_id: m.data for m in sent}
    # The worker reads it from the database and fails that task alone (test_execute).
    assert data == {ids[0]: '{"n":1}', ids[1]: None, ids[2]: '{"n":1}'}


def test_each_queue_leases_only_up_to_its_free_capacity(make_runtime, sent):
    rt = make_runtime(ROUTES="Fast*=fast", MAX_INFLIGHT="5,fast=2")
    fast = enqueue(rt, FAST, count=10)
    enqueue(rt, SLOW, count=10)
    poll_once(rt)
    assert per_queue(sent) == {(FAST, "fast"): 2, (SLOW, "phorge"): 5}

    sent.clear()
    assert poll_once(rt) == 0, "leases in flight are counted"
    first = next(t for t in rt.queue.list(TaskFilter(ids=fast)) if t.lease_owner)
    outcomes.complete(rt.queue, first.id, first.lease_owner, 1)
    poll_once(rt)
    assert per_queue(sent) == {(FAST, "fast"): 1}


def test_a_flood_in_one_queue_does_not_starve_another(make_runtime, sent):
    rt = make_runtime(ROUTES="Fast*=fast", MAX_INFLIGHT="10")
    enqueue(rt, FAST, count=200, priority=1)
    [slow] = enqueue(rt, SLOW, priority=5000)
    poll_once(rt)
    assert per_queue(sent) == {(FAST, "fast"): 10, (SLOW, "phorge"): 1}
    assert slow in {m.task_id for m in sent}


@pytest.mark.parametrize(
    ("settings", "leased"),
    [
        ({}, {FAST, SLOW}),
        ({"HANDLERS_EXCLUDE": "Slow*"}, {FAST}),
        ({"HANDLERS_INCLUDE": "Fast*,Other*"}, {FAST}),
    ],
    ids=["native-only", "excluded", "included"],
)
def test_only_classes_the_bridge_can_run_are_leased(make_runtime, sent, settings, leased):
    rt = make_runtime(**settings)
    enqueue(rt, FAST)
    enqueue(rt, SLOW)
    [php_only] = enqueue(rt, "PhabricatorSearchWorker")
    poll_once(rt)
    assert {m.task_class for m in sent} == leased
    unleased = [t for t in rt.queue.list(TaskFilter(active=True)) if t.lease_owner is None]
    assert php_only in {t.id for t in unleased}


def test_proxied_classes_wait_while_conduit_is_down(make_runtime, sent):
    """The poll's process may never have run a proxied task: it probes Conduit itself."""
    up = False

    def respond(request) -> Reply:
        return conduit_result({"userName": "bot"}) if up else Reply(502, b"Bad Gateway")

    with FakeServer(respond) as server:
        rt = make_runtime()
        proxy = rt.registry.fallback = ConduitProxyHandler(ConduitClient(server.url, TOKEN))
        enqueue(rt, FAST)
        [php_only] = enqueue(rt, "PhabricatorSearchWorker")
        poll_once(rt)
        assert {m.task_class for m in sent} == {FAST} and proxy.availability.is_down
        up = True
        proxy.availability._next_probe = 0  # the next probe is due
        poll_once(rt)
        assert [m.task_id for m in sent[1:]] == [php_only] and not proxy.availability.is_down


def test_expired_leases_are_leased_again_under_a_new_owner(make_runtime, sent):
    rt = make_runtime()
    [task_id] = enqueue(rt, FAST)
    poll_once(rt)
    [first] = sent
    with rt.queue.engine.begin() as conn:
        conn.execute(update(active).values(leaseExpires=db_now() - 1))
    poll_once(rt)
    [_, second] = sent
    assert second.task_id == task_id and second.owner != first.owner


def test_rows_waiting_to_retry_are_not_in_flight(make_runtime, sent):
    rt = make_runtime(MAX_INFLIGHT="1")
    [failed] = enqueue(rt, FAST)
    poll_once(rt)
    outcomes.fail_temporary(rt.queue, failed, sent[0].owner, 600)
    enqueue(rt, FAST)
    assert poll_once(rt) == 1


def test_another_bridges_leases_do_not_use_this_bridges_capacity(make_runtime, sent):
    """Two bridges on one Phorge database, owner prefixes 'bridge' and 'bridge-eu'."""
    rt = make_runtime(MAX_INFLIGHT="2")
    enqueue(rt, FAST, count=4)
    rt.queue.lease(2, DISPATCH_LEASE, owner_prefix="bridge-eu", classes=[FAST])
    assert poll_once(rt) == 2


def test_a_broker_refusal_hands_back_the_unsent_leases(make_runtime, monkeypatch):
    rt = make_runtime()
    ids = enqueue(rt, FAST, count=3)
    sent_ids = []

    def refuse_after_one(_app, producer, queue, name, args, *_rest) -> None:
        if sent_ids:
            raise ConnectionError("broker went away")
        sent_ids.append(args[0])

    monkeypatch.setattr(dispatch, "publish", refuse_after_one)
    assert poll_once(rt) == 1
    owners = {t.id: t.lease_owner for t in rt.queue.list(TaskFilter(ids=ids))}
    assert owners[sent_ids[0]] is not None
    assert [owner for task_id, owner in owners.items() if task_id not in sent_ids] == [None] * 2


class Killed(BaseException):
    """The poll's process dying mid-send: nothing after it runs (no hand-back)."""


def test_a_poll_killed_before_sending_leaves_its_rows_due_within_seconds(make_runtime, monkeypatch):
    """Leased for ``SEND_LEASE`` s, then for the dispatch lease once the broker took the
    message: rows a dead poll never sent are due again in seconds, not 300."""
    rt = make_runtime()
    ids = enqueue(rt, FAST, count=3)
    sent_ids = []

    def die_after_one(_app, producer, queue, name, args, *_rest) -> None:
        if sent_ids:
            raise Killed
        sent_ids.append(args[0])

    monkeypatch.setattr(dispatch, "publish", die_after_one)
    with pytest.raises(Killed):
        poll_once(rt)
    leases = {t.id: t.lease_expires - t.server_time for t in rt.queue.list(TaskFilter(ids=ids))}
    assert all(0 < leases[i] <= poll.SEND_LEASE for i in ids), leases
    monkeypatch.undo()
    assert poll_once_sending_all(rt) == 0, "the dead poll's rows are leased until then"
    rt.queue.extend_sent(ids[:1], "someone-else", DISPATCH_LEASE)  # fenced on the owner
    assert max(t.lease_expires - t.server_time for t in rt.queue.list(TaskFilter(ids=ids))) <= (
        poll.SEND_LEASE
    )


def test_a_run_that_failed_before_its_poll_gave_the_dispatch_lease_keeps_its_retry_wait(
    make_runtime,
):
    """The worker can run a message, and fail it, before the poll's UPDATE that gives the
    sent rows their dispatch lease: the row keeps its owner, and its retry wait stays."""
    rt = make_runtime()
    [task_id] = enqueue(rt, FAST)

    def run_and_fail_at_once(owner, tasks, queue, size, repoll_at=None) -> int:
        for task in tasks:
            assert outcomes.fail_temporary(rt.queue, task.id, owner, 5)
        return len(tasks)

    assert poll.poll_once(rt, run_and_fail_at_once) == 1
    [task] = rt.queue.list(TaskFilter(ids=[task_id]))
    assert task.failure_count == 1 and 0 < task.lease_expires - task.server_time <= 5


def poll_once_sending_all(rt: Runtime) -> int:
    return poll.poll_once(rt, lambda owner, tasks, queue, size, repoll_at=None: len(tasks))


def test_paced_every_dispatch_marks_its_middle_message(make_runtime, sent):
    rt = make_runtime(DISPATCH_AHEAD="0.25")
    enqueue(rt, FAST, count=5)
    assert poll_once(rt) == pace.FLOOR
    assert [m.repoll for m in sent] == [False, True]
    sent.clear()
    enqueue(rt, FAST, priority=1000)  # the urgent lane: a message each, no mark
    assert poll_once(rt) == 1
    assert [m.repoll for m in sent] == [False]


def test_unpaced_a_dispatch_of_half_the_capacity_or_more_marks_its_middle_task(make_runtime, sent):
    rt = make_runtime(MAX_INFLIGHT="10")
    enqueue(rt, FAST, count=6)
    assert poll_once(rt) == 6
    assert [m.repoll for m in sent] == [False, False, False, True, False, False]
    sent.clear()
    enqueue(rt, FAST, count=4)  # capacity 4 left: less than half of 10, no mark
    assert poll_once(rt) == 4
    assert not any(m.repoll for m in sent)


def test_a_backlog_travels_in_batches_and_a_light_load_one_message_a_task(make_runtime, sent):
    rt = make_runtime(MAX_INFLIGHT="500")
    enqueue(rt, FAST, count=63)  # below two messages' worth a process: one a task
    assert poll_once(rt) == 63
    assert {m.batch for m in sent} == {1}
    sent.clear()
    ids = enqueue(rt, FAST, count=300)
    assert poll_once(rt) == 300
    # 363 leases in flight: 11 tasks a message (363 // 32), so about 32 messages are
    # queued for 32 processes, however many rows each poll finds.
    assert sorted(m.task_id for m in sent) == ids
    assert {m.batch for m in sent} == {11, 300 % 11}
    assert len({m.owner for m in sent}) == 1
    sent.clear()
    ids = enqueue(rt, FAST, count=20)  # a few rows, in a queue holding many leases
    assert poll_once(rt) == 20
    assert [m.batch for m in sent] == [11] * 11 + [9] * 9


def test_a_batch_never_exceeds_the_configured_maximum(make_runtime, sent):
    rt = make_runtime(MAX_INFLIGHT="500", BATCH_MAX="4")
    enqueue(rt, FAST, count=400)
    assert poll_once(rt) == 400
    assert {m.batch for m in sent} == {4}
    rt = make_runtime(MAX_INFLIGHT="500", BATCH_MAX="1")
    sent.clear()
    enqueue(rt, SLOW, count=100)
    assert poll_once(rt) == 100
    assert {m.batch for m in sent} == {1}


def test_a_poll_overlapping_another_dispatches_nothing(make_runtime, sent):
    rt = make_runtime()
    enqueue(rt, FAST, count=3)
    with rt.queue.poll_lock(rt.settings.owner_prefix):
        assert poll_once(rt) == 0
    assert poll_once(rt) == 3


def test_a_poll_of_an_empty_queue_sends_only_the_lock_and_the_class_read(make_runtime, sent):
    # Beat polls four times a second by default: the idle load is this poll's cost.
    rt = make_runtime()
    statements: list[str] = []

    def record(conn, cursor, statement, *_: Any) -> None:
        statements.append(statement.split()[1].split("(")[0].lower())

    event.listen(rt.queue.engine, "before_cursor_execute", record)
    event.listen(lock_engine(rt.queue.engine), "before_cursor_execute", record)
    assert poll_once(rt) == 0
    assert statements == ["get_lock", "distinct", "release_lock"]
    assert sent == []


def test_lease_owners_carry_the_database_clock(make_runtime, sent, monkeypatch):
    rt = make_runtime()
    enqueue(rt, FAST)
    monkeypatch.setattr("time.time", lambda: 4_000_000_000.0)  # this host's clock is off
    assert poll_once(rt) == 1
    [task] = rt.queue.list(TaskFilter(classes=[FAST]))
    assert abs(lease_epoch(task.lease_owner) - task.server_time) <= 1


# -- the pace: a backlog waits in the database, in priority order ------------------------


def archive_runs(rt: Runtime, task_class: str, count: int, seconds: float, over: int) -> None:
    """``count`` runs of ``task_class`` archived, ``seconds`` each, spread evenly over the
    last ``over`` seconds (the history :meth:`PhorgeQueue.recent_runs` reads)."""
    enqueue(rt, task_class, count=count)
    leased = rt.queue.lease(count, classes=[task_class])
    for task in leased:
        lease = Lease(task.id, task.lease_owner, task.failure_count)
        assert rt.queue.session.complete(lease, int(seconds * 1e6))
    with rt.queue.engine.begin() as conn:
        for index, task in enumerate(leased):
            ago = over * (index + 1) // count
            conn.execute(
                update(archive).where(archive.c.id == task.id).values(dateModified=db_now() - ago)
            )


def test_a_queue_with_no_recent_runs_starts_with_two_leases(make_runtime, sent):
    rt = make_runtime(DISPATCH_AHEAD="0.25")
    enqueue(rt, FAST, count=50)
    assert poll_once(rt) == pace.FLOOR
    assert poll_once(rt) == 0, "the two in flight are all it may hold"


def test_short_tasks_fill_up_to_the_inflight_limit(make_runtime, sent):
    # No-op work: 0.25 s / 1 ms is 250 leases, still under a quarter second of work.
    rt = make_runtime(DISPATCH_AHEAD="0.25", MAX_INFLIGHT="200")
    archive_runs(rt, FAST, count=pace.SHORT_EVIDENCE, seconds=0.001, over=2)
    enqueue(rt, FAST, count=300)
    assert poll_once(rt) == 200


def test_slow_tasks_lease_what_the_busy_slots_start_before_the_next_poll(make_runtime, sent):
    # Runs of 1.3 s, 2 a second over the pace's window: 2.6 busy slots, so floor(1.25 x
    # 2.6 + 2 x 0.25) = 3 leases, a message each (one message may carry at most 0.25 s of
    # work). Still 3 if the poll reads the history up to 2 s late (a loaded machine): the
    # span grows to 12 s, 1.67 a second, floor(1.25 x 2.17 + 1.67 x 0.25) = 3.
    rt = make_runtime(DISPATCH_AHEAD="0.25")
    archive_runs(rt, SLOW, count=2 * pace.WINDOW, seconds=1.3, over=pace.WINDOW)
    ids = enqueue(rt, SLOW, count=50)
    assert poll_once(rt) == 3
    assert [m.task_id for m in sent] == ids[:3]
    assert {m.batch for m in sent} == {1}


def test_an_urgent_task_is_leased_even_when_its_queue_is_at_its_pace(make_runtime, sent):
    rt = make_runtime(DISPATCH_AHEAD="0.25")
    enqueue(rt, FAST, count=50, priority=4000)
    assert poll_once(rt) == pace.FLOOR
    sent.clear()
    [mail] = enqueue(rt, FAST, priority=1000)
    enqueue(rt, FAST, priority=4000)
    assert poll_once(rt) == 1
    assert [(m.task_id, m.batch) for m in sent] == [(mail, 1)]
    assert poll_once(rt) == 0, "only rows more urgent than every lease take the lane"


def test_no_urgent_lane_beyond_the_inflight_limit(make_runtime, sent):
    rt = make_runtime(DISPATCH_AHEAD="0.25", MAX_INFLIGHT="2")
    enqueue(rt, FAST, count=5, priority=4000)
    assert poll_once(rt) == 2
    enqueue(rt, FAST, priority=1000)
    assert poll_once(rt) == 0


def test_the_poll_lock_s_session_is_dropped_by_the_server_when_silent(make_runtime):
    """A host lost mid-poll must not hold the poll lock for the server's wait_timeout of
    hours: the lock's session ends after LOCK_IDLE_TIMEOUT seconds of silence."""
    rt = make_runtime()
    with lock_engine(rt.queue.engine).connect() as conn:
        timeout = conn.execute(text("SELECT @@session.wait_timeout")).scalar_one()
    assert timeout == LOCK_IDLE_TIMEOUT
    with rt.queue.engine.connect() as conn:
        assert conn.execute(text("SELECT @@session.wait_timeout")).scalar_one() > timeout
