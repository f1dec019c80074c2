"""The engine's side of the canary (issue 28), on SQLite: the poll leases only the
bridge's share of a class, a worker runs a native class natively only for the new side's
share (else on PHP) and hands back a row that became phd's, a new side's failure falls
back instead of counting, and every archive row names who ran it."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from canary import new_side, roll_back, set_weights
from prometheus_client import REGISTRY
from sqlalchemy import literal, select, update
from sqlalchemy.dialects import mysql

from bridge.assembly import check_canary
from bridge.canary.weights import FALLBACK, LABEL_ROOM, SCALE, bucket, canary_of
from bridge.config import load_settings
from bridge.engine.batch import Batch, run_task
from bridge.engine.context import FixedCanary, Runtime, open_runtime
from bridge.engine.poll import poll_once
from bridge.engine.reports import RunReport
from bridge.engine.sides import PHD_SHARE, archive_owner
from bridge.errors import ConfigError
from bridge.handlers.api import (
    HandBack,
    Handler,
    PermanentFailure,
    TaskContext,
    TemporaryFailure,
    Yield,
)
from bridge.handlers.availability import Availability
from bridge.handlers.capabilities import BatchHandler, TransportHandler
from bridge.handlers.outcome import HandlerResult
from bridge.handlers.registry import Registry
from bridge.metrics import RunMetrics
from bridge.queue import Lease, NewTask, Outcome
from bridge.queue import statements as sql
from bridge.queue.dialect import celery_bucket, make_engine
from bridge.queue.implementations import CELERY, CONDUIT, PYTHON, RUNNER
from bridge.queue.model import (
    LABEL_ROOM as QUEUE_LABEL_ROOM,
)
from bridge.queue.model import (
    MAX_NAME,
    Leased,
    label_of,
    lease_epoch,
    new_owner,
)
from bridge.queue.schema import config_entry
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_archivetask as archive
from bridge.queue.session import fell_back, handed_back

CLASS = "CanaryWorker"  # a class with a native handler here, and a PHP path
OTHER = "OtherWorker"  # a class no canary names: the bridge's wholly


class Native(Handler):
    """The new side: records its runs; fails the tasks of ``failing`` as ``how``."""

    task_classes = (CLASS, OTHER)
    phorge_defaults = True

    def __init__(self, failing: Sequence[int] = (), how: type[Exception] = TemporaryFailure):
        self.ran: list[int] = []
        self.failing, self.how = set(failing), how

    def run(self, task: TaskContext) -> None:
        self.ran.append(task.id)
        if task.id in self.failing:
            raise self.how("the native handler broke")
        if isinstance(task.data, dict) and task.data.get("followup"):
            task.queue_task(OTHER, {})


class Runner(TransportHandler):
    """The old side, as the PHP runner would be: records its runs."""

    implementation = RUNNER
    phorge_defaults = True

    def __init__(self) -> None:
        self.ran: list[int] = []

    def run(self, task: TaskContext) -> None:
        self.ran.append(task.id)
        if isinstance(task.data, dict) and task.data.get("php") == "permanent":
            raise PermanentFailure("PHP said never")


class Proxy(BatchHandler):
    """The old side as Conduit's proxy would be: several tasks a call."""

    implementation = CONDUIT
    phorge_defaults = True
    batch_limit = 8

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def run(self, task: TaskContext) -> None:
        self.run_batch([task])

    def run_batch(self, tasks: Sequence[TaskContext]) -> list[Exception | None]:
        self.calls.append([t.id for t in tasks])
        return [None] * len(tasks)


def settings_for(tmp_path: Path, **extra: str) -> Any:
    return load_settings(
        {
            "BRIDGE_DATABASE_URL": f"sqlite:///{tmp_path}/q.db",
            "BRIDGE_DISPATCH_AHEAD": "off",
            "BRIDGE_MAX_INFLIGHT": "5000",
            "BRIDGE_CANARY_REFRESH": "0.001",
            **{f"BRIDGE_{k}": v for k, v in extra.items()},
        }
    )


def runtime(tmp_path: Path, native: Handler | None = None, **php: Handler) -> Runtime:
    """A runtime on a fresh SQLite file whose canary is read from its config_entry; the
    old side is ``php``'s ``runner=`` and/or ``fallback=`` (none: no PHP path)."""
    registry = Registry([native or Native()], runner_classes=(CLASS, OTHER), **php)
    return open_runtime(settings_for(tmp_path), registry)


def lease_all(rt: Runtime, ids: list[int]) -> str:
    """Lease ``ids`` under one owner (a message's); returns it."""
    [owner] = {t.lease_owner for t in rt.queue.lease(len(ids), 600, ids=ids)}
    assert owner is not None
    return owner


