"""Handlers that run several tasks in one call (``BatchHandler.batch_limit``): the engine
hands them runs of a message's tasks, checked first, and writes each outcome fenced by
its own lease."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bridge.assembly import build_runtime
from bridge.config import load_settings
from bridge.engine.batch import Batch
from bridge.engine.context import Runtime
from bridge.handlers.api import Handler, PermanentFailure, TaskContext, TemporaryFailure, Yield
from bridge.handlers.capabilities import BatchHandler
from bridge.queue import Outcome
from bridge.queue.model import Leased

CLASS = "BridgeBatchedWorker"


class Batched(BatchHandler):
    """Ends each task as its data says; remembers the ids of every call."""

    task_classes = (CLASS,)
    batch_limit = 3

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def run(self, task: TaskContext) -> None:  # a call of one task
        ended = self.run_batch([task])[0]
        if ended is not None:
            raise ended

    def run_batch(self, tasks: Sequence[TaskContext]) -> list[Exception | None]:
        self.calls.append([t.id for t in tasks])
        ends = {
            "ok": None,
            "fail": TemporaryFailure("PHP said no", delay=30),
            "yield": Yield(delay=60),
            "permanent": PermanentFailure("never"),
        }
        return [ends[t.data["end"]] for t in tasks]


def runtime_with(tmp_path: Path, handler: Handler) -> Runtime:
    rt = build_runtime(load_settings({"BRIDGE_DATABASE_URL": f"sqlite:///{tmp_path}/q.db"}))
    rt.registry.native[CLASS] = handler
    rt.registry._served.clear()
    return rt


def leased(rt: Runtime, ends: list[str]) -> tuple[str, list[Leased]]:
    ids = [rt.queue.enqueue(CLASS, {"end": end}) for end in ends]
    tasks = {t.id: t for t in rt.queue.lease(len(ids), 600, ids=ids)}
    owners = {t.lease_owner for t in tasks.values()}
    assert len(owners) == 1, owners
    items = [Leased(i, tasks[i].failure_count, CLASS) for i in ids]
    return owners.pop() or "", items


def test_a_message_runs_in_calls_of_batch_limit_and_each_outcome_is_its_own(tmp_path: Path):
    handler = Batched()
    rt = runtime_with(tmp_path, handler)
    ends = ["ok", "fail", "yield", "permanent", "ok", "ok", "fail"]
    owner, items = leased(rt, ends)
    batch = Batch(rt, owner, None)
    assert batch.run(items) == []
    ids = [item.id for item in items]
    assert handler.calls == [ids[0:3], ids[3:6], ids[6:7]]
    assert [ran.outcome for _, ran, _ in batch.reports] == [
        Outcome.SUCCESS,
        Outcome.FAILURE,
        Outcome.YIELD,
        Outcome.PERMANENT_FAILURE,
        Outcome.SUCCESS,
        Outcome.SUCCESS,
        Outcome.FAILURE,
    ]
    rows = {i: rt.queue.get(i) for i in ids}
    assert [rows[i].archived for i in ids] == [True, False, False, True, True, True, False]
    # As Phorge writes them: due again when the lease the outcome set runs out.
    failed, yielded = rows[ids[1]], rows[ids[2]]
    assert failed.failure_count == 1
    assert failed.lease_expires - failed.server_time in range(29, 32)
    assert yielded.failure_count == 0
    assert yielded.lease_expires - yielded.server_time in range(59, 62)


def test_a_task_whose_lease_is_gone_is_left_out_of_the_call(tmp_path: Path):
    handler = Batched()
    rt = runtime_with(tmp_path, handler)
    owner, items = leased(rt, ["ok", "ok", "ok"])
    rt.queue.free_own([items[1].id], owner)  # another owner's now, or nobody's
    batch = Batch(rt, owner, None)
    batch.run(items)
    assert handler.calls == [[items[0].id, items[2].id]]
    assert [ran.outcome for _, ran, _ in batch.reports] == [
        Outcome.LEASE_LOST,
        Outcome.SUCCESS,
        Outcome.SUCCESS,
    ]
    assert rt.queue.get(items[1].id).archived is False


def test_other_classes_break_the_run_and_go_one_at_a_time(tmp_path: Path):
    handler = Batched()
    rt = runtime_with(tmp_path, handler)
    owner, items = leased(rt, ["ok", "ok"])
    other = rt.queue.enqueue("PhabricatorTestWorker", {})
    [task] = rt.queue.lease(1, 600, ids=[other])
    # One owner per message: give the native task this message's lease.
    rt.queue.free_own([other], task.lease_owner or "")
    [task] = rt.queue.lease(1, 600, ids=[other])
    batch = Batch(rt, task.lease_owner or "", None)
    mixed = [Leased(other, 0, "PhabricatorTestWorker")]
    assert batch.run(mixed) == []
    assert handler.calls == []
    assert batch.reports[0][1].outcome is Outcome.SUCCESS
    batch = Batch(rt, owner, None)
    batch.run(items)
    assert handler.calls == [[items[0].id, items[1].id]]
