"""The bridge and Phorge's own PHP on one queue: runs only when PHORGE_ROOT is set.

Every test writes or reads rows through ``PhorgeQueue`` on one side and through
Phorge's own classes on the other (``PhabricatorWorker::scheduleTask``,
``PhabricatorWorkerLeaseQuery``, the active and archive task queries,
``PhabricatorWorkerActiveTask::executeTask``, ``bin/worker``), on the database
Phorge's configuration names, and checks that each side reads exactly what the other
wrote: fields, data (64-bit integers, unicode, bare values), ids from one sequence,
leases neither side steals, archives, and the operator actions.

PHORGE_ROOT must be a Phorge checkout (arcanist beside it) whose ``mysql.*`` settings
point at a MariaDB the bridge can reach, with ``bin/storage upgrade`` done; see
docs/operating.md. The bridge connects with Phorge's own ``mysql.*`` settings to the
``{namespace}_worker`` database. Rows are kept apart from anything else in that queue by
task classes unique to each test (``BridgeInterop<hex>``) and by task ids; the tests
cancel the active rows they leave behind. No PHP daemon may run on this install.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from itertools import pairwise
from typing import Any

import outcomes
import pytest
import sqlalchemy as sa
from phorge_env import Phorge, is_upstream_phabricator, phorge_root, worker_database_url
from phorge_php import HELPER, InteropPHP, php_value

from bridge.queue import OperatorActions, PhorgeQueue, make_engine
from bridge.queue.model import NewTask, State, Task, TaskFilter
from bridge.queue.schema import worker_activetask as active

BIG_KEY = 7713765376809813936  # a FeedPublisherWorker chronological key: over 2**53
LEASE = 600  # the bridge's test leases; PHP's lease query always takes 7200 s
TEST_WORKER = "PhabricatorTestWorker"

# Task data of every shape Phorge's own tasks carry, and the edges of JSON.
DATA_CASES: dict[str, Any] = {
    "feed-key": {"key": BIG_KEY},
    "bare-mail-id": 2,
    "unicode": {
        "title": 'ü 中文 😀 "quoted" back\\slash /slash \t\n\u0000 end',
        "tags": ["ä", "ß", "\u2028"],
        "nested": {"n": [1, -2, 0.5, 1e-7, True, False, None], "o": {"k": "v"}},
    },
    "int64-edges": [2**63 - 1, -(2**63), 2**53 + 1],
    "empty-object": {},
    "empty-list": [],
    "string": "just a string",
    "null": None,
    "zero": 0,
}

# scheduleTask options, cycled over the data cases.
OPTION_CASES: list[dict[str, Any]] = [
    {},
    {"priority": 1000, "objectPHID": "PHID-TASK-interopobject", "containerPHID": None},
    {"priority": 4000, "containerPHID": "PHID-REPO-interopcontainer"},
    {"priority": 2500, "objectPHID": "PHID-DREV-x", "containerPHID": "PHID-REPO-y"},
]


# -- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def phorge(tmp_path_factory: pytest.TempPathFactory) -> Phorge:
    return Phorge.with_helper(phorge_root(), tmp_path_factory.mktemp("interop"), HELPER)


@pytest.fixture(scope="module")
def php(phorge: Phorge) -> InteropPHP:
    return InteropPHP(phorge)


@pytest.fixture(scope="module")
def queue(php: InteropPHP) -> Iterator[PhorgeQueue]:
    """The bridge on the database Phorge's own configuration names."""
    env = php.call("env")
    engine = make_engine(worker_database_url(env))
    with engine.connect() as conn:
        row = conn.exec_driver_sql("SELECT DATABASE(), @@port, @@datadir").one()
    assert tuple(row) == (env["db"], int(env["serverPort"]), env["datadir"]), (
        "the bridge did not reach the database Phorge uses"
    )
    yield PhorgeQueue(engine)
    engine.dispose()


@pytest.fixture
def new_class() -> Callable[[], str]:
    """Task classes unique to this test: only this test's bridge leases take its rows."""
    return lambda: f"BridgeInterop{secrets.token_hex(6)}"


@pytest.fixture
def task_class(new_class: Callable[[], str]) -> str:
    return new_class()


@pytest.fixture
def created(queue: PhorgeQueue) -> Iterator[list[int]]:
    """Ids of rows the test made; those still active are cancelled afterwards."""
    ids: list[int] = []
    yield ids
    if ids:
        OperatorActions(queue).cancel(TaskFilter(ids=ids, active=True))


def lease(queue: PhorgeQueue, limit: int, classes: list[str]) -> list[Task]:
    """A bridge lease of ``LEASE`` seconds, under an owner of its own (``interop:...``)."""
    return queue.lease(limit, LEASE, owner_prefix="interop", classes=classes)


def owner_of(tasks: list[Task]) -> str:
    """The one owner a lease took all its rows under."""
    (owner,) = {t.lease_owner for t in tasks}
    assert owner is not None and owner.startswith("interop:")
    return owner


def db_now(queue: PhorgeQueue) -> int:
    return queue.server_time()


def expire(queue: PhorgeQueue, ids: list[int]) -> None:
    """What a dead worker leaves behind: the lease ran out (owner unchanged)."""
    with queue.engine.begin() as conn:
        conn.execute(
            sa.update(active)
            .where(active.c.id.in_(ids))
            .values(leaseExpires=sa.text("UNIX_TIMESTAMP() - 10"))
        )