def run_each(rt: Runtime, owner: str, ids: list[int]) -> dict[int, RunReport]:
    """Run each of ``ids`` as its own message would, under ``owner``'s lease."""
    counts = {i: r.failureCount for i, r in active_rows(rt, ids).items()}
    return {i: run_task(rt, Lease(i, owner, counts[i]), task_class=CLASS) for i in ids}


def set_failed(rt: Runtime, ids: list[int], count: int = 0) -> None:
    """Give ``ids`` a failureTime (an earlier failure, or a fallback when count is 0)."""
    with rt.queue.engine.begin() as conn:
        conn.execute(
            update(active).where(active.c.id.in_(ids)).values(failureTime=1, failureCount=count)
        )


def archived(rt: Runtime, ids: list[int]) -> dict[int, Any]:
    with rt.queue.engine.connect() as conn:
        rows = conn.execute(select(archive).where(archive.c.id.in_(ids)))
        return {row.id: row for row in rows}


def active_rows(rt: Runtime, ids: list[int]) -> dict[int, Any]:
    with rt.queue.engine.connect() as conn:
        return {r.id: r for r in conn.execute(select(active).where(active.c.id.in_(ids)))}


# -- the poll: the bridge's share of a class ---------------------------------------------


class Sent:
    def __init__(self) -> None:
        self.ids: list[int] = []

    def __call__(self, owner, tasks, queue, size, repoll_at=None) -> int:
        self.ids += [t.id for t in tasks]
        return len(tasks)


@pytest.mark.parametrize("percent", [0, 50, 100])
def test_the_poll_leases_the_rows_whose_bucket_is_below_the_weight_and_none_that_failed(
    tmp_path: Path, percent: int
):
    rt = runtime(tmp_path)
    ids = rt.queue.enqueue_many([NewTask(CLASS, {})] * 1000)
    others = rt.queue.enqueue_many([NewTask(OTHER, {})] * 20)
    failed = ids[::10]  # failed or fell back once: phd's for good, at any weight below 100
    set_failed(rt, failed)
    set_weights(rt.queue.engine, {CLASS: {"celery": percent}})
    sent = Sent()
    poll_once(rt, sent)
    never_failed = [i for i in ids if i not in failed]
    expected = {0: set(), 50: new_side(CELERY, 50, never_failed), 100: set(ids)}[percent]
    assert set(sent.ids) - set(others) == expected
    assert set(others) <= set(sent.ids), "a class no canary names is the bridge's wholly"
    if percent == 50:
        assert 400 < len(expected) < 500  # about half of the 900 that never failed


def test_with_the_canary_off_the_weights_are_never_read(tmp_path: Path):
    registry = Registry([Native()], runner_classes=(CLASS, OTHER))
    rt = open_runtime(settings_for(tmp_path, CANARY="false"), registry)
    assert rt.canary == FixedCanary()
    ids = rt.queue.enqueue_many([NewTask(CLASS, {})] * 10)
    set_weights(rt.queue.engine, {CLASS: {"celery": 0}})
    sent = Sent()
    poll_once(rt, sent)
    assert sorted(sent.ids) == ids


def test_the_share_is_read_through_the_lease_filter_in_both_phases(tmp_path: Path):
    """The expired phase takes the share too: a lost dispatch of the bridge's row comes
    back to the bridge, phd's rows whose daemon died are not taken."""
    rt = runtime(tmp_path)
    ids = rt.queue.enqueue_many([NewTask(CLASS, {})] * 200)
    with rt.queue.engine.begin() as conn:  # every row leased by someone, expired
        conn.execute(update(active).values(leaseOwner="1:2:host:3", leaseExpires=1))
    owner, leased = rt.queue.lease_to_send(
        1000, "bridge", 60, [CLASS, OTHER], 8192, shares={CLASS: 2500}
    )
    assert {t.id for t in leased} == new_side(CELERY, 25, ids)
    assert owner.startswith("bridge:")


def test_without_a_shared_class_the_lease_statements_are_todays():
    """No cost when no class is shared: the same SQL, index hints and all."""
    where = sql.LeaseFilter(["A", "B", "C"], small_classes=frozenset({"B"}))
    for select_phase, golden in ((sql.select_unleased, UNLEASED), (sql.select_expired, EXPIRED)):
        assert compiled(select_phase(16, where)) == golden
        unshared = sql.LeaseFilter(where.classes, small_classes=where.small_classes, shares={})
        assert compiled(select_phase(16, unshared)) == golden
        other = sql.LeaseFilter(where.classes, small_classes=where.small_classes, shares={"Z": 5})
        assert compiled(select_phase(16, other)) == golden, "a share of a class not leased"


