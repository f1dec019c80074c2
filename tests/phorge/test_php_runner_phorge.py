"""The PHP runner on a real Phorge (runs only when PHORGE_ROOT is set).

A Maniphest edit with a subscriber queues Phorge's real work (the transaction publish
worker, then search indexing, feed, mail to the subscriber, the feed hook and whatever
else it schedules). One edit is drained by the bridge with the runner, in process, on
Phorge's own worker database, the tasks of each round in one batch as a Celery message
carries them; another by Phorge itself (``bin/worker execute``). Both must leave the
same classes archived with the same results, and the same effects: feed stories, the
search index, the transactions, the mail (voided: no mailer is configured) and the feed
hook's POST to a receiver here. The hook is set with ``bin/config`` for the module and
unset after.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from phorge_env import (
    HELPER_START,
    HookReceiver,
    Phorge,
    hook_receiver,
    phorge_root,
    worker_database_url,
)

from bridge.assembly import build_runtime
from bridge.config import load_settings
from bridge.engine.batch import Batch
from bridge.engine.context import Runtime
from bridge.queue.model import Leased, Outcome
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_archivetask as archive

HELPER = (
    HELPER_START
    + r"""
switch ($command) {
  case 'env':
    // Where Phorge's worker tables are, so the bridge opens the very same database.
    $conn = id(new PhabricatorWorkerActiveTask())->establishConnection('w');
    $out = queryfx_one($conn, 'SELECT DATABASE() AS db');
    foreach (array('host', 'port', 'user', 'pass') as $key) {
      $out[$key] = PhabricatorEnv::getEnvConfig('mysql.'.$key);
    }
    echo json_encode($out);
    break;
  case 'users':
  case 'edit':
    $users = array();
    foreach (array('bridgerunnertest', 'bridgerunnercc') as $name) {
      $user = phorge_bridge_account($viewer, $name);
      $users[] = id(new PhabricatorPeopleQuery())->setViewer($viewer)
        ->withPHIDs(array($user->getPHID()))->needUserSettings(true)->executeOne();
    }
    if ($command === 'users') {
      break;
    }
    list($user, $cc) = $users;
    // As a web or API edit makes it (the edit engine): feed, mail, hooks and all.
    $edit = id(new ConduitCall('maniphest.edit', array(
      'transactions' => array(
        array('type' => 'title', 'value' => $args['title']),
        array('type' => 'description', 'value' => 'Made by the PHP runner test.'),
        array('type' => 'subscribers.add', 'value' => array($cc->getPHID())),
      ),
    )))->setUser($user)->execute();
    $task = id(new ManiphestTaskQuery())->setViewer($viewer)
      ->withPHIDs(array($edit['object']['phid']))->executeOne();
    echo json_encode(array('phid' => $task->getPHID()));
    break;
  case 'effects':
    echo json_encode(phorge_bridge_effects($viewer, $args['phid']));
    break;
  case 'archived':
    // Phorge reads every row the bridge archived.
    $tasks = id(new PhabricatorWorkerArchiveTaskQuery())->withIDs($args['ids'])->execute();
    $seen = array();
    foreach ($tasks as $task) {
      $seen[] = array($task->getTaskClass(), (int)$task->getResult());
    }
    sort($seen);
    echo json_encode($seen);
    break;
}
"""
)


@pytest.fixture(scope="module")
def phorge(tmp_path_factory: pytest.TempPathFactory) -> Phorge:
    return Phorge.with_helper(phorge_root(), tmp_path_factory.mktemp("runner"), HELPER)


@pytest.fixture(scope="module")
def hooks(phorge: Phorge) -> Iterator[HookReceiver]:
    """Phorge's ``feed.http-hooks`` pointed at a receiver here, for this module only."""
    with hook_receiver() as receiver:
        done = phorge.bin("config", "set", "feed.http-hooks", json.dumps([f"{receiver.base}/"]))
        assert done.returncode == 0, done.stdout + done.stderr
        try:
            yield receiver
        finally:
            phorge.bin("config", "delete", "feed.http-hooks")