def db_owners(queue: PhorgeQueue, ids: list[int]) -> dict[int, str | None]:
    with queue.engine.connect() as conn:
        rows = conn.execute(sa.select(active.c.id, active.c.leaseOwner).where(active.c.id.in_(ids)))
        return {row.id: row.leaseOwner for row in rows}


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same JSON types all the way down (an int is never a float)."""
    pending = [(a, b)]  # no recursion: data may nest deeper than Python's stack
    while pending:
        x, y = pending.pop()
        if type(x) is not type(y):
            return False
        if isinstance(x, dict):
            if x.keys() != y.keys():
                return False
            pending += [(x[k], y[k]) for k in x]
        elif isinstance(x, list):
            if len(x) != len(y):
                return False
            pending += zip(x, y, strict=True)
        elif x != y:
            return False
    return True


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def cases() -> list[tuple[str, Any, dict[str, Any]]]:
    """(name, data, scheduleTask options) for every data case."""
    return [
        (name, data, OPTION_CASES[i % len(OPTION_CASES)])
        for i, (name, data) in enumerate(DATA_CASES.items())
    ]


def new_task(task_class: str, data: Any, options: dict[str, Any]) -> NewTask:
    return NewTask(
        task_class,
        data,
        priority=options.get("priority") or 2000,
        object_phid=options.get("objectPHID"),
        container_phid=options.get("containerPHID"),
        delay_until=options.get("delayUntil"),
    )


# -- 1. rows each side writes, read by the other -------------------------------------------


@pytest.mark.parametrize("via", ["enqueue", "enqueue_many"])
def test_php_loads_what_the_bridge_enqueued(
    php: InteropPHP, queue: PhorgeQueue, task_class: str, created: list[int], via: str
) -> None:
    before = db_now(queue)
    specs = [(name, new_task(task_class, data, options)) for name, data, options in cases()]
    delay = before + 3600
    specs.append(("delayed", NewTask(task_class, {"later": True}, 3500, delay_until=delay)))
    if via == "enqueue":
        ids = [
            queue.enqueue(
                t.task_class,
                t.data,
                priority=t.priority,
                delay_until=t.delay_until,
                object_phid=t.object_phid,
                container_phid=t.container_phid,
            )
            for _, t in specs
        ]
    else:
        ids = queue.enqueue_many([t for _, t in specs])
    created += ids
    after = db_now(queue)

    loaded = php.load(ids)
    assert sorted(loaded) == sorted(ids)
    for task_id, (name, task) in zip(ids, specs, strict=True):
        got = loaded[task_id]
        ours = queue.get(task_id)
        assert ours is not None
        assert {k: v for k, v in got.items() if k not in ("dataExport",)} == {
            "id": task_id,
            "archived": False,
            "taskClass": task_class,
            "leaseOwner": None,
            "leaseExpires": task.delay_until,
            "failureCount": 0,
            "dataID": ours.data_id,
            "priority": task.priority,
            "objectPHID": task.object_phid,
            "containerPHID": task.container_phid,
            "dateCreated": ours.date_created,
            "dateModified": ours.date_modified,
            "failureTime": None,
            "data": php_value(task.data),
        }, name
        assert same(got["data"], php_value(task.data)), (name, got["data"])
        assert before <= got["dateCreated"] <= after, name
    # PHP holds the 64-bit key and the mail id as integers, never as floats.
    exports = {name: loaded[i]["dataExport"] for i, (name, _) in zip(ids, specs, strict=True)}
    assert exports["feed-key"] == "array (\n  'key' => 7713765376809813936,\n)"
    assert exports["bare-mail-id"] == "2"
    assert exports["zero"] == "0"
    assert exports["int64-edges"] == (
        "array (\n  0 => 9223372036854775807,\n  1 => -9223372036854775807-1,\n"
        "  2 => 9007199254740993,\n)"
    )


def test_php_lease_query_decodes_bridge_data(
    php: InteropPHP, queue: PhorgeQueue, task_class: str, created: list[int]
) -> None:
    specs = cases()
    ids = queue.enqueue_many([new_task(task_class, d, o) for _, d, o in specs])
    created += ids
    leased = {t["id"]: t for t in php.lease(len(ids), ids)}
    assert sorted(leased) == sorted(ids)
    now = db_now(queue)
    for task_id, (name, data, _) in zip(ids, specs, strict=True):
        got = leased[task_id]
        expected = php_value(data)
        if name == "zero":
            # PhabricatorWorkerLeaseQuery decodes only truthy data strings: "0" reads as
            # null (its own rows too: Phorge's behaviour, not the bridge's).
            expected = None
        assert same(got["data"], expected), (name, got["data"])
        assert re.fullmatch(r"\d+:\d+:[^:]+:\d+", got["leaseOwner"]), got["leaseOwner"]
        assert now + 7200 - 5 <= got["leaseExpires"] <= now + 7200 + 5
    assert lease(queue, 10, [task_class]) == []


def test_bridge_reads_what_php_scheduled(
    php: InteropPHP, queue: PhorgeQueue, task_class: str, created: list[int]
) -> None:
    before = db_now(queue)
    specs = cases()
    ids = php.schedule_many([(task_class, data, options) for _, data, options in specs])
    created += ids
    after = db_now(queue)
    assert len(set(ids)) == len(ids)
    for task_id, (name, data, options) in zip(ids, specs, strict=True):
        task = queue.get(task_id)
        assert task is not None, name
        assert task.data_error is None, name
        # PHP writes an empty array as [], whatever it was meant to be.
        assert same(task.data, php_value(data)), (name, task.data)
        assert (task.task_class, task.lease_owner, task.lease_expires, task.failure_count) == (
            task_class,
            None,
            None,
            0,
        )
        assert task.priority == (options.get("priority") or 2000)
        assert (task.object_phid, task.container_phid) == (
            options.get("objectPHID"),
            options.get("containerPHID"),
        )
        assert before - 2 <= task.date_created <= after + 2  # PHP's clock
        assert task.state is State.QUEUED
    leased = lease(queue, len(ids) + 5, [task_class])
    assert sorted(t.id for t in leased) == sorted(ids)
    by_id = {t.id: t for t in leased}
    for task_id, (name, data, _) in zip(ids, specs, strict=True):
        assert same(by_id[task_id].data, php_value(data)), name


def test_delays_are_the_documented_difference(
    php: InteropPHP, queue: PhorgeQueue, task_class: str, created: list[int]
) -> None:
    """Both write a delay the same way; PHP's lease query ignores it, the bridge's does not."""
    until = db_now(queue) + 3600
    bridge_id = queue.enqueue(task_class, {"d": 1}, delay_until=until)
    (php_id,) = php.schedule_many([(task_class, {"d": 2}, {"delayUntil": until})])
    created += [bridge_id, php_id]
    assert php.load([bridge_id])[bridge_id]["leaseExpires"] == until
    php_row = queue.get(php_id)
    assert php_row is not None
    assert (php_row.lease_expires, php_row.state) == (until, State.DELAYED)

    assert lease(queue, 5, [task_class]) == []
    # Phorge's phase 1 is "leaseOwner IS NULL": it leases a delayed row at once.
    assert [t["id"] for t in php.lease(1, [bridge_id])] == [bridge_id]


# JSON the bridge accepts but PHP's json_decode($json, true) cannot give back: PHP reads
# null (a lone surrogate, nesting of 512), or a float (an integer outside 64 bits).
UNREADABLE = {
    "lone-surrogate": {"s": "\ud800"},
    "above-int64": {"n": 2**63},
    "below-int64": {"n": -(2**63) - 1},
    "nested-512": nested(512),
}


@pytest.mark.parametrize("data", UNREADABLE.values(), ids=UNREADABLE.keys())
def test_data_php_cannot_read_is_refused(
    php: InteropPHP, queue: PhorgeQueue, task_class: str, created: list[int], data: Any
) -> None:
    try:
        task_id = queue.enqueue(task_class, data)
    except ValueError:
        return
    created.append(task_id)
    got = php.load([task_id])[task_id]
    # (No empty object in these: PHP would give back exactly ``data``.)
    assert same(got["data"], data), got["dataExport"][:200]


# -- 2. one id sequence ---------------------------------------------------------------------


def test_ids_interleave_with_php_schedule_task(
    php: InteropPHP, queue: PhorgeQueue, task_class: str, created: list[int]
) -> None:
    php_count, threads, rounds = 300, 4, 20
    start = threading.Barrier(threads + 1)
    bridge_ids: list[list[int]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []

    def enqueue(slot: int) -> None:
        try:
            start.wait(30)
            for n in range(rounds):
                data = {"writer": "bridge", "thread": slot, "n": n}
                if n % 2:
                    bridge_ids[slot].append(queue.enqueue(task_class, data))
                else:
                    batch = [NewTask(task_class, {**data, "k": k}) for k in range(3)]
                    bridge_ids[slot] += queue.enqueue_many(batch)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    workers = [threading.Thread(target=enqueue, args=(i,)) for i in range(threads)]
    with php.started("schedule-loop", **{"class": task_class, "count": php_count}) as process:
        for worker in workers:
            worker.start()
        start.wait(30)
        php.go(process)
        php_ids: list[int] = php.finish(process)
        for worker in workers:
            worker.join(120)
    assert not errors, errors
    ours = [i for ids in bridge_ids for i in ids]
    everything = php_ids + ours
    created += everything

    assert len(php_ids) == php_count and len(ours) == threads * rounds * 2
    assert len(set(everything)) == len(everything), "an id was handed out twice"
    # The two writers really ran at once: their ids interleave, not two blocks.
    in_order = sorted(everything)
    from_php = set(php_ids)
    alternations = sum((a in from_php) != (b in from_php) for a, b in pairwise(in_order))
    assert alternations >= 4, f"PHP and the bridge did not overlap ({alternations})"
    loaded = php.load(everything)
    assert sorted(loaded) == sorted(everything)
    assert {i for i in everything if loaded[i]["data"]["writer"] == "php"} == set(php_ids)
    listed = queue.list(TaskFilter(classes=[task_class]))
    assert sorted(t.id for t in listed) == sorted(everything)
    with queue.engine.connect() as conn:
        counter = conn.exec_driver_sql(
            "SELECT counterValue FROM lisk_counter WHERE counterName = 'worker_activetask'"
        ).scalar_one()
    assert counter >= max(everything)


# -- 3. leases --------------------------------------------------------------------------------


def test_php_leases_bridge_rows_and_the_bridge_leases_php_rows(
    php: InteropPHP, queue: PhorgeQueue, new_class: Callable[[], str], created: list[int]
) -> None:
    first, second = new_class(), new_class()
    bridge_rows = queue.enqueue_many([NewTask(first, {"n": n}) for n in range(6)])
    php_rows = php.schedule_many([(second, {"n": n}, {}) for n in range(6)])
    created += bridge_rows + php_rows

    # PHP takes the first three bridge rows (priority, then id); the bridge the rest.
    php_took = php.lease(3, bridge_rows)
    assert [t["id"] for t in php_took] == bridge_rows[:3]
    assert [t["data"] for t in php_took] == [{"n": 0}, {"n": 1}, {"n": 2}]
    got = lease(queue, 10, [first])
    assert [t.id for t in got] == bridge_rows[3:]
    mine = owner_of(got)
    assert php.lease(10, bridge_rows) == []
    assert lease(queue, 10, [first]) == []

    # The other way round, on rows PHP wrote.
    got = lease(queue, 3, [second])
    assert [t.id for t in got] == php_rows[:3]
    assert [t.data for t in got] == [{"n": 0}, {"n": 1}, {"n": 2}]
    theirs = owner_of(got)
    assert [t["id"] for t in php.lease(10, php_rows)] == php_rows[3:]
    assert lease(queue, 10, [second]) == []
    assert php.lease(10, php_rows) == []

    owners = db_owners(queue, bridge_rows + php_rows)
    assert {owners[i] for i in bridge_rows[3:]} == {mine}
    assert {owners[i] for i in php_rows[:3]} == {theirs}
    assert {owners[i] for i in bridge_rows[:3]} == {php_took[0]["leaseOwner"]}


def test_expired_leases_are_taken_over_and_stale_owners_lose(
    php: InteropPHP, queue: PhorgeQueue, new_class: Callable[[], str], created: list[int]
) -> None:
    first, second = new_class(), new_class()
    (bridge_row,) = queue.enqueue_many([NewTask(first, {"who": "bridge"})])
    (php_row,) = php.schedule_many([(second, {"who": "php"}, {})])
    created += [bridge_row, php_row]
    got = lease(queue, 1, [first])
    assert [t.id for t in got] == [bridge_row]
    dead = owner_of(got)
    (php_lease,) = php.lease(1, [php_row])
    # Live leases: neither side takes the other's row.
    assert php.lease(5, [bridge_row, php_row]) == []
    assert lease(queue, 5, [first, second]) == []

    expire(queue, [bridge_row, php_row])
    (taken,) = php.lease(5, [bridge_row])
    assert taken["id"] == bridge_row and taken["leaseOwner"] != dead
    assert taken["data"] == {"who": "bridge"}
    got = lease(queue, 5, [first, second])
    assert [t.id for t in got] == [php_row]
    fresh = owner_of(got)

    # The dead bridge worker comes back: its outcomes change nothing.
    assert not outcomes.complete(queue, bridge_row, dead, 5)
    assert not outcomes.fail_temporary(queue, bridge_row, dead, 60)
    assert not outcomes.yield_(queue, bridge_row, dead, 60)
    assert not outcomes.renew(queue, bridge_row, dead, 60)
    assert not outcomes.fail_permanent(queue, bridge_row, dead)
    assert db_owners(queue, [bridge_row, php_row]) == {
        bridge_row: taken["leaseOwner"],
        php_row: fresh,
    }
    assert php_lease["leaseOwner"] != fresh


def test_concurrent_php_and_bridge_leasers_never_share_a_row(
    php: InteropPHP, queue: PhorgeQueue, task_class: str, created: list[int]
) -> None:
    ids = queue.enqueue_many([NewTask(task_class, {"n": n}) for n in range(240)])
    created += ids
    threads = 3
    start = threading.Barrier(threads + 1)
    claims: list[dict[int, str]] = [{} for _ in range(threads)]
    errors: list[BaseException] = []

    def unleased_left() -> int:
        with queue.engine.connect() as conn:
            return conn.execute(
                sa.select(sa.func.count())
                .select_from(active)
                .where(active.c.id.in_(ids), active.c.leaseOwner.is_(None))
            ).scalar_one()

    def leaser(slot: int) -> None:
        try:
            start.wait(30)
            n = 0
            while True:
                got = lease(queue, 1 + n % 4, [task_class])
                n += 1
                me = owner_of(got) if got else ""
                for task in got:
                    assert task.id not in claims[slot]
                    claims[slot][task.id] = me
                if not got and not unleased_left():
                    return
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=leaser, args=(i,)) for i in range(threads)]
    with php.started("lease-loop", ids=ids) as process:
        for worker in workers:
            worker.start()
        start.wait(30)
        php.go(process)
        php_claims = {int(c["id"]): c["owner"] for c in php.finish(process)}
        for worker in workers:
            worker.join(120)
    assert not errors, errors

    everyone = [php_claims, *claims]
    claimed = [task_id for side in everyone for task_id in side]
    assert len(claimed) == len(set(claimed)), "a row was leased twice"
    assert sorted(claimed) == sorted(ids), "some rows were never leased"
    assert php_claims and any(claims), "one side leased nothing: no contest"
    owners = db_owners(queue, ids)
    for side in everyone:
        for task_id, who in side.items():
            assert owners[task_id] == who


# -- 4. archives and operator actions -----------------------------------------------------------


def test_php_reads_the_archives_the_bridge_writes(
    php: InteropPHP, queue: PhorgeQueue, task_class: str, created: list[int]
) -> None:
    object_phid, container_phid = "PHID-TASK-archived", "PHID-REPO-archived"
    tasks = [
        NewTask(task_class, {"key": BIG_KEY, "n": n}, 1500, object_phid, container_phid)
        for n in range(3)
    ]
    ids = queue.enqueue_many(tasks)
    created += ids
    before = {task_id: queue.get(task_id) for task_id in ids}
    got = lease(queue, 3, [task_class])
    assert len(got) == 3
    mine = owner_of(got)
    followup = NewTask(task_class, {"after": ids[0]}, object_phid=object_phid)
    assert outcomes.complete(queue, ids[0], mine, 1_234_567, [followup])
    assert outcomes.fail_permanent(queue, ids[1], mine)
    (cancelled,) = OperatorActions(queue).cancel(TaskFilter(ids=[ids[2]]))
    assert cancelled.done
    now = db_now(queue)

    loaded = php.load(ids)
    for task_id, result, duration, lease_owner in (
        (ids[0], 0, 1_234_567, mine),
        (ids[1], 1, 0, mine),
        (ids[2], 2, 0, None),
    ):
        got, old = loaded[task_id], before[task_id]
        assert old is not None
        assert got["archived"] is True
        assert (got["result"], got["duration"], got["leaseOwner"]) == (
            result,
            duration,
            lease_owner,
        )
        assert (got["taskClass"], got["failureCount"], got["dataID"], got["priority"]) == (
            task_class,
            0,
            old.data_id,
            1500,
        )
        assert (got["objectPHID"], got["containerPHID"]) == (object_phid, container_phid)
        assert got["dateCreated"] == old.date_created
        assert now - 5 <= got["archivedEpoch"] <= now
        assert now - 5 <= got["dateModified"] <= now
        assert "failureTime" not in got
        # The data row outlives the archive, and PHP still reads it.
        assert got["data"] == {"key": BIG_KEY, "n": task_id - ids[0]}
    # The follow-up: a new active row with the parent's priority, that PHP reads.
    (follow,) = queue.list(TaskFilter(classes=[task_class], active=True))
    created.append(follow.id)
    got = php.load([follow.id])[follow.id]
    assert (got["archived"], got["priority"], got["objectPHID"], got["data"]) == (
        False,
        1500,
        object_phid,
        {"after": ids[0]},
    )
    # bin/worker's selectors find them as archived: cancel refuses every one.
    done = php.phorge.bin("worker", "cancel", "--class", task_class, "--archived")
    assert labels(done.stderr) == dict.fromkeys(ids, "ARCHIVED"), done.stderr


def test_bin_worker_retry_requeues_bridge_archives(
    php: InteropPHP, queue: PhorgeQueue, task_class: str, created: list[int]
) -> None:
    ids = queue.enqueue_many(
        [NewTask(task_class, {"n": n}, 3000, "PHID-TASK-r", "PHID-REPO-r") for n in range(2)]
    )
    created += ids
    failed, succeeded = ids
    mine = owner_of(lease(queue, 2, [task_class]))
    assert outcomes.fail_permanent(queue, failed, mine)
    assert outcomes.complete(queue, succeeded, mine, 42)
    archived = {task_id: queue.get(task_id) for task_id in ids}

    done = php.phorge.bin("worker", "retry", "--id", str(failed), "--id", str(succeeded))
    assert done.returncode == 0, done.stderr
    assert labels(done.stderr) == {failed: "QUEUED", succeeded: "SUCCEEDED"}
    again = php.phorge.bin("worker", "retry", "--repeat", "--id", str(succeeded))
    assert labels(again.stderr) == {succeeded: "QUEUED"}, again.stderr

    for task_id in ids:
        task, old = queue.get(task_id), archived[task_id]
        assert task is not None and old is not None
        assert not task.archived and task.state is State.QUEUED
        assert (task.lease_owner, task.lease_expires, task.failure_count, task.failure_time) == (
            None,
            0,
            0,
            None,
        )
        assert (task.data_id, task.priority, task.object_phid, task.container_phid) == (
            old.data_id,
            3000,
            "PHID-TASK-r",
            "PHID-REPO-r",
        )
        assert task.date_created == old.date_created
    got = lease(queue, 5, [task_class])
    assert sorted((t.id, t.data["n"]) for t in got) == [(failed, 0), (succeeded, 1)]


def test_php_cancel_or_free_of_a_bridge_lease_wins(
    php: InteropPHP, queue: PhorgeQueue, task_class: str, created: list[int]
) -> None:
    cancelled, freed = queue.enqueue_many([NewTask(task_class, {}), NewTask(task_class, {})])
    created += [cancelled, freed]
    got = lease(queue, 2, [task_class])
    assert len(got) == 2
    mine = owner_of(got)
    done = php.phorge.bin("worker", "cancel", "--id", str(cancelled))
    assert labels(done.stderr) == {cancelled: "CANCELLED"}
    done = php.phorge.bin("worker", "free", "--id", str(freed))
    assert labels(done.stderr) == {freed: "LEASE FREED"}
    for task_id in (cancelled, freed):
        assert not outcomes.complete(queue, task_id, mine, 1)
        assert not outcomes.fail_temporary(queue, task_id, mine, 5)
        assert not outcomes.yield_(queue, task_id, mine, 5)
        assert not outcomes.renew(queue, task_id, mine, 60)
    task = queue.get(cancelled)
    assert task is not None and (task.archived, task.result, task.lease_owner) == (True, 2, None)
    task = queue.get(freed)
    assert task is not None and (task.archived, task.lease_owner, task.failure_count) == (
        False,
        None,
        0,
    )
    # The freed row is due again, for whoever leases next.
    assert [t.id for t in lease(queue, 5, [task_class])] == [freed]


# bin/worker's selectors against TaskFilter's, on rows of one class: three queued rows
# with failure counts 0, 1, 3 and priorities 1000, 2000, 3000, and two archived rows
# (failure count 0, priority 1). ``free`` changes neither a queued nor an archived row, so
# its labels tell which rows bin/worker selected.
SELECTORS = [
    pytest.param([], {}, id="class"),
    pytest.param(["--active"], {"active": True}, id="active"),
    pytest.param(["--archived"], {"archived": True}, id="archived"),
    pytest.param(["--min-failure-count", "1"], {"min_failure_count": 1}, id="min-failures"),
    pytest.param(
        ["--min-failure-count", "1", "--max-failure-count", "2"],
        {"min_failure_count": 1, "max_failure_count": 2},
        id="failure-range",
    ),
    pytest.param(["--max-failure-count", "0"], {"max_failure_count": 0}, id="max-failures-alone"),
    pytest.param(
        ["--min-failure-count", "0", "--max-failure-count", "1"],
        {"min_failure_count": 0, "max_failure_count": 1},
        id="min-failures-zero",
    ),
    pytest.param(["--min-priority", "2000"], {"min_priority": 2000}, id="min-priority"),
    pytest.param(["--max-priority", "2000"], {"max_priority": 2000}, id="max-priority"),
    pytest.param(
        ["--min-priority", "1500", "--max-priority", "2500"],
        {"min_priority": 1500, "max_priority": 2500},
        id="priority-range",
    ),
    pytest.param(["--limit", "2"], {"limit": 2}, id="limit"),
    pytest.param(["--archived", "--limit", "1"], {"archived": True, "limit": 1}, id="limit-2"),
]


@pytest.mark.parametrize(("arguments", "selector"), SELECTORS)
def test_selectors_match_bin_worker(
    php: InteropPHP,
    queue: PhorgeQueue,
    task_class: str,
    created: list[int],
    arguments: list[str],
    selector: dict[str, Any],
) -> None:
    archived = queue.enqueue_many([NewTask(task_class, {"n": n}, 1) for n in (3, 4)])
    created += archived
    got = lease(queue, 2, [task_class])
    assert sorted(t.id for t in got) == archived
    mine = owner_of(got)
    assert all(outcomes.fail_permanent(queue, task_id, mine) for task_id in archived)
    live = queue.enqueue_many(
        [NewTask(task_class, {"n": n}, p) for n, p in enumerate((1000, 2000, 3000))]
    )
    created += live
    with queue.engine.begin() as conn:
        for task_id, failures in zip(live, (0, 1, 3), strict=True):
            conn.execute(
                sa.update(active).where(active.c.id == task_id).values(failureCount=failures)
            )

    done = php.phorge.bin("worker", "free", "--class", task_class, *arguments)
    assert done.returncode == 0, done.stderr
    php_selected = sorted(labels(done.stderr))
    ours = sorted(t.id for t in queue.list(TaskFilter(classes=[task_class], **selector)))
    if "max_failure_count" in selector and not selector.get("min_failure_count"):
        # Deliberate difference (docs/architecture.md): bin/worker applies the range only
        # when --min-failure-count is non-zero ("if ($min_failures)"); the bridge always.
        assert php_selected == sorted([*archived, *live])
        low, high = selector.get("min_failure_count", 0), selector["max_failure_count"]
        assert ours == sorted(
            t.id
            for t in queue.list(TaskFilter(ids=[*archived, *live]))
            if low <= t.failure_count <= high
        )
    else:
        assert ours == php_selected


LABEL = re.compile(r"^ (?P<label>[A-Z][A-Z ]*?)  Task (?P<id>\d+) ", re.MULTILINE)


def labels(output: str) -> dict[int, str]:
    """bin/worker's verdict per task: ``{id: "QUEUED"}``, ``{id: "SUCCEEDED"}``..."""
    return {int(m["id"]): m["label"] for m in LABEL.finditer(output)}