def test_a_shared_class_keeps_its_index_hint_and_adds_the_bucket():
    where = sql.LeaseFilter(["A", "B", "C"], small_classes=frozenset({"B"}), shares={"B": 5000})
    text = compiled(sql.select_unleased(16, where))
    assert "FORCE INDEX (taskClass)" in text and "FORCE INDEX (key_owner)" in text
    assert text.count("MOD(CRC32(CONCAT('celery:', worker_activetask.id)), 10000) < %s") == 1
    assert text.count("`failureTime` IS NULL") == 1
    shared_large = sql.LeaseFilter(["A", "C"], shares={"C": 100})
    text = compiled(sql.select_expired(16, shared_large))
    assert "FORCE INDEX (leaseExpires)" in text
    assert (
        "(worker_activetask.`taskClass` IN (__[POSTCOMPILE_taskClass_1]) OR "
        "worker_activetask.`taskClass` IN (__[POSTCOMPILE_taskClass_2]) AND "
        "worker_activetask.`failureTime` IS NULL AND "
        "MOD(CRC32(CONCAT('celery:', worker_activetask.id)), 10000) < %s)"
    ) in text


def compiled(statement: Any) -> str:
    return str(statement.compile(dialect=mysql.dialect())).replace("\n", " ")


# The statements as they were before issue 28 (MySQL's rendering), byte for byte.
_UNLEASED_PART = (
    "(SELECT worker_activetask.id AS id, worker_activetask.priority AS priority  "
    "FROM worker_activetask FORCE INDEX ({index})  WHERE worker_activetask.`leaseOwner` "
    "IS NULL AND (worker_activetask.`leaseExpires` IS NULL OR worker_activetask.`leaseExpires`"
    " <= UNIX_TIMESTAMP()) AND worker_activetask.`taskClass` IN (__[POSTCOMPILE_taskClass_{n}])"
    " ORDER BY worker_activetask.priority, worker_activetask.id   LIMIT %s) AS anon_{n}"
)
UNLEASED = (
    "SELECT candidates.id  FROM (SELECT anon_1.id AS id, anon_1.priority AS priority  FROM "
    + _UNLEASED_PART.format(index="taskClass", n=1)
    + " UNION ALL SELECT anon_2.id AS id, anon_2.priority AS priority  FROM "
    + _UNLEASED_PART.format(index="key_owner", n=2)
    + ") AS candidates ORDER BY candidates.priority, candidates.id   LIMIT %s"
)
_EXPIRED_PART = (
    "(SELECT worker_activetask.id AS id, worker_activetask.`leaseOwner` AS `leaseOwner`, "
    "worker_activetask.`leaseExpires` AS `leaseExpires`  FROM worker_activetask FORCE INDEX "
    "({index})  WHERE worker_activetask.`leaseOwner` IS NOT NULL AND "
    "worker_activetask.`leaseExpires` < UNIX_TIMESTAMP() AND worker_activetask.`taskClass` IN "
    "(__[POSTCOMPILE_taskClass_{n}]) ORDER BY worker_activetask.`leaseExpires`   LIMIT %s) "
    "AS anon_{n}"
)
EXPIRED = (
    "SELECT candidates.id, candidates.`leaseOwner`  FROM (SELECT anon_1.id AS id, "
    "anon_1.`leaseOwner` AS `leaseOwner`, anon_1.`leaseExpires` AS `leaseExpires`  FROM "
    + _EXPIRED_PART.format(index="taskClass", n=1)
    + " UNION ALL SELECT anon_2.id AS id, anon_2.`leaseOwner` AS `leaseOwner`, "
    "anon_2.`leaseExpires` AS `leaseExpires`  FROM "
    + _EXPIRED_PART.format(index="leaseExpires", n=2)
    + ") AS candidates ORDER BY candidates.`leaseExpires`   LIMIT %s"
)


def test_sqlites_bucket_is_pythons(tmp_path: Path):
    engine = make_engine(f"sqlite:///{tmp_path}/b.db")
    ids = [*range(1, 300), 2**31, 4_000_000_000]
    with engine.connect() as conn:
        buckets = {n: conn.execute(select(celery_bucket(literal(n)))).scalar_one() for n in ids}
    assert buckets == {n: bucket(CELERY, n) for n in ids}
    engine.dispose()


# -- the worker: native or PHP by the hash; phd's share handed back ----------------------


