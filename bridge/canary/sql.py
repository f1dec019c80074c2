"""Every statement the canary runs: Phorge's config table (the weights and the state) and
the archive rows the guard and ``canary report`` judge.

Each builder says which Phorge code it reproduces. The config table is addressed by
:func:`bridge.queue.schema.config_entry_in` (``{namespace}_config.config_entry``, or the
worker database's own copy on SQLite). No ``config_transaction`` row is ever written:
phd's overseer restarts the daemons when one appears, and a rollback must not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Insert,
    Select,
    Table,
    Update,
    and_,
    func,
    insert,
    literal,
    or_,
    select,
    update,
)

from bridge.queue.dialect import db_now, owner_label
from bridge.queue.model import YIELD_OWNER
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_archivetask as archive

# PhabricatorConfigEntry::loadConfigEntry() and PhabricatorConfigDatabaseSource read
# the options of this namespace only.
NAMESPACE = "default"
MINUTE = 60  # seconds a bucket of the guard's long window sums


def read_options(table: Table, keys: tuple[str, ...]) -> Select[Any]:
    """The live values of the options ``keys``: PhabricatorConfigDatabaseSource::
    loadConfig() (``namespace = 'default' AND isDeleted = 0``), narrowed to ``keys``."""
    return select(table.c.configKey, table.c.value).where(
        table.c.namespace == NAMESPACE,
        table.c.configKey.in_(keys),
        table.c.isDeleted == 0,
    )


def lock_option(table: Table, key: str) -> Select[Any]:
    """The option's row, deleted or not, locked until commit:
    PhabricatorConfigEntry::loadConfigEntry() (``configKey = %s AND namespace = %s``),
    FOR UPDATE so that two writers of the state take turns."""
    return (
        select(table.c.id, table.c.value, table.c.isDeleted)
        .where(table.c.configKey == key, table.c.namespace == NAMESPACE)
        .with_for_update()
    )


def insert_option(table: Table, key: str, value_json: str, phid: str) -> Insert:
    """A new option row, as PhabricatorConfigEntry::save() inserts one after
    loadConfigEntry() found none: a fresh ``PHID-CONF-`` phid (CONFIG_AUX_PHID), the
    ``default`` namespace, not deleted, the value JSON (SERIALIZATION_JSON), both dates
    now (Lisk's CONFIG_TIMESTAMPS)."""
    return insert(table).values(
        phid=phid,
        namespace=NAMESPACE,
        configKey=key,
        value=value_json,
        isDeleted=0,
        dateCreated=db_now(),
        dateModified=db_now(),
    )


def update_option(table: Table, row_id: int, value_json: str) -> Update:
    """PhabricatorConfigEntry::save() of a row loadConfigEntry() found (the editor's
    TYPE_EDIT: ``isDeleted`` 0, the new value), ``dateModified`` now."""
    return (
        update(table)
        .where(table.c.id == row_id)
        .values(value=value_json, isDeleted=0, dateModified=db_now())
    )


def failed_in_window(task_classes: Sequence[str], since: int) -> Select[Any]:
    """The active rows of ``task_classes`` whose last failure came at ``since`` or later
    (``key_failuretime``): a fallback waiting for the old side (a failure time with no
    failure counted, which only a fallback leaves), or a temporary failure waiting for
    its retry (``failureCount`` failures so far, by the side its owner names). Each row
    says its class and failure time: one statement serves windows of several classes
    and starts."""
    return select(
        active.c.taskClass, active.c.failureTime, active.c.leaseOwner, active.c.failureCount
    ).where(
        active.c.failureTime >= since,
        active.c.taskClass.in_(task_classes),
    )


def archived_runs(
    task_classes: Sequence[str],
    since: int,
    limit: int,
    before: tuple[int, int] | None = None,
) -> Select[Any]:
    """The archive rows of ``task_classes`` archived at ``since`` or later
    (``dateModified``, which archiveTask() sets, through the archive's ``key_modified``
    index), newest first, ``limit`` at a time; ``before``: the (dateModified, id) a
    previous page ended at. All the classes in one statement: the index has no class, so
    a statement per class would read every class's rows of the span again."""
    where = [
        archive.c.dateModified >= since,
        archive.c.taskClass.in_(task_classes),
    ]
    if before is not None:
        modified, task_id = before
        where.append(
            or_(
                archive.c.dateModified < modified,
                and_(archive.c.dateModified == modified, archive.c.id < task_id),
            )
        )
    return (
        select(
            archive.c.id,
            archive.c.taskClass,
            archive.c.leaseOwner,
            archive.c.failureCount,
            archive.c.result,
            archive.c.duration,
            archive.c.dateModified,
        )
        .where(*where)
        .order_by(archive.c.dateModified.desc(), archive.c.id.desc())
        .limit(limit)
    )


def minute_runs(task_classes: Sequence[str], after: int, upto: int) -> Select[Any]:
    """The archive rows of ``task_classes`` archived after ``after`` and at or before
    ``upto`` (``dateModified``, through ``key_modified``), summed per class, minute, who
    ran them and how they ended: rows and their earlier failures per (class, minute,
    label, result), so that a day of runs is counted by the server, not read row by
    row, and several classes' rows in one pass."""
    minute = archive.c.dateModified // MINUTE
    label = owner_label(archive.c.leaseOwner)
    grouped = [minute, label, archive.c.result]
    task_class: ColumnElement[Any] = archive.c.taskClass
    if len(task_classes) > 1:
        grouped.insert(0, task_class)
    else:  # one class (the report's day) needs no longer key in the server's grouping
        task_class = literal(task_classes[0])
    return (
        select(
            task_class.label("taskClass"),
            minute.label("minute"),
            label.label("label"),
            archive.c.result,
            func.count().label("rows"),
            func.coalesce(func.sum(archive.c.failureCount), 0).label("failures"),
        )
        .where(
            archive.c.dateModified > after,
            archive.c.dateModified <= upto,
            archive.c.taskClass.in_(task_classes),
        )
        .group_by(*grouped)
    )


def archived_since(task_class: str, seconds: int) -> Select[Any]:
    """Whether any row of ``task_class`` was archived in the last ``seconds`` (the CLI's
    check that a class it is told about exists)."""
    return (
        select(literal(1))
        .where(
            archive.c.dateModified >= db_now() - seconds,
            archive.c.taskClass == task_class,
        )
        .limit(1)
    )


def queued(task_class: str) -> Select[Any]:
    """Whether any row of ``task_class`` is in the active table (its ``taskClass`` index)."""
    return select(literal(1)).where(active.c.taskClass == task_class).limit(1)


def server_time() -> Select[Any]:
    return select(db_now())


def yielding(task_classes: Sequence[str], created_before: int) -> Select[Any]:
    """The yielded active rows of ``task_classes`` created before ``created_before``
    (owner ``(yield)``, through ``key_owner``): a task still yielding that long is in a
    yield loop on its side, which its id and failure time tell (``Canary.takes``)."""
    return select(
        active.c.id, active.c.taskClass, active.c.failureTime, active.c.dateCreated
    ).where(
        active.c.leaseOwner == YIELD_OWNER,
        active.c.taskClass.in_(task_classes),
        active.c.dateCreated < created_before,
    )