# Each operator action, tried on a row in the given state: once by PHP's bin/worker on a row
# the bridge wrote and prepared, once by the bridge on a row PHP wrote and prepared. The
# two outcomes must match: same verdict (bin/worker's label), same row afterwards.
UNTIL = 2_000_000_000
STATES = ("queued", "leased", "yielded", "expired", "failed", "succeeded")
LEASED = {"leased", "yielded", "expired"}  # the states with a lease owner


def action(state: str, command: list[str], act: Callable, *marks: Any) -> Any:
    name, *rest = command
    words = [w.lstrip("-") for w in rest if not w.startswith("@") and w.lstrip("-") != name]
    return pytest.param(state, command, act, marks=marks, id="-".join([name, *words, state]))


def cancel(q: PhorgeQueue, f: TaskFilter) -> list:
    return OperatorActions(q).cancel(f)


def free(q: PhorgeQueue, f: TaskFilter) -> list:
    return OperatorActions(q).free(f)


def delay(q: PhorgeQueue, f: TaskFilter) -> list:
    return OperatorActions(q).delay(f, UNTIL)


def reprioritize(priority: int) -> Callable[[PhorgeQueue, TaskFilter], list]:
    return lambda q, f: OperatorActions(q).set_priority(f, priority)


def retry(repeat: bool = False) -> Callable[[PhorgeQueue, TaskFilter], list]:
    return lambda q, f: OperatorActions(q).retry(f, repeat=repeat)