def test_a_native_class_at_50_runs_natively_by_the_hash_and_on_php_otherwise(tmp_path: Path):
    native, runner = Native(), Runner()
    rt = runtime(tmp_path, native, runner=runner)
    set_weights(rt.queue.engine, {CLASS: {"python": 50}})
    ids = rt.queue.enqueue_many([NewTask(CLASS, {})] * 200)
    reports = run_each(rt, lease_all(rt, ids), ids)
    natively = new_side(PYTHON, 50, ids)
    assert set(native.ran) == natively and 70 < len(natively) < 130
    assert set(runner.ran) == set(ids) - natively
    rows = archived(rt, ids)
    assert {i: label_of(rows[i].leaseOwner) for i in ids} == {
        i: "native" if i in natively else "runner" for i in ids
    }
    assert {rows[i].result for i in ids} == {0}
    line = reports[ids[0]].describe(f"{CLASS}#{ids[0]}")
    assert line == f"{CLASS}#{ids[0]} [{label_of(rows[ids[0]].leaseOwner)}]: success"


def test_a_row_that_fell_back_runs_on_php_even_in_the_native_share(tmp_path: Path):
    native, runner = Native(), Runner()
    rt = runtime(tmp_path, native, runner=runner)
    set_weights(rt.queue.engine, {CLASS: {"python": 100 - 0.01}})
    ids = rt.queue.enqueue_many([NewTask(CLASS, {})] * 20)
    set_failed(rt, ids[:10])  # fell back: failureTime, no failure counted
    set_failed(rt, ids[10:15], count=2)  # failed on PHP before
    run_each(rt, lease_all(rt, ids), ids)
    assert set(runner.ran) == set(ids[:15])
    labels = {i: label_of(row.leaseOwner) for i, row in archived(rt, ids).items()}
    assert {labels[i] for i in ids[:10]} == {"runner" + FALLBACK}
    assert {labels[i] for i in ids[10:15]} == {"runner"}
    assert {labels[i] for i in ids[15:]} == {"native"}


def test_a_rolled_back_native_class_runs_wholly_on_php(tmp_path: Path):
    native, runner = Native(), Runner()
    rt = runtime(tmp_path, native, runner=runner)
    set_weights(rt.queue.engine, {CLASS: {"ramp": {"level": "python", "steps": [50, 100]}}})
    roll_back(rt.queue.engine, CLASS, PYTHON)
    ids = rt.queue.enqueue_many([NewTask(CLASS, {})] * 30)
    run_each(rt, lease_all(rt, ids), ids)
    assert native.ran == [] and sorted(runner.ran) == ids


@pytest.mark.parametrize("how", ["weight 0", "rolled back", "outside the share"])
def test_a_row_no_longer_the_bridges_is_handed_back_to_phd(tmp_path: Path, how: str):
    native = Native()
    rt = runtime(tmp_path, native)
    ids = rt.queue.enqueue_many([NewTask(CLASS, {})] * 40)
    owner = lease_all(rt, ids)  # sent before the weights changed
    if how == "weight 0":
        set_weights(rt.queue.engine, {"*": {"celery": 0}})
    elif how == "rolled back":
        set_weights(rt.queue.engine, {CLASS: {"celery": 50}})
        roll_back(rt.queue.engine, CLASS, CELERY)
    else:
        set_weights(rt.queue.engine, {CLASS: {"celery": 50}})
    reports = run_each(rt, owner, ids)
    kept = new_side(CELERY, 50, ids) if how == "outside the share" else set()
    assert set(native.ran) == kept
    back = [i for i in ids if i not in kept]
    assert {reports[i].outcome for i in back} == {Outcome.HANDED_BACK}
    assert {reports[i].reason for i in back} == {PHD_SHARE}
    assert reports[back[0]].describe("X#1") == "X#1: handed-back: canary: phd's share"
    rows = active_rows(rt, back)
    assert {
        (r.leaseOwner, r.leaseExpires, r.failureCount, r.failureTime) for r in rows.values()
    } == {(None, None, 0, None)}


# -- the fallback: a new side's failure goes to the old side, uncounted ------------------


@pytest.mark.parametrize("how", [TemporaryFailure, PermanentFailure])
def test_a_failed_native_run_falls_back_and_php_runs_it(
    tmp_path: Path, how: type[Exception], caplog: pytest.LogCaptureFixture
):
    native, runner = Native(how=how), Runner()
    rt = runtime(tmp_path, native, runner=runner)
    set_weights(rt.queue.engine, {CLASS: {"python": 50}})
    ids = rt.queue.enqueue_many([NewTask(CLASS, {})] * 20)
    ids_native = new_side(PYTHON, 50, ids)
    native.failing = ids_native
    owner = lease_all(rt, ids)
    with caplog.at_level(logging.INFO, logger="bridge.engine.batch"):
        reports = run_each(rt, owner, ids)
    assert {reports[i].outcome for i in ids_native} == {Outcome.FALLBACK}
    reason = "the native handler broke; runner takes it"
    assert {reports[i].reason for i in ids_native} == {reason}
    first = min(ids_native)
    line = f"{CLASS}#{first} [native]: fallback: {reason}"
    # (A worker's line ends with its task tag: ``[task=... class=...]``.)
    [record] = [r for r in caplog.records if r.getMessage().startswith(line)]
    assert record.levelno == logging.WARNING
    rows = active_rows(rt, sorted(ids_native))
    assert len(rows) == len(ids_native), "never archived as failed"
    for row in rows.values():
        assert (row.leaseOwner, row.leaseExpires, row.failureCount) == (None, None, 0)
        assert row.failureTime is not None and row.dateModified >= row.dateCreated
    # Due at once, for the old side: the next lease runs it on PHP, labelled so.
    run_each(rt, lease_all(rt, sorted(ids_native)), sorted(ids_native))
    assert set(runner.ran) == set(ids)
    rows = archived(rt, ids)
    assert {rows[i].result for i in ids} == {0}
    assert {label_of(rows[i].leaseOwner) for i in ids_native} == {"runner-fallback"}
    assert {rows[i].failureCount for i in ids} == {0}


