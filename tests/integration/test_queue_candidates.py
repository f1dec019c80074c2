"""The poller's reads and lease candidates, on MariaDB and on SQLite alike: the urgent
lane (``priority_below``), held leases per class, recent runs, and candidates chosen
per class with the same results as one statement over all of them.

Time passes by rewriting ``leaseExpires`` relative to the database clock, never by
sleeping.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from sqlalchemy import create_engine, event, insert, update

from bridge.queue import PhorgeQueue, make_engine
from bridge.queue import statements as sql
from bridge.queue.dialect import db_now
from bridge.queue.model import YIELD_OWNER, InFlight, NewTask, RecentRuns
from bridge.queue.phorge_queue import RangeSizes
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_archivetask as archive

WORKER = "PhabricatorTestWorker"
OTHER = "PhabricatorOtherWorker"
UNSERVED = "PhabricatorRepositoryCommitParserWorker"


@pytest.fixture
def q(engine) -> PhorgeQueue:
    queue = PhorgeQueue(make_engine(engine.url.render_as_string(hide_password=False)))
    yield queue
    queue.engine.dispose()


def set_rows(q: PhorgeQueue, ids: list[int], **values) -> None:
    with q.engine.begin() as conn:
        assert conn.execute(update(active).where(active.c.id.in_(ids)).values(**values)).rowcount


def expire(q: PhorgeQueue, ids: list[int], seconds_ago: int = 1, owner: str = "php") -> None:
    """The rows were leased by ``owner`` and the lease ran out ``seconds_ago`` ago."""
    set_rows(q, ids, leaseOwner=owner, leaseExpires=db_now() - seconds_ago)


def lease_ids(q: PhorgeQueue, limit: int, classes: list[str], **options) -> list[int]:
    _, tasks = q.lease_to_send(limit, "bridge", 60, classes, 1000, **options)
    return [task.id for task in tasks]


# -- the urgent lane --------------------------------------------------------------------


def test_priority_below_takes_only_more_urgent_rows_in_both_phases(q):
    urgent, edge, backlog = (q.enqueue(WORKER, priority=p) for p in (1000, 2000, 4000))
    urgent_expired, backlog_expired = (q.enqueue(WORKER, priority=p) for p in (1500, 4000))
    expire(q, [urgent_expired, backlog_expired])

    assert sorted(lease_ids(q, 10, [WORKER], priority_below=2000)) == [urgent, urgent_expired]
    assert sorted(lease_ids(q, 10, [WORKER])) == [edge, backlog, backlog_expired]


# -- held leases ------------------------------------------------------------------------


def test_held_by_class_counts_live_leases_with_their_worst_priority(q):
    for priority in (1000, 3000, 2000):
        q.enqueue(WORKER, priority=priority)
    q.enqueue(OTHER, priority=4000)
    lease_ids(q, 10, [WORKER, OTHER])

    assert q.in_flight_by_class("bridge") == {WORKER: InFlight(3, 3000), OTHER: InFlight(1, 4000)}
    assert q.in_flight_by_class("bridge", [WORKER, "Absent"]) == {WORKER: InFlight(3, 3000)}
    assert q.in_flight_by_class("bridge", []) == {}
    assert q.in_flight_by_class("other") == {}


def test_held_by_class_leaves_out_expired_leases_and_rows_waiting_to_retry(q):
    expired, waiting, _live = (q.enqueue(WORKER, priority=p) for p in (1000, 2000, 3000))
    owner, _ = q.lease_to_send(10, "bridge", 60, [WORKER], 1000)
    expire(q, [expired], owner=owner)
    set_rows(q, [waiting], failureTime=db_now(), leaseExpires=db_now() + 600)

    assert q.in_flight_by_class("bridge", [WORKER]) == {WORKER: InFlight(1, 3000)}


# -- recent runs ------------------------------------------------------------------------


def archive_run(q: PhorgeQueue, task_id: int, task_class: str, age: int, duration: int) -> None:
    """An archived run of ``duration`` µs, archived ``age`` seconds ago (any result)."""
    now = q.server_time()
    with q.engine.begin() as conn:
        conn.execute(
            insert(archive).values(
                id=task_id,
                taskClass=task_class,
                leaseOwner="bridge:1:1:h:1",
                leaseExpires=now,
                failureCount=0,
                dataID=task_id,
                result=task_id % 3,
                duration=duration,
                dateCreated=now - age,
                dateModified=now - age,
                priority=2000,
                archivedEpoch=now - age,
            )
        )


def test_recent_runs_count_the_newest_runs_of_the_classes_in_the_window(q):
    for task_id, (task_class, age, duration) in enumerate(
        [(WORKER, 0, 10), (WORKER, 5, 20), (OTHER, 3, 1000), (WORKER, 9, 30), (WORKER, 100, 40)],
        start=1,
    ):
        archive_run(q, task_id, task_class, age, duration)

    # The span runs from the oldest counted row to now; a second of slack for the clock.
    runs = q.recent_runs([WORKER], window=60)
    assert (runs.count, runs.duration_us) == (3, 60) and 9 <= runs.span <= 10
    runs = q.recent_runs([WORKER, OTHER], window=60, limit=2)
    assert (runs.count, runs.duration_us) == (2, 1010) and 3 <= runs.span <= 4
    assert q.recent_runs([WORKER], window=60, limit=1).span == 1


def test_recent_runs_read_at_most_limit_rows_and_span_the_time_they_cover(q):
    for task_id, (task_class, age) in enumerate([(WORKER, 0), (OTHER, 3), (WORKER, 5)], 1):
        archive_run(q, task_id, task_class, age, 10)

    # Three rows read, one of OTHER: it ran once in the 5 seconds they cover.
    runs = q.recent_runs([OTHER], window=60, limit=3)
    assert (runs.count, runs.duration_us) == (1, 10) and 5 <= runs.span <= 6
    runs = q.recent_runs([OTHER], window=60, limit=10)  # all read: from its own run
    assert (runs.count, runs.duration_us) == (1, 10) and 3 <= runs.span <= 4


def test_recent_runs_of_nothing_is_zero_over_one_second(q):
    archive_run(q, 1, OTHER, 0, 10)
    assert q.recent_runs([WORKER], window=60) == RecentRuns(0, 0, 1)
    assert q.recent_runs([], window=60) == RecentRuns(0, 0, 1)


# -- candidates chosen per class --------------------------------------------------------
#
# With a bound of 3 rows, WORKER (2 rows) and OTHER (3) are small and read through
# ``taskClass`` one by one; UNSERVED (8) is large. The reference is the same phase with
# no class known as small: one statement over all the classes, as before.

SIZES = {WORKER: 2, OTHER: 3, UNSERVED: 8}


@pytest.fixture
def mixed(q) -> PhorgeQueue:
    """Rows of three classes, interleaved in priority and id, in every lease state."""
    tasks = [
        NewTask(name, priority=1000 + (n * 7 + len(name)) % 5 * 500)
        for n in range(max(SIZES.values()))
        for name, size in SIZES.items()
        if n < size
    ]
    ids = q.enqueue_many(tasks)
    # Every third row expired (distinct expiries), one delayed, one leased and live.
    for age, task_id in enumerate(ids[::3], start=1):
        expire(q, [task_id], seconds_ago=age * 10)
    set_rows(q, [ids[1]], leaseExpires=db_now() + 600)
    set_rows(q, [ids[4]], leaseOwner="php", leaseExpires=db_now() + 600)
    q.range_sizes = RangeSizes(ttl=60, bound=3)
    return q


def candidates(q: PhorgeQueue, select, limit: int, where: sql.LeaseFilter) -> list[tuple]:
    with q.engine.connect() as conn:
        return [tuple(row) for row in conn.execute(select(limit, where))]


@pytest.mark.parametrize("phase", [sql.select_unleased, sql.select_expired])
@pytest.mark.parametrize(
    "where",
    [
        sql.LeaseFilter([WORKER, OTHER, UNSERVED]),
        sql.LeaseFilter([OTHER, WORKER, OTHER]),
        sql.LeaseFilter([WORKER, UNSERVED], priority_below=2500),
        sql.LeaseFilter([WORKER, OTHER, UNSERVED], exclude_classes=[OTHER]),
        sql.LeaseFilter([UNSERVED, "Absent"]),
    ],
)
@pytest.mark.parametrize("limit", [1, 3, 20])
def test_candidates_per_class_are_those_of_one_statement(mixed, phase, where, limit):
    small = mixed.range_sizes.small_classes(mixed.engine, where.classes)
    assert small == set(where.classes) - {UNSERVED}  # an absent class is small too
    per_class = candidates(mixed, phase, limit, replace(where, small_classes=small))
    assert per_class == candidates(mixed, phase, limit, where)
    assert len(per_class) == min(limit, len(candidates(mixed, phase, 100, where)))


def test_leases_take_small_and_large_classes_in_phorges_order(mixed):
    everything = sql.LeaseFilter(list(SIZES))
    expired = [row[0] for row in candidates(mixed, sql.select_expired, 100, everything)]
    unleased = [row[0] for row in candidates(mixed, sql.select_unleased, 100, everything)]
    order = expired + unleased  # the poll's lease: the expired phase first

    taken = [set(lease_ids(mixed, 2, list(SIZES))) for _ in range(0, len(order) + 2, 2)]
    assert taken == [set(order[at : at + 2]) for at in range(0, len(order) + 2, 2)]


def test_small_classes_are_counted_again_only_after_their_ttl(q):
    q.enqueue_many([NewTask(WORKER)] * 3)
    cached, fresh = RangeSizes(ttl=3600, bound=3), RangeSizes(ttl=0, bound=3)
    assert (
        cached.small_classes(q.engine, [WORKER])
        == fresh.small_classes(q.engine, [WORKER])
        == {WORKER}
    )
    q.enqueue(WORKER)
    assert cached.small_classes(q.engine, [WORKER, OTHER]) == {WORKER, OTHER}
    assert fresh.small_classes(q.engine, [WORKER, OTHER]) == {OTHER}


@pytest.mark.parametrize("name", ["mysql", "mariadb"])
def test_index_hints_are_written_for_mysql_and_mariadb_only(name):
    where = sql.LeaseFilter([WORKER, OTHER], small_classes=frozenset([WORKER]))
    unleased = str(sql.select_unleased(5, where).compile(create_engine(f"{name}+mysqldb://")))
    expired = str(sql.select_expired(5, where).compile(create_engine(f"{name}+mysqldb://")))
    assert "FORCE INDEX (taskClass)" in unleased and "FORCE INDEX (key_owner)" in unleased
    assert "FORCE INDEX (taskClass)" in expired and "FORCE INDEX (leaseExpires)" in expired
    assert "FORCE INDEX" not in str(
        sql.select_unleased(5, where).compile(create_engine("sqlite://"))
    )


# -- on MariaDB, the plans ---------------------------------------------------------------


def fill(q: PhorgeQueue, n: int, task_class: str, priority: int, owner: str | None = None) -> None:
    """``n`` more rows of ``task_class`` (ids above any other), queued, or held by
    ``owner`` with a lease that ran out; loaded server-side from ``seq_1_to_n``."""
    owner_sql, expires_sql = ("NULL", "NULL") if owner is None else (f"'{owner}'", "1")
    with q.engine.begin() as conn:
        start = conn.exec_driver_sql("SELECT COALESCE(MAX(id), 0) FROM worker_activetask").scalar()
        conn.exec_driver_sql(
            "INSERT INTO worker_activetask (id, taskClass, leaseOwner, leaseExpires,"
            " failureCount, dataID, failureTime, priority, dateCreated, dateModified)"
            f" SELECT {start} + seq, '{task_class}', {owner_sql}, {expires_sql}, 0,"
            f" {start} + seq, NULL, {priority}, 1, 1 FROM seq_1_to_{n}"
        )
        conn.exec_driver_sql("ANALYZE TABLE worker_activetask").all()


def explained(q: PhorgeQueue, call) -> list[tuple[str, set[str]]]:
    """Each SELECT of a worker table that ``call()`` runs, with the indexes MariaDB's
    EXPLAIN names for it."""
    executed: list[tuple[str, object]] = []

    def record(conn, cursor, statement, parameters, context, executemany) -> None:
        if statement.startswith("SELECT") and "FROM worker_" in statement:
            executed.append((statement, parameters))

    event.listen(q.engine, "before_cursor_execute", record)
    try:
        call()
    finally:
        event.remove(q.engine, "before_cursor_execute", record)
    with q.engine.connect() as conn:
        return [
            (
                statement,
                {row.key for row in conn.exec_driver_sql("EXPLAIN " + statement, params)},
            )
            for statement, params in executed
        ]


def candidate_plans(q: PhorgeQueue, lease) -> dict[str, set[str]]:
    """The indexes of each lease phase's candidate SELECT ("unleased", "expired")."""
    plans: dict[str, set[str]] = {}
    for statement, keys in explained(q, lease):
        if "ORDER BY" in statement and "taskdata" not in statement:
            phase = "expired" if "IS NOT NULL" in statement else "unleased"
            plans.setdefault(phase, set()).update(keys - {None})
    return plans