DELAY = ["delay", "--until", f"@{UNTIL}"]
ACTIONS = [
    *(action(state, ["cancel"], cancel) for state in STATES),
    *(action(state, ["free"], free) for state in STATES),
    *(action(state, DELAY, delay) for state in STATES),
    action("queued", ["priority", "--priority", "2000"], reprioritize(2000)),
    *(
        action(
            state,
            ["priority", "--priority", "1234"],
            reprioritize(1234),
        )
        for state in STATES
        if state != "expired"  # see test_priority_of_an_expired_lease_differs_deliberately
    ),
    *(action(state, ["retry"], retry()) for state in STATES),
    action("succeeded", ["retry", "--repeat"], retry(repeat=True)),
]


class Twins:
    """Rows in a given state, written and prepared by the bridge or by PHP.

    PHP leases with its lease query and archives by running PhabricatorTestWorker as a
    taskmaster does; yields are always the bridge's (no PHP worker here can yield), and
    an expired lease is one moved into the past, as a dead worker leaves it.
    """

    def __init__(self, php: InteropPHP, queue: PhorgeQueue, new_class, created) -> None:
        self.php, self.queue, self.new_class, self.created = php, queue, new_class, created

    def make(self, state: str, writer: str) -> int:
        php, queue = self.php, self.queue
        task_class = self.new_class()
        data: dict[str, Any] = {}
        if writer == "php" and state in ("failed", "succeeded"):
            # PHP archives through its own taskmaster path, running PhabricatorTestWorker.
            task_class = TEST_WORKER
            data = {"doWork": "fail-permanent"} if state == "failed" else {}
        if writer == "bridge":
            task_id = queue.enqueue(task_class, data)
        else:
            (task_id,) = php.schedule_many([(task_class, data, {})])
        self.created.append(task_id)
        if state == "queued":
            pass
        elif writer == "php" and state in ("failed", "succeeded"):
            (ran,) = php.run(1, [task_id])
            assert ran["result"] == (1 if state == "failed" else 0)
        elif writer == "php" and state in ("leased", "expired"):
            assert [t["id"] for t in php.lease(1, [task_id])] == [task_id]
        else:
            got = lease(queue, 1, [task_class])
            assert [t.id for t in got] == [task_id]
            mine = owner_of(got)
            if state == "yielded":
                assert outcomes.yield_(queue, task_id, mine, 600)
            elif state == "failed":
                assert outcomes.fail_permanent(queue, task_id, mine)
            elif state == "succeeded":
                assert outcomes.complete(queue, task_id, mine, 7)
        if state == "expired":
            expire(queue, [task_id])
        return task_id