def test_a_bridge_run_of_a_shared_class_falls_back_to_phd(tmp_path: Path):
    native = Native()
    rt = runtime(tmp_path, native)
    set_weights(rt.queue.engine, {CLASS: {"celery": 50}})
    ids = rt.queue.enqueue_many([NewTask(CLASS, {})] * 40)
    ours = sorted(new_side(CELERY, 50, ids))
    native.failing = set(ours[:3])
    reports = run_each(rt, lease_all(rt, ours), ours)
    assert {reports[i].outcome for i in ours[:3]} == {Outcome.FALLBACK}
    assert reports[ours[0]].reason == "the native handler broke; phd takes it"
    assert {reports[i].outcome for i in ours[3:]} == {Outcome.SUCCESS}
    sent = Sent()
    poll_once(rt, sent)
    assert set(sent.ids) & set(ours[:3]) == set(), "phd's now: the poll leaves it"


def test_an_old_side_failure_is_an_ordinary_failure(tmp_path: Path):
    """Only the new side falls back: a failure of the old side counts, as Phorge counts it."""
    native = Native()
    rt = runtime(tmp_path, native)
    set_weights(rt.queue.engine, {CLASS: {"python": 50}})  # native here has no PHP path…
    ids = rt.queue.enqueue_many([NewTask(OTHER, {})] * 3)  # …and OTHER is not shared
    native.failing = set(ids)
    reports = {i: run_task(rt, Lease(i, lease_all(rt, [i]), 0), task_class=OTHER) for i in ids}
    assert {r.outcome for r in reports.values()} == {Outcome.FAILURE}


def test_the_fallback_write_is_fenced_and_tells_its_lost_commit_apart(tmp_path: Path):
    rt = runtime(tmp_path)
    session = rt.queue.session
    [first, second] = rt.queue.enqueue_many([NewTask(CLASS, {})] * 2)
    owner = lease_all(rt, [first, second])
    assert session.apply([fell_back(Lease(first, "bridge:someone-else", 0))]) == [False]
    assert session.apply([fell_back(Lease(first, owner, 1))]) == [False], "fenced on the count"
    assert active_rows(rt, [first])[first].leaseOwner == owner, "nothing written"
    assert session.apply([fell_back(Lease(first, owner, 0))]) == [True]
    assert session.written(fell_back(Lease(first, owner, 0))) is True
    # A hand-back leaves no failureTime: it is not taken for a fallback's lost commit.
    assert session.apply([handed_back(Lease(second, owner, 0))]) == [True]
    assert session.written(fell_back(Lease(second, owner, 0))) is False
    row = active_rows(rt, [first])[first]
    assert (row.leaseOwner, row.leaseExpires, row.failureCount) == (None, None, 0)
    assert row.failureTime is not None


# -- the archive names who ran it ---------------------------------------------------------


def test_every_archive_row_names_its_implementation(tmp_path: Path):
    native, runner = Native(), Runner()
    rt = runtime(tmp_path, native, runner=runner)
    set_weights(rt.queue.engine, {CLASS: {"python": 50}})
    ids = rt.queue.enqueue_many(
        [NewTask(CLASS, {"followup": True}), NewTask(CLASS, {"php": "permanent"})] * 10
    )
    plain = rt.queue.enqueue(OTHER, {})  # no canary: labelled all the same
    owner = lease_all(rt, [*ids, plain])
    run_each(rt, owner, ids)
    run_task(rt, Lease(plain, owner, 0), task_class=OTHER)
    rows = archived(rt, [*ids, plain])
    assert sorted(rows) == sorted([*ids, plain])
    for task_id, row in rows.items():
        label = "native" if task_id == plain or task_id in native.ran else "runner"
        if task_id in native.ran and task_id in ids[0::2]:
            label += "~1"  # and the follow-up it queued
        assert row.leaseOwner == archive_owner(owner, label)
        assert len(row.leaseOwner) <= MAX_NAME
        assert lease_epoch(row.leaseOwner) == lease_epoch(owner), "the epoch stays in place"
    php_refused = [i for i in ids[1::2] if i in runner.ran]
    assert php_refused and {rows[i].result for i in php_refused} == {1}, "PHP's own failures"
    assert len(rt.queue.list()) > len(rows), "the follow-ups were queued with their parents"