@pytest.fixture
def mariadb_q(mysql_engine) -> PhorgeQueue:
    queue = PhorgeQueue(make_engine(mysql_engine.url.render_as_string(hide_password=False)))
    yield queue
    queue.engine.dispose()


def test_a_small_class_behind_many_unserved_rows_reads_the_taskclass_index(mariadb_q):
    q = mariadb_q
    # Enough served rows that one statement over them reads past all the others first
    # (``key_owner`` and ``leaseExpires`` ranges: HEAD's plans for this data set).
    fill(q, 20000, UNSERVED, 1000)
    fill(q, 20000, UNSERVED, 1000, owner=YIELD_OWNER)  # expired yields
    fill(q, 1000, WORKER, 4000)

    plans = candidate_plans(q, lambda: lease_ids(q, 16, [WORKER]))
    assert plans == {"expired": {"taskClass"}, "unleased": {"taskClass"}}


def test_with_few_expired_rows_the_expired_phase_reads_them_in_expiry_order(mariadb_q):
    q = mariadb_q
    fill(q, 20000, UNSERVED, 1000)
    fill(q, 1000, WORKER, 4000)

    plans = candidate_plans(q, lambda: lease_ids(q, 16, [WORKER, OTHER]))
    assert plans["expired"] == {"leaseExpires"}
    assert "taskClass" in plans["unleased"]


def test_recent_runs_read_a_bounded_backward_range_of_key_modified(mariadb_q):
    q = mariadb_q
    with q.engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO worker_archivetask (id, taskClass, leaseOwner, leaseExpires,"
            " failureCount, dataID, result, duration, dateCreated, dateModified, priority)"
            f" SELECT seq, '{WORKER}', NULL, 0, 0, seq, 0, 10, 1, UNIX_TIMESTAMP() - 20000 + seq,"
            " 2000 FROM seq_1_to_20000"
        )
        conn.exec_driver_sql("ANALYZE TABLE worker_archivetask").all()
    [(_, keys)] = explained(q, lambda: q.recent_runs([WORKER], 3600))
    assert keys - {None} == {"key_modified"}
    runs = q.recent_runs([WORKER], 3600)  # the newest 500, archived 499 s ago to now
    assert (runs.count, runs.duration_us) == (500, 5000) and 499 <= runs.span <= 501