def shape(row: dict[str, Any], now: int) -> dict[str, Any]:
    """What an action left, in terms that do not depend on which row or whose clock."""

    def when(epoch: int | None) -> Any:
        if epoch in (None, 0, UNTIL):
            return epoch
        for name, at in (("now", now), ("an hour ago", now - 3600)):
            if abs(epoch - at) <= 3:
                return name
        return "future" if epoch > now else "past"

    owner_kind = row["leaseOwner"] if row["leaseOwner"] in (None, "(yield)") else "an owner"
    return {
        "archived": row["archived"],
        "result": row.get("result"),
        # Recorded, in µs; a no-op PHP run may well measure 0.
        "duration": row.get("duration") is not None,
        "leaseOwner": owner_kind,
        "leaseExpires": when(row["leaseExpires"]),
        "failureCount": row["failureCount"],
        "priority": row["priority"],
    }


@pytest.mark.parametrize(("state", "command", "act"), ACTIONS)
def test_operator_actions_match_bin_worker(
    php: InteropPHP,
    queue: PhorgeQueue,
    new_class: Callable[[], str],
    created: list[int],
    state: str,
    command: list[str],
    act: Callable[[PhorgeQueue, TaskFilter], list],
) -> None:
    twins = Twins(php, queue, new_class, created)
    by_php, by_bridge = twins.make(state, "bridge"), twins.make(state, "php")

    done = php.phorge.bin("worker", *command, "--id", str(by_php))
    if command[0] == "delay" and state in LEASED and is_upstream_phabricator(php.phorge.root):
        # Phabricator's `bin/worker delay` dies on a leased row, writing nothing: its
        # warning, pht('% is already leased, ...'), is no format PHP 8 takes (Phorge
        # fixed it). The bridge refuses such a row as Phorge does.
        assert done.returncode == 255 and 'Unknown format specifier "i"' in done.stderr
        php_verdict = "LEASED"
    else:
        assert done.returncode == 0, done.stderr
        php_verdict = labels(done.stderr)[by_php]
    (result,) = act(queue, TaskFilter(ids=[by_bridge]))
    bridge_verdict = result.reason.split(":")[0] if result.reason else "done"
    now = db_now(queue)

    rows = php.load([by_php, by_bridge])
    assert shape(rows[by_bridge], now) == shape(rows[by_php], now)
    refusals = {"ARCHIVED", "ACTIVE", "FREE", "LEASED", "UNCHANGED", "SUCCEEDED"}
    if php_verdict in refusals:
        assert bridge_verdict == php_verdict, result.reason
    else:
        assert result.done, result.reason