def test_owners_keep_room_for_the_longest_label(monkeypatch: pytest.MonkeyPatch):
    assert QUEUE_LABEL_ROOM == LABEL_ROOM
    monkeypatch.setattr("socket.gethostname", lambda: "h" * 80)
    owner = new_owner("bridge", 1_700_000_000)
    assert len(owner) == MAX_NAME - LABEL_ROOM
    labelled = archive_owner(owner, "conduit-fallback~99")
    assert labelled is not None and len(labelled) == MAX_NAME
    assert label_of(labelled) == "conduit-fallback~99" and lease_epoch(labelled) == 1_700_000_000
    # An owner minted without room (an older bridge's): its host is cut, the rest kept.
    old = "bridge:4242:1700000000:" + "h" * 38 + ":17"
    assert len(old) == MAX_NAME
    cut = archive_owner(old, "native")
    assert cut is not None and len(cut) == MAX_NAME and cut.endswith(":17")
    assert archive_owner("bridge:1:2:h:3", None) is None


# -- batches: grouped by the handler each task actually gets -------------------------------


def test_a_batch_groups_by_the_handler_chosen_for_each_task(tmp_path: Path):
    native, proxy = Native(), Proxy()
    rt = runtime(tmp_path, native, fallback=proxy)
    set_weights(rt.queue.engine, {CLASS: {"python": 50}})
    ids = rt.queue.enqueue_many([NewTask(CLASS, {})] * 24)
    fell = [i for i in ids if i in new_side(PYTHON, 50, ids)][:2]
    set_failed(rt, fell)  # predicted native, but PHP's once checked
    owner = lease_all(rt, ids)
    batch = Batch(rt, owner, None)
    assert batch.run([Leased(i, 0, CLASS) for i in ids]) == []
    assert {r.outcome for _, r, _ in batch.reports} == {Outcome.SUCCESS}
    natively = new_side(PYTHON, 50, ids) - set(fell)
    assert set(native.ran) == natively
    proxied = [i for call in proxy.calls for i in call]
    assert sorted(proxied) == sorted(set(ids) - natively)
    for call in proxy.calls:  # consecutive tasks of the proxy, at most its limit a call
        assert len(call) <= proxy.batch_limit
        assert not natively & set(range(call[0], call[-1] + 1))
    assert any(len(call) > 1 for call in proxy.calls)


# -- at start: a weight the worker cannot honour -------------------------------------------


@pytest.mark.parametrize(
    "weights",
    [
        {CLASS: {"python": 20}},
        {"*": {"python": 0}},
        {CLASS: {"ramp": {"level": "python", "steps": [5, 100]}}},
    ],
)
def test_a_native_weight_without_a_php_path_stops_the_worker_at_start(tmp_path: Path, weights):
    rt = runtime(tmp_path)  # a native handler, no runner, no Conduit
    set_weights(rt.queue.engine, weights)
    with pytest.raises(ConfigError) as refused:
        check_canary(rt)
    assert str(refused.value).startswith("phorge-bridge.canary: ")
    assert CLASS in str(refused.value)


def test_weights_the_worker_can_honour_pass_the_start_check(tmp_path: Path):
    rt = runtime(tmp_path, runner=Runner())
    set_weights(rt.queue.engine, {CLASS: {"python": 20}, OTHER: {"celery": 5}})
    assert check_canary(rt).weight(CLASS, PYTHON) == 2000
    with rt.queue.engine.begin() as conn:  # set by hand, past the bridge's own check
        conn.execute(update(config_entry).values(value='{"CanaryWorker": {"python": 200}}'))
    with pytest.raises(ConfigError, match=r"phorge-bridge\.canary: CanaryWorker"):
        check_canary(rt)


# -- metrics and lines ---------------------------------------------------------------------


