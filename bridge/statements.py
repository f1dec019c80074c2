"""Every statement the bridge runs against Phorge's queue tables, named after what it does.

Each builder says which Phorge code it reproduces. Guarded statements carry their
guard in the WHERE clause so that the affected-row count alone says who won; a
statement here never decides anything from a value read earlier.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Delete,
    Insert,
    Select,
    Update,
    and_,
    case,
    delete,
    func,
    insert,
    literal,
    or_,
    select,
    update,
)

from bridge.dialect import db_now, owner_epoch
from bridge.model import (
    RESULT_CANCELLED,
    YIELD_OWNER,
    NewTask,
    State,
    TaskFilter,
)
from bridge.schema import worker_activetask as active
from bridge.schema import worker_archivetask as archive
from bridge.schema import worker_taskdata as taskdata

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


def _class_filter(
    classes: Sequence[str] | None, exclude_classes: Sequence[str] | None
) -> list[ColumnElement[bool]]:
    where: list[ColumnElement[bool]] = []
    if classes is not None:
        where.append(active.c.taskClass.in_(list(classes)))
    if exclude_classes:
        where.append(active.c.taskClass.not_in(list(exclude_classes)))
    return where


# -- enqueue: PhabricatorWorker::scheduleTask -------------------------------------------


def insert_data(data_json: str) -> Insert:
    """The ``worker_taskdata`` row (AUTO_INCREMENT id) holding the payload."""
    return insert(taskdata).values(data=data_json)


def insert_active(task_id: int, data_id: int, task: NewTask) -> Insert:
    """A new queued row: no owner, ``leaseExpires`` = delayUntil, no failures."""
    return insert(active).values(
        id=task_id,
        taskClass=task.taskClass,
        leaseOwner=None,
        leaseExpires=task.delayUntil,
        failureCount=0,
        dataID=data_id,
        failureTime=None,
        priority=task.priority,
        objectPHID=task.objectPHID,
        containerPHID=task.containerPHID,
        dateCreated=db_now(),
        dateModified=db_now(),
    )


# -- lease: PhabricatorWorkerLeaseQuery, with the bridge's delay-honouring phase 1 --------


def _unleased_due() -> list[ColumnElement[bool]]:
    return [
        active.c.leaseOwner.is_(None),
        or_(active.c.leaseExpires.is_(None), active.c.leaseExpires <= db_now()),
    ]


def select_unleased(limit: int, classes=None, exclude_classes=None) -> Select:
    """Phase 1 candidates: never-leased (or freed) due tasks, ``priority, id`` order."""
    return (
        select(active.c.id)
        .where(*_unleased_due(), *_class_filter(classes, exclude_classes))
        .order_by(active.c.priority, active.c.id)
        .limit(limit)
    )


def take_unleased(ids: Sequence[int], owner: str, seconds: int) -> Update:
    """Phase 1 lease: repeats the candidate condition, so only still-free rows are taken."""
    return (
        update(active)
        .where(*_unleased_due(), active.c.id.in_(list(ids)))
        .values(leaseOwner=owner, leaseExpires=db_now() + seconds)
    )


def select_expired(limit: int, classes=None, exclude_classes=None) -> Select:
    """Phase 2 candidates: owned rows whose lease (or retry wait, or yield) ran out.

    Oldest expiry first, so a task that keeps failing goes to the back.
    """
    return (
        select(active.c.id, active.c.leaseOwner)
        .where(
            active.c.leaseOwner.is_not(None),
            active.c.leaseExpires < db_now(),
            *_class_filter(classes, exclude_classes),
        )
        .order_by(active.c.leaseExpires)
        .limit(limit)
    )


def take_expired(rows: Iterable[tuple[int, str]], owner: str, seconds: int) -> Update:
    """Phase 2 lease: each row only if it still has the owner seen and is still expired."""
    seen = [and_(active.c.id == task_id, active.c.leaseOwner == old) for task_id, old in rows]
    return (
        update(active)
        .where(or_(*seen), active.c.leaseExpires < db_now())
        .values(leaseOwner=owner, leaseExpires=db_now() + seconds)
    )


def select_held(owner: str, task_id: int | None = None, with_data: bool = True) -> Select:
    """Rows ``owner`` holds right now, with the server's clock (and their data if asked)."""
    if with_data:
        query = select(
            active, taskdata.c.data.label("rawData"), db_now().label("serverTime")
        ).select_from(active.outerjoin(taskdata, taskdata.c.id == active.c.dataID))
    else:
        query = select(active, db_now().label("serverTime"))
    query = query.where(_held_by(owner)).order_by(active.c.priority, active.c.id)
    return query if task_id is None else query.where(active.c.id == task_id)


def _held_by(owner: str) -> ColumnElement[bool]:
    return and_(active.c.leaseOwner == owner, active.c.leaseExpires > db_now())


def _guard(task_id: int, owner: str) -> ColumnElement[bool]:
    """The fence of every outcome: this id, this owner, lease not expired."""
    return and_(active.c.id == task_id, _held_by(owner))


def _waiting_to_retry() -> ColumnElement[bool]:
    """A failed row keeps its owner; it waits to retry until a later lease replaces it."""
    leased_at = owner_epoch(active.c.leaseOwner)
    return and_(
        active.c.failureTime.is_not(None),
        or_(leased_at.is_(None), leased_at <= active.c.failureTime),
    )