def test_priority_of_an_expired_lease_differs_deliberately(
    php: InteropPHP, queue: PhorgeQueue, new_class: Callable[[], str], created: list[int]
) -> None:
    # bin/worker priority dies on it (save() -> checkLease(): "Trying to update Task N after
    # lease expiration!", exit 255, nothing written); the bridge reprioritizes the row.
    twins = Twins(php, queue, new_class, created)
    by_php, by_bridge = twins.make("expired", "bridge"), twins.make("expired", "php")
    done = php.phorge.bin("worker", "priority", "--priority", "1234", "--id", str(by_php))
    assert done.returncode != 0 and "after lease expiration" in done.stderr
    (result,) = OperatorActions(queue).set_priority(TaskFilter(ids=[by_bridge]), 1234)
    assert result.done
    rows = php.load([by_php, by_bridge])
    assert (rows[by_php]["priority"], rows[by_bridge]["priority"]) == (2000, 1234)


def test_awaken_matches_php(
    php: InteropPHP, queue: PhorgeQueue, new_class: Callable[[], str], created: list[int]
) -> None:
    twins = Twins(php, queue, new_class, created)
    by_php, by_bridge = twins.make("yielded", "bridge"), twins.make("yielded", "php")
    php.awaken([by_php])
    assert OperatorActions(queue).awaken([by_bridge]) == 1
    now = db_now(queue)
    rows = php.load([by_php, by_bridge])
    assert shape(rows[by_bridge], now) == shape(rows[by_php], now)
    assert shape(rows[by_php], now)["leaseExpires"] == "an hour ago"
    # An awakened row is due for both lease queries at once.
    assert [t["id"] for t in php.lease(1, [by_php])] == [by_php]