@pytest.fixture(scope="module")
def rt(phorge: Phorge, hooks: HookReceiver) -> Iterator[Runtime]:
    """The bridge with the runner on this checkout, on the worker database it uses (its
    processes boot after the hook is configured)."""
    url = worker_database_url(phorge.php("env"))
    settings = load_settings(
        {
            "BRIDGE_DATABASE_URL": url,
            "BRIDGE_PHORGE_ROOT": str(phorge.root),
        }
    )
    runtime = build_runtime(settings)
    yield runtime
    assert runtime.registry.runner is not None
    runtime.registry.runner.pool.close()
    runtime.queue.engine.dispose()


def new_ids(rt: Runtime, after: int) -> list[int]:
    with rt.queue.engine.connect() as conn:
        return list(conn.execute(sa.select(active.c.id).where(active.c.id > after)).scalars())


def max_id(rt: Runtime) -> int:
    with rt.queue.engine.connect() as conn:
        ids = [
            conn.execute(sa.select(sa.func.max(t.c.id))).scalar() or 0 for t in (active, archive)
        ]
    return max(ids)


def drain(rt: Runtime, after: int, run: Callable[[list[int]], None]) -> list[int]:
    """Run every task queued after ``after`` (and the follow-ups they queue); their ids."""
    done: list[int] = []
    for _ in range(20):
        ids = new_ids(rt, after)
        if not ids:
            return done
        run(ids)
        done += ids
    pytest.fail(f"tasks still queued after 20 rounds: {new_ids(rt, after)}")


def classes_archived(rt: Runtime, ids: list[int]) -> list[tuple[str, int]]:
    with rt.queue.engine.connect() as conn:
        rows = conn.execute(
            sa.select(archive.c.taskClass, archive.c.result).where(archive.c.id.in_(ids))
        )
        return sorted((row.taskClass, row.result) for row in rows)


def test_a_maniphest_edit_through_the_runner_has_phds_effects(
    phorge: Phorge, rt: Runtime, hooks: HookReceiver
) -> None:
    def through_the_runner(ids: list[int]) -> None:
        leased = rt.queue.lease(len(ids), 600, ids=ids)
        (owner,) = {task.lease_owner for task in leased}
        batch = Batch(rt, owner or "", None)
        batch.run([Leased(t.id, t.failure_count, t.task_class, t.raw_data) for t in leased])
        ended = {ran.outcome for _, ran, _ in batch.reports}
        assert ended <= {Outcome.SUCCESS, Outcome.PERMANENT_FAILURE}, batch.reports

    def through_phorge(ids: list[int]) -> None:
        for task_id in ids:
            phorge.bin("worker", "execute", "--id", str(task_id))

    before = max_id(rt)
    phorge.php("users")  # made once, their own tasks run by Phorge: not part of an edit
    drain(rt, before, through_phorge)
    results = {}
    for name, how in [("runner", through_the_runner), ("phorge", through_phorge)]:
        before = max_id(rt)
        edited = phorge.php("edit", json.dumps({"title": f"runner test {secrets.token_hex(4)}"}))
        ids = drain(rt, before, how)
        archived = classes_archived(rt, ids)
        effects = phorge.php("effects", json.dumps(edited))
        effects["hooks"] = hooks.objects.count(edited["phid"])
        results[name] = (archived, effects)
        if name == "runner":
            seen = phorge.php("archived", json.dumps({"ids": ids}))
            assert sorted(tuple(row) for row in seen) == archived, "Phorge reads every row"

    runner_classes, runner_effects = results["runner"]
    phorge_classes, phorge_effects = results["phorge"]
    assert runner_classes == phorge_classes
    classes = {c for c, _ in runner_classes}
    assert {
        "PhabricatorApplicationTransactionPublishWorker",
        "PhabricatorMetaMTAWorker",
        "FeedPublisherHTTPWorker",
    } <= classes
    assert runner_effects == phorge_effects
    assert runner_effects["indexed"] == 1 and runner_effects["transactions"] >= 2
    assert runner_effects["mails"] and runner_effects["hooks"] >= 1