def test_the_metrics_carry_the_implementation():
    metrics = RunMetrics()
    item = Leased(1, 0, "MetricsCanaryWorker")

    def outcomes(outcome: str, implementation: str) -> float:
        labels = {"task_class": item.task_class, "outcome": outcome}
        value = REGISTRY.get_sample_value(
            "phorge_bridge_outcomes_total", {**labels, "implementation": implementation}
        )
        return value or 0.0

    before = outcomes("success", "runner")
    metrics.run_ended(item, RunReport(Outcome.SUCCESS, implementation="runner-fallback"))
    metrics.run_ended(item, RunReport(Outcome.LEASE_LOST))
    assert outcomes("success", "runner") == before + 1
    assert outcomes("lease-lost", "none") >= 1
    metrics.handler_returned(item.task_class, 0.1, HandlerResult(Outcome.SUCCESS), "native")
    count = REGISTRY.get_sample_value(
        "phorge_bridge_task_duration_seconds_count",
        {"task_class": item.task_class, "implementation": "native"},
    )
    assert count and count >= 1


def test_a_fixed_canary_is_what_a_runtime_built_by_hand_gets(tmp_path: Path):
    rt = Runtime(settings_for(tmp_path), runtime(tmp_path).queue, Registry([Native()]))
    assert rt.canary.current().weights == {}
    shared = canary_of({CLASS: {"celery": 1}}, None)
    rt.canary = FixedCanary(shared)
    assert rt.canary.current().weight(CLASS, CELERY) == SCALE // 100


# -- a new side that cannot finish: its hand-backs and lost leases fall back --------------


def test_a_new_side_run_handed_back_falls_back_and_an_old_side_one_is_handed_back(
    tmp_path: Path,
):
    """A hand-back is the new side failing the row (its transport broke mid-run): the row
    falls back to phd, a failure for the guard, rather than going back to the new side."""
    native = Native(how=HandBack)
    rt = runtime(tmp_path, native)
    set_weights(rt.queue.engine, {CLASS: {"celery": 50}})
    ids = rt.queue.enqueue_many([NewTask(CLASS, {})] * 40)
    ours = sorted(new_side(CELERY, 50, ids))[:2]
    other = rt.queue.enqueue_many([NewTask(OTHER, {})])
    native.failing = {*ours, *other}
    reports = run_each(rt, lease_all(rt, ours), ours)
    assert {r.outcome for r in reports.values()} == {Outcome.FALLBACK}
    assert reports[ours[0]].reason == "the native handler broke; phd takes it"
    [alone] = other
    report = run_task(rt, Lease(alone, lease_all(rt, other), 0), task_class=OTHER)
    assert report.outcome is Outcome.HANDED_BACK, "no canary names it: another worker's"
    rows = active_rows(rt, [*ours, alone])
    assert all(rows[i].failureTime is not None and rows[i].leaseOwner is None for i in ours)
    assert rows[alone].failureTime is None and rows[alone].leaseOwner is None


def test_a_new_side_whose_transport_is_down_here_falls_back_before_it_runs(tmp_path: Path):
    """At the celery level with the PHP path as the new side: a worker whose runner cannot
    boot gives the bridge's rows of a shared class to phd, and runs none."""
    runner = Runner()
    runner.availability = Availability(lambda: "PHP cannot boot")
    runner.availability.failure("PHP cannot boot")
    rt = runtime(tmp_path, runner=runner)
    set_weights(rt.queue.engine, {CLASS: {"celery": 50, "python": 0}})
    ids = rt.queue.enqueue_many([NewTask(CLASS, {})] * 40)
    ours = sorted(new_side(CELERY, 50, ids))[:3]
    reports = run_each(rt, lease_all(rt, ours), ours)
    assert {r.reason for r in reports.values()} == {"held back: PHP cannot boot; phd takes it"}
    assert {r.outcome for r in reports.values()} == {Outcome.FALLBACK}
    assert runner.ran == []


def outlived(rt: Runtime, monkeypatch: pytest.MonkeyPatch, taken: set[int]) -> None:
    """Each run outlives its lease: the keeper finds it lost, the row's expiry passes, and
    the rows of ``taken`` are leased meanwhile by another owner."""

    @contextmanager
    def lost(lease: Lease, *_: Any) -> Iterator[Any]:
        yield SimpleNamespace(lost=True, expires=time.monotonic() + 30)
        with rt.queue.engine.begin() as conn:
            conn.execute(update(active).where(active.c.id == lease.task_id).values(leaseExpires=1))
            if lease.task_id in taken:
                owner = f"phd:1:{int(time.time())}:web:1"
                conn.execute(
                    update(active).where(active.c.id == lease.task_id).values(leaseOwner=owner)
                )

    monkeypatch.setattr(rt.keeper, "watch", lost)