# -- 5. execution ------------------------------------------------------------------------------


def test_bin_worker_execute_runs_a_bridge_row(
    php: InteropPHP, queue: PhorgeQueue, created: list[int]
) -> None:
    task_id = queue.enqueue(TEST_WORKER, {}, priority=1500, object_phid="PHID-TASK-exec")
    created.append(task_id)
    done = php.phorge.bin("worker", "execute", "--id", str(task_id))
    assert done.returncode == 0, done.stderr
    task = queue.get(task_id)
    assert task is not None
    assert (task.archived, task.result, task.failure_count, task.lease_owner) == (True, 0, 0, None)
    assert (task.priority, task.object_phid, task.data) == (1500, "PHID-TASK-exec", {})
    assert task.duration is not None and 0 <= task.duration < 60_000_000
    got = php.load([task_id])[task_id]
    assert (got["archived"], got["result"], got["duration"]) == (True, 0, task.duration)


def test_php_taskmaster_runs_bridge_rows(
    php: InteropPHP, queue: PhorgeQueue, created: list[int]
) -> None:
    data = [
        {},
        {"doWork": "fail-permanent"},
        {"doWork": "fail-temporary", "getWaitBeforeRetry": 600},
    ]
    ids = queue.enqueue_many([NewTask(TEST_WORKER, d) for d in data])
    created += ids
    now = db_now(queue)
    ran = {t["id"]: t for t in php.run(3, ids)}
    assert sorted(ran) == ids
    ok, permanent, temporary = (ran[i] for i in ids)
    assert (ok["archived"], ok["result"], ok["exception"]) == (True, 0, None)
    assert (permanent["archived"], permanent["result"], permanent["duration"]) == (True, 1, 0)
    assert temporary["exception"] == "Exception" and temporary["archived"] is False

    succeeded, failed, waiting = (queue.get(i) for i in ids)
    assert succeeded is not None and failed is not None and waiting is not None
    assert (succeeded.archived, succeeded.result, succeeded.lease_owner) == (
        True,
        0,
        ok["ranAs"],
    )
    assert (failed.archived, failed.result, failed.duration) == (True, 1, 0)
    assert (waiting.failure_count, waiting.lease_owner) == (1, temporary["ranAs"])
    assert waiting.failure_time is not None and now - 2 <= waiting.failure_time <= now + 5
    assert now + 600 - 5 <= (waiting.lease_expires or 0) <= now + 600 + 5
    assert waiting.state is State.RETRY_WAIT
    assert php.lease(1, [ids[2]]) == []


