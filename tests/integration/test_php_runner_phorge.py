"""The PHP runner on a real Phorge (runs only when PHORGE_ROOT is set).

A Maniphest edit queues Phorge's real work (the transaction publish worker, then search
indexing, feed and whatever else it schedules). One edit is drained by the bridge with
the runner, in process, on Phorge's own worker database; another by Phorge itself
(``bin/worker execute``). Both must leave the same classes archived, all successful, and
the same effects: feed stories, the search index, the transactions.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from phorge_env import Phorge, phorge_root, worker_database_url

from bridge.config import load_settings
from bridge.engine.batch import run_task
from bridge.engine.context import Runtime, build_runtime
from bridge.queue.model import RESULT_SUCCESS, Outcome
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_archivetask as archive

HELPER = r"""<?php
$root = $argv[1];
$command = $argv[2];
$args = json_decode(isset($argv[3]) ? $argv[3] : '{}', true);
require_once $root.'/scripts/init/init-script.php';
$viewer = PhabricatorUser::getOmnipotentUser();

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
  case 'edit':
    $name = 'bridgerunnertest';
    $user = id(new PhabricatorPeopleQuery())->setViewer($viewer)
      ->withUsernames(array($name))->executeOne();
    if (!$user) {
      $user = id(new PhabricatorUser())->setUsername($name)->setRealName($name)
        ->setIsApproved(1);
      $email = id(new PhabricatorUserEmail())->setAddress($name.'@example.com')
        ->setIsVerified(1);
      id(new PhabricatorUserEditor())->setActor($viewer)->createNewUser($user, $email);
    }
    $task = ManiphestTask::initializeNewTask($user);
    $xactions = array(
      id(new ManiphestTransaction())
        ->setTransactionType(ManiphestTaskTitleTransaction::TRANSACTIONTYPE)
        ->setNewValue($args['title']),
      id(new ManiphestTransaction())
        ->setTransactionType(ManiphestTaskDescriptionTransaction::TRANSACTIONTYPE)
        ->setNewValue('Made by the PHP runner test.'),
    );
    id(new ManiphestTransactionEditor())->setActor($user)
      ->setContentSource(PhabricatorContentSource::newForSource(
        PhabricatorDaemonContentSource::SOURCECONST))
      ->setContinueOnNoEffect(true)
      ->applyTransactions($task, $xactions);
    echo json_encode(array('phid' => $task->getPHID()));
    break;
  case 'effects':
    $phid = $args['phid'];
    $stories = id(new PhabricatorFeedQuery())->setViewer($viewer)
      ->withFilterPHIDs(array($phid))->execute();
    $ferret = id(new ManiphestTask())->newFerretEngine();
    $indexed = queryfx_one(id(new ManiphestTask())->establishConnection('r'),
      'SELECT COUNT(*) n FROM %T WHERE objectPHID = %s',
      $ferret->getDocumentTableName(), $phid);
    $xactions = id(new ManiphestTransactionQuery())->setViewer($viewer)
      ->withObjectPHIDs(array($phid))->execute();
    echo json_encode(array(
      'feedStories' => count($stories),
      'indexed' => (int)$indexed['n'],
      'transactions' => count($xactions),
    ));
    break;
  case 'archived':
    // Phorge reads every row the bridge archived.
    $tasks = id(new PhabricatorWorkerArchiveTaskQuery())->withIDs($args['ids'])->execute();
    $seen = array();
    foreach ($tasks as $task) {
      $seen[] = array($task->getTaskClass(), (int)$task->getResult(), $task->getData());
    }
    echo json_encode($seen);
    break;
}
"""


@pytest.fixture(scope="module")
def phorge(tmp_path_factory: pytest.TempPathFactory) -> Phorge:
    return Phorge.with_helper(phorge_root(), tmp_path_factory.mktemp("runner"), HELPER)


@pytest.fixture(scope="module")
def rt(phorge: Phorge) -> Iterator[Runtime]:
    """The bridge with the runner on this checkout, on the worker database it uses."""
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


def test_a_maniphest_edit_through_the_runner_has_phds_effects(phorge: Phorge, rt: Runtime) -> None:
    def through_the_runner(ids: list[int]) -> None:
        for task in rt.queue.lease(len(ids), 600, ids=ids):
            assert run_task(rt, task.lease, task.raw_data).outcome is Outcome.SUCCESS

    def through_phorge(ids: list[int]) -> None:
        for task_id in ids:
            phorge.bin("worker", "execute", "--id", str(task_id))

    results = {}
    for name, how in [("runner", through_the_runner), ("phorge", through_phorge)]:
        before = max_id(rt)
        edited = phorge.php("edit", json.dumps({"title": f"runner test {secrets.token_hex(4)}"}))
        ids = drain(rt, before, how)
        results[name] = (classes_archived(rt, ids), phorge.php("effects", json.dumps(edited)))
        if name == "runner":
            seen = phorge.php("archived", json.dumps({"ids": ids}))
            assert len(seen) == len(ids) and {result for _, result, _ in seen} == {RESULT_SUCCESS}

    runner_classes, runner_effects = results["runner"]
    phorge_classes, phorge_effects = results["phorge"]
    assert runner_classes == phorge_classes
    assert "PhabricatorApplicationTransactionPublishWorker" in {c for c, _ in runner_classes}
    assert runner_effects == phorge_effects
    assert runner_effects["indexed"] == 1 and runner_effects["transactions"] >= 2
