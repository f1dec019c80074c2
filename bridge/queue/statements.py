"""Every statement the bridge runs against Phorge's tables, named after what it does:
the queue's four, and the daemon log beside them that ``doctor`` reads.

Each builder says which Phorge code it reproduces. Guarded statements carry their
guard in the WHERE clause so that the affected-row count alone says who won; a
statement here never decides anything from a value read earlier.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    ColumnElement,
    CompoundSelect,
    Delete,
    Insert,
    Integer,
    Join,
    Label,
    LargeBinary,
    Select,
    String,
    Table,
    TextClause,
    Update,
    and_,
    bindparam,
    case,
    cast,
    delete,
    exists,
    func,
    insert,
    literal,
    not_,
    or_,
    select,
    text,
    union_all,
    update,
)

from bridge.queue.dialect import celery_bucket, db_now, owner_epoch
from bridge.queue.model import (
    RESULT_CANCELLED,
    YIELD_OWNER,
    NewTask,
    State,
    TaskFilter,
)
from bridge.queue.schema import FIELDS, daemon_log, lisk_counter
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_archivetask as archive
from bridge.queue.schema import worker_taskdata as taskdata

# Columns an archive row copies unchanged from its active row (archiveTask()).
COPIED_COLUMNS = (
    "id",
    "taskClass",
    "leaseOwner",
    "leaseExpires",
    "failureCount",
    "dataID",
    "priority",
    "objectPHID",
    "containerPHID",
    "dateCreated",
)


@dataclass(frozen=True)
class LeaseFilter:
    """Which rows a lease may take: by class (in or out), by id (``withIDs``) and by
    priority (only those more urgent than ``priority_below``, the poller's urgent lane).

    ``shares``: classes of ``classes`` the bridge shares with phd in a canary,
    with the bridge's weight (basis points, 0 < w < 10000): of those, only rows that never
    failed (``failureTime IS NULL``) and whose bucket is below the weight. Without any,
    the statements are exactly those of a bridge without a canary.
    """

    classes: Sequence[str] | None = None
    exclude_classes: Sequence[str] | None = None
    ids: Sequence[int] | None = None
    priority_below: int | None = None
    # Classes whose candidates are read through ``taskClass`` (few rows): a cost hint.
    small_classes: frozenset[str] = frozenset()
    shares: Mapping[str, int] = field(default_factory=dict)

    def where(self) -> list[ColumnElement[bool]]:
        where: list[ColumnElement[bool]] = []
        if self.priority_below is not None:
            where.append(active.c.priority < self.priority_below)
        if self.classes is not None:
            where.append(self._of_classes(list(self.classes)))
        if self.exclude_classes:
            where.append(active.c.taskClass.not_in(list(self.exclude_classes)))
        if self.ids is not None:
            where.append(active.c.id.in_(list(self.ids)))
        return where

    def _of_classes(self, classes: list[str]) -> ColumnElement[bool]:
        """``taskClass IN (classes)``, the shared ones only for the bridge's share:
        ``taskClass IN (whole) OR (taskClass IN (shared at w) AND failureTime IS NULL AND
        bucket < w) OR ...``, one term per weight."""
        by_weight: dict[int, list[str]] = defaultdict(list)
        whole = []
        for name in classes:
            if name in self.shares:
                by_weight[self.shares[name]].append(name)
            else:
                whole.append(name)
        if not by_weight:
            return active.c.taskClass.in_(classes)
        terms: list[ColumnElement[bool]] = [active.c.taskClass.in_(whole)] if whole else []
        terms += [
            and_(
                active.c.taskClass.in_(names),
                active.c.failureTime.is_(None),
                celery_bucket(active.c.id) < weight,
            )
            for weight, names in sorted(by_weight.items())
        ]
        return terms[0] if len(terms) == 1 else or_(*terms)


# -- enqueue: PhabricatorWorker::scheduleTask -------------------------------------------


def insert_data(data_json: str) -> Insert:
    """The ``worker_taskdata`` row (AUTO_INCREMENT id) holding the payload."""
    return insert(taskdata).values(data=data_json)


def insert_active(task_id: int, data_id: int, task: NewTask) -> Insert:
    """A new queued row: no owner, ``leaseExpires`` = delayUntil, no failures."""
    return insert(active).values(
        id=task_id,
        taskClass=task.task_class,
        leaseOwner=None,
        leaseExpires=task.delay_until,
        failureCount=0,
        dataID=data_id,
        failureTime=None,
        priority=task.priority,
        objectPHID=task.object_phid,
        containerPHID=task.container_phid,
        dateCreated=db_now(),
        dateModified=db_now(),
    )


# -- lease: PhabricatorWorkerLeaseQuery, with the bridge's delay-honouring phase 1 --------


SMALL_CLASS_ROWS = 5000
"""A class of at most this many active rows reads its candidates through ``taskClass``."""


def _force_index(query: Select[Any], index: str) -> Select[Any]:
    """``query`` reading ``worker_activetask`` through ``index`` on MariaDB and MySQL:
    their optimizers flip plans with the LIMIT (docs/internals-dispatch.md)."""
    hint = f"FORCE INDEX ({index})"
    return query.with_hint(active, hint, "mysql").with_hint(active, hint, "mariadb")


def _candidates(
    output: list[Column[Any]],
    order: list[Column[Any]],
    condition: list[ColumnElement[bool]],
    limit: int,
    where: LeaseFilter,
    large_index: str,
) -> Select[Any]:
    """The first ``limit`` rows meeting ``condition`` and ``where`` in ``order``: one
    sub-select per small class through ``taskClass`` (all its rows, however many rows
    of other classes come first), one for the large classes together through
    ``large_index``, under UNION ALL. Without classes, or with ``ids``, one statement
    left to the optimizer.
    """

    def part(
        classes: Sequence[str] | None, index: str | None, columns: Iterable[Column[Any]]
    ) -> Select[Any]:
        scope = replace(where, classes=classes)
        query: Select[Any] = select(*columns).where(*condition, *scope.where())
        query = query.order_by(*order).limit(limit)
        return query if index is None else _force_index(query, index)

    if where.classes is None or where.ids is not None:
        return part(where.classes, None, output)
    classes = list(dict.fromkeys(where.classes))
    groups = [([name], "taskClass") for name in classes if name in where.small_classes]
    large = [name for name in classes if name not in where.small_classes]
    if large:
        groups.append((large, large_index))
    if len(groups) == 1:
        return part(*groups[0], output)
    columns = {column.name: column for column in [*output, *order]}.values()
    parts = [select(*part(names, index, columns).subquery().c) for names, index in groups]
    union = union_all(*parts).subquery("candidates")
    return (
        select(*(union.c[column.name] for column in output))
        .order_by(*(union.c[column.name] for column in order))
        .limit(limit)
    )


def count_class_rows(
    classes: Sequence[str], bound: int
) -> CompoundSelect[str, int] | Select[str, int]:
    """Each class's active rows, counted up to ``bound + 1``: an index-only read of
    ``taskClass`` that stops there, so a large class costs no more than a small one."""

    def counted(name: str) -> Select[str, int]:
        rows = select(literal(1).label("one")).where(active.c.taskClass == name).limit(bound + 1)
        return select(literal(name).label("taskClass"), func.count().label("n")).select_from(
            _force_index(rows, "taskClass").subquery()
        )

    return union_all(*map(counted, classes)) if len(classes) > 1 else counted(classes[0])


def count_expired_range(bound: int) -> Select[Any]:
    """The rows whose ``leaseExpires`` is past, counted up to ``bound + 1`` (index only):
    what the expired phase reads through ``leaseExpires``."""
    rows = select(literal(1).label("one")).where(active.c.leaseExpires < db_now()).limit(bound + 1)
    return select(func.count()).select_from(_force_index(rows, "leaseExpires").subquery())


def _unleased_due() -> list[ColumnElement[bool]]:
    return [
        active.c.leaseOwner.is_(None),
        or_(active.c.leaseExpires.is_(None), active.c.leaseExpires <= db_now()),
    ]


def select_unleased(limit: int, where: LeaseFilter) -> Select[Any]:
    """Phase 1 candidates: never-leased (or freed) due tasks, ``priority, id`` order.

    Per class (see ``_candidates``); the large classes together read ``key_owner`` from
    (NULL, the smallest priority), in order, so they stop after ``limit`` rows.
    """
    return _candidates(
        [active.c.id],
        [active.c.priority, active.c.id],
        _unleased_due(),
        limit,
        where,
        large_index="key_owner",
    )


def take_unleased(ids: Sequence[int], owner: str, seconds: int) -> Update:
    """Phase 1 lease: repeats the candidate condition, so only still-free rows are taken."""
    return (
        update(active)
        .where(*_unleased_due(), active.c.id.in_(list(ids)))
        .values(leaseOwner=owner, leaseExpires=db_now() + seconds)
    )


def select_expired(limit: int, where: LeaseFilter) -> Select[Any]:
    """Phase 2 candidates: owned rows whose lease (or retry wait, or yield) ran out.

    Oldest expiry first, so a task that keeps failing goes to the back. Per class (see
    ``_candidates``); the large classes together read ``leaseExpires`` in order.
    """
    return _candidates(
        [active.c.id, active.c.leaseOwner],
        [active.c.leaseExpires],
        [active.c.leaseOwner.is_not(None), active.c.leaseExpires < db_now()],
        limit,
        where,
        large_index="leaseExpires",
    )


def take_expired(rows: Iterable[tuple[int, str]], owner: str, seconds: int) -> Update:
    """Phase 2 lease: each row only if it still has the owner seen and is still expired."""
    seen = [and_(active.c.id == task_id, active.c.leaseOwner == old) for task_id, old in rows]
    return (
        update(active)
        .where(or_(*seen), active.c.leaseExpires < db_now())
        .values(leaseOwner=owner, leaseExpires=db_now() + seconds)
    )


def task_columns(table: Table, names: Iterable[str] | None = None) -> list[Label[Any]]:
    """``table``'s columns (or those ``names``) labelled as ``Task`` names its fields."""
    columns = table.c if names is None else [table.c[name] for name in names]
    return [column.label(FIELDS[column.name]) for column in columns]


def _data_bytes() -> ColumnElement[bytes]:
    """The data column as bytes: one row a UTF-8 connection cannot decode must fail alone."""
    return cast(taskdata.c.data, LargeBinary).label("raw_data")


def _active_with_data() -> Join:
    """The active rows joined to their data rows (NULL data when one is missing)."""
    return active.outerjoin(taskdata, taskdata.c.id == active.c.dataID)


def _with_data(query: Select[Any]) -> Select[Any]:
    """``query`` plus the row's data (NULL when the data row is missing)."""
    return query.add_columns(_data_bytes()).select_from(_active_with_data())


def select_leased(owner: str) -> Select[Any]:
    """The rows a lease just won, with their data and the server's clock."""
    query = select(*task_columns(active), db_now().label("server_time")).where(_held_by(owner))
    return _with_data(query).order_by(active.c.priority, active.c.id)


def select_leased_to_send(owner: str, inline_max: int) -> Select[Any]:
    """The rows a dispatch lease just won, as their messages carry them: the fence, the
    class, and the data (undecoded bytes) only when it is at most ``inline_max`` bytes."""
    data = taskdata.c.data
    small = case((func.length(data) <= inline_max, cast(data, LargeBinary)), else_=None)
    query = select(
        *task_columns(active, ("id", "failureCount", "taskClass")), small.label("raw_data")
    )
    return (
        query.select_from(_active_with_data())
        .where(_held_by(owner))
        .order_by(active.c.priority, active.c.id)
    )


def _held_by(owner: str) -> ColumnElement[bool]:
    return and_(active.c.leaseOwner == owner, active.c.leaseExpires > db_now())


def _waiting_to_retry() -> ColumnElement[bool]:
    """A failed row keeps its owner; it waits to retry until a later lease replaces it."""
    leased_at = owner_epoch(active.c.leaseOwner)
    return and_(
        active.c.failureTime.is_not(None),
        or_(leased_at.is_(None), leased_at <= active.c.failureTime),
    )


# -- the fenced per-task path: built once, with bound parameters ---------------------------
#
# ``task_id``, ``owner`` and ``failure_count`` are the fence (``model.Lease``): a row is
# held while it has this owner, this failure count and an unexpired lease. The failure
# count tells a leased row from one that failed under the same owner and waits to retry.
# A NULL ``failure_count`` leaves it out (operator and PHP-style callers).

_OWNED = and_(
    active.c.id == bindparam("task_id", type_=Integer),
    active.c.leaseOwner == bindparam("owner", type_=String),
    or_(
        bindparam("failure_count", type_=Integer).is_(None),
        active.c.failureCount == bindparam("failure_count", type_=Integer),
    ),
)
_FENCE = and_(_OWNED, active.c.leaseExpires > db_now())

HELD = select(*task_columns(active), db_now().label("server_time")).where(_FENCE)
"""The held row (the check before a run), without its data."""

HELD_WITH_DATA = _with_data(HELD)
"""The held row with its data (a dispatch whose data was too large to travel inline)."""

ARCHIVE = insert(archive).from_select(
    [*COPIED_COLUMNS, "result", "duration", "dateModified", "archivedEpoch"],
    select(
        *(
            bindparam("archive_owner", type_=String) if name == "leaseOwner" else active.c[name]
            for name in COPIED_COLUMNS
        ),
        bindparam("result", type_=Integer),
        bindparam("duration", type_=BigInteger),
        db_now(),
        db_now(),
    )
    .where(_FENCE)
    .with_for_update(),
)
"""archiveTask(), first half: copy the held row, locked, into the archive (result, µs).

The archive row's leaseOwner is ``archive_owner``: the lease's owner with the label of
the implementation that ran it (``prefix:label:pid:epoch:host:seq``). One row inserted
means the fence held; the lock keeps the row as copied until commit.
"""

DELETE_ARCHIVED_ACTIVE = delete(active).where(
    active.c.id == bindparam("task_id", type_=Integer),
    active.c.leaseOwner == bindparam("owner", type_=String),
    exists().where(archive.c.id == active.c.id),
)
"""archiveTask(), second half: the active row goes only once its archive row exists."""

RENEW_LEASE = (
    update(active).where(_FENCE).values(leaseExpires=db_now() + bindparam("seconds", type_=Integer))
)
"""Extend a held lease to now + seconds (setLeaseDuration after checkLease)."""

FAIL_TEMPORARY = (
    update(active)
    .where(_FENCE)
    .values(
        leaseOwner=bindparam("failed_owner", type_=String),
        failureCount=active.c.failureCount + 1,
        failureTime=db_now(),
        leaseExpires=db_now() + bindparam("wait", type_=Integer),
        dateModified=db_now(),
    )
)
"""Temporary failure: failureCount + 1, failureTime, retry after ``wait``; the owner stays
the failed run's, labelled as its archive row would be (``failed_owner``), so that the
canary guard tells whose failure it was while the row waits."""

HAND_BACK = (
    update(active).where(_FENCE).values(leaseOwner=None, leaseExpires=None, dateModified=db_now())
)
"""Hand back a lease whose task did not run here: due at once, failureCount unchanged."""

FALL_BACK = (
    update(active)
    .where(_OWNED)
    .values(leaseOwner=None, leaseExpires=None, failureTime=db_now(), dateModified=db_now())
)
"""A canary's fallback: the new side's run failed, so the row goes to the old side
(``failureTime`` set makes it the old side's for good) and is due at once; failureCount
unchanged, so the new side's failure never counts towards the permanent limit. Fenced on
the owner, not the expiry: a run that outlived its lease falls back too while its owner
still holds the row (who leased it since changed the owner), and runs nothing itself."""

YIELD_LEASE = (
    update(active)
    .where(_FENCE)
    .values(
        leaseOwner=YIELD_OWNER,
        leaseExpires=db_now() + bindparam("seconds", type_=Integer),
        dateModified=db_now(),
    )
)
"""Yield: owner ``(yield)`` until now + seconds; failureCount unchanged."""

# -- was it written? After a connection lost with a COMMIT in flight, the row tells ---------
#
# Each finds the row as its outcome leaves it, under the same lease (owner, count).

ARCHIVED_BY = select(archive.c.id).where(
    archive.c.id == bindparam("task_id", type_=Integer),
    archive.c.leaseOwner == bindparam("archive_owner", type_=String),
    archive.c.failureCount == bindparam("failure_count", type_=Integer),
    archive.c.result == bindparam("result", type_=Integer),
)
"""The archive row an archiving outcome under this lease wrote."""

FAILED_BY = select(active.c.id).where(
    active.c.id == bindparam("task_id", type_=Integer),
    active.c.leaseOwner == bindparam("failed_owner", type_=String),
    active.c.failureCount == bindparam("failure_count", type_=Integer) + 1,
    active.c.failureTime.is_not(None),
)
"""The active row a temporary failure under this lease left (one more failure)."""

YIELDED_FROM = select(active.c.id).where(
    active.c.id == bindparam("task_id", type_=Integer),
    active.c.leaseOwner == YIELD_OWNER,
    active.c.failureCount == bindparam("failure_count", type_=Integer),
)
"""The active row a yield left (owner ``(yield)``, the failure count unchanged)."""

HANDED_BACK_FROM = select(active.c.id).where(
    active.c.id == bindparam("task_id", type_=Integer),
    active.c.leaseOwner.is_(None),
    active.c.failureCount == bindparam("failure_count", type_=Integer),
)
"""The active row a hand-back left (no owner, the failure count unchanged)."""

FELL_BACK_FROM = select(active.c.id).where(
    active.c.id == bindparam("task_id", type_=Integer),
    active.c.leaseOwner.is_(None),
    active.c.failureCount == bindparam("failure_count", type_=Integer),
    active.c.failureTime.is_not(None),
)
"""The active row a fallback left (no owner, a failureTime, the failure count unchanged):
the new side's rows have none, so a hand-back or a free is not taken for it."""


def count_in_flight_by_class(
    owner_prefix: str, classes: Sequence[str] | None = None, stranded_after: int | None = None
) -> Select[Any]:
    """Live leases per class whose owner is ``owner_prefix:...`` (the poller's capacity):
    how many, and the largest priority number among them.

    Rows waiting to retry keep their failed run's owner; they are not in flight.
    ``classes`` restricts the count to them, so rows of other classes (which may be many,
    e.g. waiting to retry) are never read. ``stranded_after`` (MySQL: named locks) leaves
    out leases taken that many seconds ago or more that no live run holds
    (``run_locks``): their message was lost, or its worker is gone.
    """
    escaped = owner_prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    where = [
        active.c.leaseOwner.like(escaped + ":%", escape="\\"),
        active.c.leaseExpires > db_now(),
        ~_waiting_to_retry(),
    ]
    if classes is not None:
        where.append(active.c.taskClass.in_(list(classes)))
    if stranded_after is not None:
        where.append(
            or_(
                owner_epoch(active.c.leaseOwner) > db_now() - stranded_after,
                func.is_used_lock(run_lock_key_of(active.c.id)).is_not(None),
            )
        )
    return (
        select(active.c.taskClass, func.count(), func.max(active.c.priority))
        .where(*where)
        .group_by(active.c.taskClass)
    )


def select_task_classes() -> Select[Any]:
    """Distinct task classes in the active table (an index-only scan of ``taskClass``)."""
    return select(active.c.taskClass).distinct()


# -- insert_archive also serves cancel ------------------------------------------------


def archived_priority(task_id: int) -> Select[Any]:
    """The priority an archived row kept (its follow-ups inherit it)."""
    return select(archive.c.priority).where(archive.c.id == task_id)


def insert_archive(row: Any, result: int, duration_us: int, **overrides: Any) -> Insert:
    """An archive row from a row read: copied columns, result, duration (µs), no failureTime."""
    values = {name: getattr(row, name) for name in COPIED_COLUMNS}
    values.update(overrides)
    return insert(archive).values(
        **values,
        result=result,
        duration=duration_us,
        dateModified=db_now(),
        archivedEpoch=db_now(),
    )


def extend_sent_leases(ids: Sequence[int], owner: str, seconds: int) -> Update:
    """The dispatch lease of rows whose messages the broker took (the poll leased them
    for a moment only, so that a poll that dies before sending frees them soon); never
    shortens a lease a run has renewed further, nor stretches the retry wait of a run
    that already failed (a failed row keeps its owner)."""
    until = db_now() + seconds
    return (
        update(active)
        .where(
            active.c.id.in_(list(ids)),
            active.c.leaseOwner == owner,
            active.c.leaseExpires < until,
            not_(_waiting_to_retry()),
        )
        .values(leaseExpires=until)
    )


def free_own_leases(ids: Sequence[int], owner: str) -> Update:
    """Hand back leases this owner never started (shutdown), so they are due at once."""
    return (
        update(active)
        .where(active.c.id.in_(list(ids)), _held_by(owner))
        .values(leaseOwner=None, leaseExpires=None, dateModified=db_now())
    )


# -- operator actions: bin/worker ---------------------------------------------------------


def lock_active(task_id: int) -> Select[Any]:
    return select(active).where(active.c.id == task_id).with_for_update()


def delete_active(task_id: int) -> Delete:
    return delete(active).where(active.c.id == task_id)


def cancel_archive(row: Any) -> Insert:
    """cancel: the lease is broken (owner NULL, expires now), archived as result 2."""
    return insert_archive(row, RESULT_CANCELLED, 0, leaseOwner=None, leaseExpires=db_now())


def free_lease(task_id: int) -> Update:
    """free: owner NULL, expires now; only a leased row (``(yield)`` counts as leased)."""
    return (
        update(active)
        .where(active.c.id == task_id, active.c.leaseOwner.is_not(None))
        .values(leaseOwner=None, leaseExpires=db_now(), dateModified=db_now())
    )


def delay_until(task_id: int, until: int) -> Update:
    """delay --until: only a row nobody holds."""
    return (
        update(active)
        .where(active.c.id == task_id, active.c.leaseOwner.is_(None))
        .values(leaseExpires=until, dateModified=db_now())
    )


def set_priority(task_id: int, priority: int) -> Update:
    """priority --priority N: a row whose priority differs."""
    return (
        update(active)
        .where(active.c.id == task_id, active.c.priority != priority)
        .values(priority=priority, dateModified=db_now())
    )


def lock_archived(task_id: int) -> Select[Any]:
    return select(archive).where(archive.c.id == task_id).with_for_update()


def reinsert_active(row: Any) -> Insert:
    """retry (unarchiveTask): same id, data, priority, PHIDs and dateCreated; queued anew."""
    return insert(active).values(
        id=row.id,
        taskClass=row.taskClass,
        leaseOwner=None,
        leaseExpires=0,
        failureCount=0,
        dataID=row.dataID,
        failureTime=None,
        priority=row.priority,
        objectPHID=row.objectPHID,
        containerPHID=row.containerPHID,
        dateCreated=row.dateCreated,
        dateModified=db_now(),
    )


def delete_archived(task_id: int) -> Delete:
    """The archive row goes; its data row stays for the re-queued task."""
    return delete(archive).where(archive.c.id == task_id)


def awaken(ids: Sequence[int]) -> Update:
    """PhabricatorWorker::awakenTaskIDs: pull yielded, never-failed tasks forward."""
    hour_ago = db_now() - 3600
    return (
        update(active)
        .where(
            active.c.id.in_(list(ids)),
            active.c.leaseOwner == YIELD_OWNER,
            active.c.leaseExpires > hour_ago,
            active.c.failureCount == 0,
        )
        .values(leaseExpires=hour_ago)
    )


# -- reads: bin/worker's selectors, the daemon console's counts ---------------------------


def select_tasks(table: Table, selector: TaskFilter) -> Select[Any]:
    """Rows of ``table`` (active or archive) matching ``selector``, with their data."""
    c = table.c
    where: list[ColumnElement[bool]] = []
    if selector.ids is not None:
        where.append(c.id.in_(list(selector.ids)))
    if selector.classes is not None:
        where.append(c.taskClass.in_(list(selector.classes)))
    if selector.container_phids is not None:
        where.append(c.containerPHID.in_(list(selector.container_phids)))
    if selector.object_phids is not None:
        where.append(c.objectPHID.in_(list(selector.object_phids)))
    if selector.min_failure_count is not None:
        where.append(c.failureCount >= selector.min_failure_count)
    if selector.max_failure_count is not None:
        where.append(c.failureCount <= selector.max_failure_count)
    if selector.min_priority is not None:
        where.append(c.priority >= selector.min_priority)
    if selector.max_priority is not None:
        where.append(c.priority <= selector.max_priority)
    query = (
        select(*task_columns(table), _data_bytes(), db_now().label("server_time"))
        .select_from(table.outerjoin(taskdata, taskdata.c.id == c.dataID))
        .where(*where)
        .order_by(c.id.desc())
    )
    return query if selector.limit is None else query.limit(selector.limit)


def state_case(now: int) -> ColumnElement[str]:
    """The SQL twin of ``model.state_of``: an active row's state at ``now``."""
    c = active.c
    due = or_(c.leaseExpires.is_(None), c.leaseExpires <= now)
    return case(
        (and_(c.leaseOwner.is_(None), c.leaseExpires > now), literal(State.DELAYED.value)),
        (c.leaseOwner.is_(None), literal(State.QUEUED.value)),
        (and_(c.leaseOwner == YIELD_OWNER, due), literal(State.YIELD_ENDED.value)),
        (c.leaseOwner == YIELD_OWNER, literal(State.YIELDED.value)),
        (and_(_waiting_to_retry(), due), literal(State.RETRY_DUE.value)),
        (_waiting_to_retry(), literal(State.RETRY_WAIT.value)),
        (due, literal(State.EXPIRED.value)),
        else_=literal(State.LEASED.value),
    )


def count_active_by_class_and_state(now: int) -> Select[Any]:
    """Active rows per (class, state), with the oldest creation time of each group."""
    state = state_case(now).label("state")
    return select(active.c.taskClass, state, func.count(), func.min(active.c.dateCreated)).group_by(
        active.c.taskClass, state
    )


def active_ages(now: int, shares: Mapping[str, int] | None = None) -> Select[Any]:
    """Active rows per (class, state, whose): count, since when the first was due (its
    lease expiry, else its creation), when the first was leased (its owner's epoch), and
    whether they are the bridge's: of a class it shares with phd (``shares``, as
    :class:`LeaseFilter`'s), the rows phd runs (failed once, or bucketed at or above the
    weight) are not."""
    c = active.c
    state = state_case(now).label("state")
    by_weight: dict[int, list[str]] = defaultdict(list)
    for name, weight in (shares or {}).items():
        by_weight[weight].append(name)
    phds = [
        (
            and_(
                c.taskClass.in_(names),
                or_(c.failureTime.is_not(None), celery_bucket(c.id) >= weight),
            ),
            0,
        )
        for weight, names in sorted(by_weight.items())
    ]
    ours = case(*phds, else_=1).label("ours") if phds else literal(1).label("ours")
    grouping = [c.taskClass, state, ours] if phds else [c.taskClass, state]
    return select(
        c.taskClass,
        state,
        func.count(),
        func.min(func.coalesce(c.leaseExpires, c.dateCreated)),
        func.min(case((c.leaseOwner != YIELD_OWNER, owner_epoch(c.leaseOwner)))),
        ours,
    ).group_by(*grouping)


def count_archived_by_class_and_result(since: int) -> Select[Any]:
    """Archived rows per (class, result) modified since ``since`` (the ``key_modified`` index)."""
    return (
        select(archive.c.taskClass, archive.c.result, func.count())
        .where(archive.c.dateModified >= since)
        .group_by(archive.c.taskClass, archive.c.result)
    )


def sum_recent_runs(classes: Sequence[str], window: int, limit: int) -> Select[Any]:
    """Of the newest ``limit`` archived rows of the last ``window`` seconds (any class):
    the runs of ``classes`` (count, total µs, oldest ``dateModified``), the rows read
    (count, oldest), and the server's clock.

    A backward range on ``key_modified`` that stops after ``limit`` rows, so its cost
    stays bounded however fast tasks are archived, whatever share ``classes`` have.
    """
    newest = (
        select(archive.c.taskClass, archive.c.duration, archive.c.dateModified)
        .where(archive.c.dateModified >= db_now() - window)
        .order_by(archive.c.dateModified.desc())
        .limit(limit)
        .subquery("newest")
    )
    ours = newest.c.taskClass.in_(list(classes))
    return select(
        func.coalesce(func.sum(case((ours, 1), else_=0)), 0),
        func.coalesce(func.sum(case((ours, newest.c.duration), else_=0)), 0),
        func.min(case((ours, newest.c.dateModified), else_=None)),
        func.count(),
        func.min(newest.c.dateModified),
        db_now(),
    ).select_from(newest)


# -- doctor: the task id counter, Phorge's daemon console ----------------------------------


def select_task_id_counter() -> Select[Any]:
    """lisk_counter's ``worker_activetask`` value, the next ids' base (none: no row yet)."""
    return select(lisk_counter.c.counterValue).where(
        lisk_counter.c.counterName == "worker_activetask"
    )


def select_highest_task_id() -> Select[Any]:
    """The highest task id, active or archived (NULL in an empty queue)."""
    highest = union_all(select(func.max(active.c.id).label("id")), select(func.max(archive.c.id)))
    ids = highest.subquery("ids")
    return select(func.max(ids.c.id))


def count_daemons(
    database: str,
    daemon: str,
    unknown_after: int,
    dead_after: int,
    running: Sequence[str],
    argument: str,
) -> Select[int, int, int, int]:
    """PhabricatorDaemonLogQuery's verdicts on the daemons whose class is like ``daemon``
    with a ``running`` status in the daemon log of ``database``: how many have a heartbeat
    at most ``unknown_after`` seconds old (live), at most ``dead_after`` (unknown), and
    older (dead); and how many of the live ones were started with ``argument`` (the log
    keeps their arguments as a JSON list)."""
    log = daemon_log(database)
    age = db_now() - log.c.dateModified
    live = age <= unknown_after

    def count(condition: ColumnElement[bool]) -> ColumnElement[int]:
        return func.coalesce(func.sum(case((condition, 1), else_=0)), 0)

    return select(
        count(live),
        count(and_(age > unknown_after, age <= dead_after)),
        count(age > dead_after),
        count(and_(live, log.c.argv.like(f'%"{argument}"%'))),
    ).where(log.c.status.in_(list(running)), log.c.daemon.like(daemon))


def list_daemon(database: str, row: Mapping[str, Any]) -> Insert:
    """A daemon's row in the daemon log of ``database``, launched and last seen now (by
    the database's clock, which Phorge's console judges heartbeats by)."""
    return insert(daemon_log(database)).values(dateCreated=db_now(), dateModified=db_now(), **row)


def daemon_status(database: str, daemon_id: str, status: str) -> Update:
    """A heartbeat of the daemon ``daemon_id``: its status, seen now."""
    log = daemon_log(database)
    return (
        update(log).where(log.c.daemonID == daemon_id).values(status=status, dateModified=db_now())
    )


def current_account() -> Select[Any]:
    """The account the server granted this session, ``user@host`` as a GRANT names it
    (``CURRENT_USER()``: the matching account, not the name the client gave)."""
    return select(func.current_user())


def server_time() -> Select[Any]:
    return select(db_now())


def probe_writes() -> Update:
    """A write that changes nothing (no task has id 0): a server that refuses writes
    (read-only) refuses it too, so it tells when writes are accepted again."""
    return update(active).where(active.c.id == 0).values(id=active.c.id)


def get_lock(name: str) -> Select[Any]:
    """MySQL's named lock, taken without waiting, with the server's clock."""
    return select(func.get_lock(name, 0), db_now())


def release_lock(name: str) -> Select[Any]:
    return select(func.release_lock(name))


RUN_LOCK_PREFIX = "pb-run:"  # the named locks of tasks being run (``run_locks``)


def run_lock_key_of(task_id: ColumnElement[Any]) -> ColumnElement[str]:
    """``run_locks.run_lock_key`` in SQL, for rows: the two must agree."""
    return func.concat(RUN_LOCK_PREFIX, func.md5(func.concat(func.database(), ":", task_id)))


def take_run_locks(keys: Sequence[str], wait: float) -> Select[Any]:
    """Each named lock of ``keys`` (1 taken, 0 held elsewhere), waiting up to ``wait``
    seconds for the first only."""
    return select(*(func.get_lock(key, wait if i == 0 else 0) for i, key in enumerate(keys)))


def free_run_locks(keys: Sequence[str]) -> Select[Any]:
    """Whether each named lock of ``keys`` is free (1) or held by a live session (0)."""
    return select(*(func.is_free_lock(key) for key in keys))


def release_run_locks(keys: Sequence[str]) -> Select[Any]:
    return select(*(func.release_lock(key) for key in keys))


PING = select(literal(1))


def lock_held_here(name: str) -> Select[Any]:
    """Whether this connection holds the named lock ``name`` (0 or 1, never NULL)."""
    return select(func.coalesce(func.is_used_lock(name) == func.connection_id(), 0))


def lock_holder(name: str) -> Select[Any]:
    """The connection id holding the named lock ``name``, or NULL when none does."""
    return select(func.is_used_lock(name))


def set_idle_timeout(seconds: int) -> TextClause:
    """How long the server keeps this session while it sends nothing: a lock holder
    whose host vanished (no FIN) frees its lock after this, not after hours."""
    return text(f"SET SESSION wait_timeout = {int(seconds)}")