def test_a_php_retry_in_progress_reads_as_leased(
    php: InteropPHP, queue: PhorgeQueue, created: list[int]
) -> None:
    task_id = queue.enqueue(TEST_WORKER, {"doWork": "fail-temporary", "getWaitBeforeRetry": 60})
    created.append(task_id)
    (failed,) = php.run(1, [task_id])
    assert (failed["failureCount"], failed["exception"]) == (1, "Exception")
    waiting = queue.get(task_id)
    assert waiting is not None and waiting.state is State.RETRY_WAIT
    with queue.engine.begin() as conn:  # the 60 s wait is over
        conn.execute(
            sa.update(active)
            .where(active.c.id == task_id)
            .values(
                failureTime=sa.text("UNIX_TIMESTAMP() - 61"),
                leaseExpires=sa.text("UNIX_TIMESTAMP() - 1"),
            )
        )
    (second_run,) = php.lease(1, [task_id])  # a taskmaster takes it for its second run
    task = queue.get(task_id)
    assert task is not None and task.lease_owner == second_run["leaseOwner"]
    assert task.state is State.LEASED


def test_php_sees_a_bridge_yield_only_after_it(
    php: InteropPHP, queue: PhorgeQueue, task_class: str, created: list[int]
) -> None:
    (task_id,) = queue.enqueue_many([NewTask(task_class, {"y": 1})])
    created.append(task_id)
    mine = owner_of(lease(queue, 1, [task_class]))
    at = db_now(queue)
    assert outcomes.yield_(queue, task_id, mine, 1)  # at least 5 s, as PHP's executeTask
    yielded = queue.get(task_id)
    assert yielded is not None and yielded.state is State.YIELDED
    until = yielded.lease_expires
    assert until is not None and at + 5 <= until <= at + 6

    seen_before = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        asked_at = db_now(queue)
        got = php.lease(1, [task_id])
        if got:
            break
        seen_before.append(asked_at)
        time.sleep(0.25)
    else:
        pytest.fail("PHP never leased the yielded task")
    (task,) = got
    # PHP took it only once its lease query's clock had passed the yield.
    assert task["leaseExpires"] - 7200 > until
    assert seen_before and max(seen_before) <= until
    assert (task["failureCount"], task["data"]) == (0, {"y": 1})