def count_held_by_class(owner_prefix: str) -> Select:
    """Live leases per class whose owner is ``owner_prefix:...`` (the poller's capacity).

    Rows waiting to retry keep their failed run's owner; they are not in flight.
    """
    escaped = owner_prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return (
        select(active.c.taskClass, func.count())
        .where(
            active.c.leaseOwner.like(escaped + ":%", escape="\\"),
            active.c.leaseExpires > db_now(),
            ~_waiting_to_retry(),
        )
        .group_by(active.c.taskClass)
    )


def select_task_classes() -> Select:
    """Distinct task classes in the active table (an index-only scan of ``taskClass``)."""
    return select(active.c.taskClass).distinct()


# -- outcomes: PhabricatorWorkerActiveTask::executeTask ----------------------------------


def renew_lease(task_id: int, owner: str, seconds: int) -> Update:
    """Extend a held lease to now + seconds (setLeaseDuration after checkLease)."""
    return update(active).where(_guard(task_id, owner)).values(leaseExpires=db_now() + seconds)


def lock_held(task_id: int, owner: str) -> Select:
    """The held row, locked for the archive transaction."""
    return select(active).where(_guard(task_id, owner)).with_for_update()


def insert_archive(row: Any, result: int, duration_us: int, **overrides: Any) -> Insert:
    """The archive row: copied columns, result, duration (µs), no failureTime."""
    values = {name: getattr(row, name) for name in COPIED_COLUMNS}
    values.update(overrides)
    return insert(archive).values(
        **values,
        result=result,
        duration=duration_us,
        dateModified=db_now(),
        archivedEpoch=db_now(),
    )


def delete_held(task_id: int, owner: str) -> Delete:
    """Remove the archived row from the active table, still fenced by its owner."""
    return delete(active).where(active.c.id == task_id, active.c.leaseOwner == owner)


def fail_temporary(task_id: int, owner: str, wait: int) -> Update:
    """Temporary failure: failureCount + 1, failureTime, retry after ``wait``; owner stays."""
    return (
        update(active)
        .where(_guard(task_id, owner))
        .values(
            failureCount=active.c.failureCount + 1,
            failureTime=db_now(),
            leaseExpires=db_now() + wait,
            dateModified=db_now(),
        )
    )


def yield_lease(task_id: int, owner: str, seconds: int) -> Update:
    """Yield: owner ``(yield)`` until now + seconds; failureCount unchanged."""
    return (
        update(active)
        .where(_guard(task_id, owner))
        .values(leaseOwner=YIELD_OWNER, leaseExpires=db_now() + seconds, dateModified=db_now())
    )


def free_own_leases(ids: Sequence[int], owner: str) -> Update:
    """Hand back leases this owner never started (shutdown), so they are due at once."""
    return (
        update(active)
        .where(active.c.id.in_(list(ids)), _held_by(owner))
        .values(leaseOwner=None, leaseExpires=None, dateModified=db_now())
    )


# -- operator actions: bin/worker ---------------------------------------------------------


def lock_active(task_id: int) -> Select:
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


def lock_archived(task_id: int) -> Select:
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


def select_tasks(table, selector: TaskFilter) -> Select:
    """Rows of ``table`` (active or archive) matching ``selector``, with their data."""
    c = table.c
    where: list[ColumnElement[bool]] = []
    if selector.ids is not None:
        where.append(c.id.in_(list(selector.ids)))
    if selector.classes is not None:
        where.append(c.taskClass.in_(list(selector.classes)))
    if selector.containerPHIDs is not None:
        where.append(c.containerPHID.in_(list(selector.containerPHIDs)))
    if selector.objectPHIDs is not None:
        where.append(c.objectPHID.in_(list(selector.objectPHIDs)))
    if selector.min_failure_count is not None:
        where.append(c.failureCount >= selector.min_failure_count)
    if selector.max_failure_count is not None:
        where.append(c.failureCount <= selector.max_failure_count)
    if selector.min_priority is not None:
        where.append(c.priority >= selector.min_priority)
    if selector.max_priority is not None:
        where.append(c.priority <= selector.max_priority)
    query = (
        select(table, taskdata.c.data.label("rawData"), db_now().label("serverTime"))
        .select_from(table.outerjoin(taskdata, taskdata.c.id == c.dataID))
        .where(*where)
        .order_by(c.id.desc())
    )
    return query if selector.limit is None else query.limit(selector.limit)


def state_case(now: int) -> ColumnElement[str]:
    """The SQL twin of ``model.classify``: an active row's state at ``now``."""
    c = active.c
    return case(
        (and_(c.leaseOwner.is_(None), c.leaseExpires > now), literal(State.DELAYED.value)),
        (c.leaseOwner.is_(None), literal(State.QUEUED.value)),
        (or_(c.leaseExpires.is_(None), c.leaseExpires <= now), literal(State.EXPIRED.value)),
        (c.leaseOwner == YIELD_OWNER, literal(State.YIELDED.value)),
        (
            _waiting_to_retry(),
            literal(State.RETRY_WAIT.value),
        ),
        else_=literal(State.LEASED.value),
    )


def count_active_by_class_and_state(now: int) -> Select:
    """Active rows per (class, state), with the oldest creation time of each group."""
    state = state_case(now).label("state")
    return select(active.c.taskClass, state, func.count(), func.min(active.c.dateCreated)).group_by(
        active.c.taskClass, state
    )


def count_archived_by_class_and_result(since: int) -> Select:
    """Archived rows per (class, result) modified since ``since`` (the ``key_modified`` index)."""
    return (
        select(archive.c.taskClass, archive.c.result, func.count())
        .where(archive.c.dateModified >= since)
        .group_by(archive.c.taskClass, archive.c.result)
    )


def server_time() -> Select:
    return select(db_now())