def test_a_new_side_run_that_outlived_its_lease_falls_back_while_its_owner_holds_the_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    native = Native()
    rt = runtime(tmp_path, native)
    set_weights(rt.queue.engine, {CLASS: {"celery": 50}})
    ids = rt.queue.enqueue_many([NewTask(CLASS, {})] * 40)
    mine, taken = sorted(new_side(CELERY, 50, ids))[:2]
    outlived(rt, monkeypatch, {taken})
    reports = run_each(rt, lease_all(rt, [mine, taken]), [mine, taken])
    assert (reports[mine].outcome, reports[mine].reason) == (
        Outcome.FALLBACK,
        "the lease expired while the handler ran; phd takes it",
    )
    assert reports[taken].outcome is Outcome.LEASE_LOST, "its new owner runs it"
    rows = active_rows(rt, [mine, taken])
    assert (rows[mine].leaseOwner, rows[mine].failureCount) == (None, 0)
    assert rows[mine].failureTime is not None
    assert rows[taken].leaseOwner.startswith("phd:") and rows[taken].failureTime is None


def test_an_old_side_run_that_outlived_its_lease_leaves_its_row_to_the_expiry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    rt = runtime(tmp_path)
    [task_id] = rt.queue.enqueue_many([NewTask(OTHER, {})])
    owner = lease_all(rt, [task_id])
    outlived(rt, monkeypatch, set())
    report = run_task(rt, Lease(task_id, owner, 0), task_class=OTHER)
    assert report.outcome is Outcome.LEASE_LOST
    row = active_rows(rt, [task_id])[task_id]
    assert (row.leaseOwner, row.leaseExpires, row.failureTime) == (owner, 1, None)


class Yielding(Native):
    """A new side that yields every task (``Yield(delay=30)``): a yield loop when it never ends."""

    def run(self, task: TaskContext) -> None:
        self.ran.append(task.id)
        raise Yield(delay=30)


def created_ago(rt: Runtime, ids: list[int], seconds: int) -> None:
    with rt.queue.engine.begin() as conn:
        created = int(time.time()) - seconds
        conn.execute(update(active).where(active.c.id.in_(ids)).values(dateCreated=created))


@pytest.mark.parametrize("bound", ["setting", "the class's own"])
def test_a_new_side_yield_of_a_task_past_max_yielding_falls_back_to_the_old_side(
    tmp_path: Path, bound: str
):
    """A yield is Phorge's "not yet", so the new side's yield of a young task is a yield;
    of a task created longer than ``max_yielding`` ago it is a yield loop, and the row
    goes to the old side as any other new-side failure does."""
    rt = runtime(tmp_path, Yielding(), runner=Runner())
    if bound == "setting":
        rt.settings = replace(rt.settings, canary_max_yielding=600)
        set_weights(rt.queue.engine, {CLASS: {"python": 50}})
    else:
        set_weights(rt.queue.engine, {CLASS: {"python": 50, "guard": {"max_yielding": 600}}})
    ids = rt.queue.enqueue_many([NewTask(CLASS, {})] * 40)
    young, old = sorted(new_side(PYTHON, 50, ids))[:2]
    created_ago(rt, [young], 590)
    created_ago(rt, [old], 610)
    reports = run_each(rt, lease_all(rt, [young, old]), [young, old])
    assert reports[young].outcome is Outcome.YIELD
    assert (reports[old].outcome, reports[old].reason) == (
        Outcome.FALLBACK,
        "a yield loop (still yielding 610 s after its creation); runner takes it",
    )
    rows = active_rows(rt, [young, old])
    assert (rows[young].leaseOwner, rows[young].failureTime) == ("(yield)", None)
    assert (rows[old].leaseOwner, rows[old].failureCount) == (None, 0)
    assert rows[old].failureTime is not None, "the old side's now, a fallback for the guard"


class YieldingRunner(Runner):
    def run(self, task: TaskContext) -> None:
        self.ran.append(task.id)
        raise Yield(delay=30)


def test_an_old_side_or_unshared_yield_of_an_old_task_stays_a_yield(tmp_path: Path):
    runner = YieldingRunner()
    rt = runtime(tmp_path, Yielding(), runner=runner)
    set_weights(rt.queue.engine, {CLASS: {"python": 50}})
    ids = rt.queue.enqueue_many([NewTask(CLASS, {})] * 40)
    theirs = sorted(set(ids) - new_side(PYTHON, 50, ids))[0]
    [other] = rt.queue.enqueue_many([NewTask(OTHER, {})])
    created_ago(rt, [theirs, other], 2 * rt.settings.canary_max_yielding)
    assert run_each(rt, lease_all(rt, [theirs]), [theirs])[theirs].outcome is Outcome.YIELD
    assert runner.ran == [theirs], "the old side ran it, and yields as Phorge would"
    report = run_task(rt, Lease(other, lease_all(rt, [other]), 0), task_class=OTHER)
    assert report.outcome is Outcome.YIELD, "no canary names it: a yield as Phorge's"
    rows = active_rows(rt, [theirs, other])
    assert {row.leaseOwner for row in rows.values()} == {"(yield)"}
    assert {row.failureTime for row in rows.values()} == {None}
