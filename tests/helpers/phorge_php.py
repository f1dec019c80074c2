"""Phorge's side of the queue interop tests: small PHP snippets run inside Phorge.

Every command runs Phorge's own classes (``PhabricatorWorker::scheduleTask``,
``PhabricatorWorkerLeaseQuery``, the task queries, ``executeTask``) on Phorge's own
database connection, and prints JSON. Arguments go in as one JSON document.

Column values are printed as PHP holds them (mysqli returns integers as strings), so
:func:`normalize` turns them into Python integers; task data is printed with
``json_encode`` of the PHP value, and with ``var_export`` so that a test can see PHP's
types (an integer stays an integer, never a float).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from phorge_env import Phorge, kill

INT_FIELDS = (
    "id",
    "leaseExpires",
    "failureCount",
    "dataID",
    "priority",
    "dateCreated",
    "dateModified",
    "failureTime",
    "result",
    "duration",
    "archivedEpoch",
)

HELPER = r"""<?php
$root = $argv[1];
$command = $argv[2];
$args = json_decode(isset($argv[3]) ? $argv[3] : '{}', true);
require_once $root.'/scripts/init/init-script.php';

function interop_fields(PhabricatorWorkerTask $task) {
  $fields = array(
    'id' => $task->getID(),
    'archived' => $task->isArchived(),
    'taskClass' => $task->getTaskClass(),
    'leaseOwner' => $task->getLeaseOwner(),
    'leaseExpires' => $task->getLeaseExpires(),
    'failureCount' => $task->getFailureCount(),
    'dataID' => $task->getDataID(),
    'priority' => $task->getPriority(),
    'objectPHID' => $task->getObjectPHID(),
    'containerPHID' => $task->getContainerPHID(),
    'dateCreated' => $task->getDateCreated(),
    'dateModified' => $task->getDateModified(),
  );
  if ($task->isArchived()) {
    $fields['result'] = $task->getResult();
    $fields['duration'] = $task->getDuration();
    $fields['archivedEpoch'] = $task->getArchivedEpoch();
  } else {
    $fields['failureTime'] = $task->getFailureTime();
  }
  $data = $task->getData();
  $fields['data'] = $data;
  $fields['dataExport'] = var_export($data, true);
  return $fields;
}

// How bin/worker execute gives a queried task its data.
function interop_attach_data(PhabricatorWorkerTask $task) {
  $row = id(new PhabricatorWorkerTaskData())->loadOneWhere(
    'id = %d',
    $task->getDataID());
  $task->setData($row ? $row->getData() : null);
  return $task;
}

function interop_lease($args) {
  $query = id(new PhabricatorWorkerLeaseQuery())->setLimit($args['limit']);
  if (isset($args['ids'])) {
    $query->withIDs($args['ids']);
  }
  return $query->execute();
}

// A concurrent run starts when the test says go, so that both sides overlap.
function interop_wait_for_go() {
  echo "ready\n";
  fflush(STDOUT);
  if (trim((string)fgets(STDIN)) !== 'go') {
    exit(1);  // the test went away: do nothing
  }
}

$out = null;
switch ($command) {
  case 'env':
    // Where Phorge's worker tables are, so the bridge opens the very same database.
    $conn = id(new PhabricatorWorkerActiveTask())->establishConnection('w');
    $out = queryfx_one(
      $conn,
      'SELECT DATABASE() AS db, @@port AS serverPort, @@datadir AS datadir');
    foreach (array('host', 'port', 'user', 'pass') as $key) {
      $out[$key] = PhabricatorEnv::getEnvConfig('mysql.'.$key);
    }
    break;
  case 'load':
    // PhabricatorWorkerActiveTaskQuery and PhabricatorWorkerArchiveTaskQuery, by id.
    $out = array();
    $active = id(new PhabricatorWorkerActiveTaskQuery())
      ->withIDs($args['ids'])
      ->execute();
    $archived = id(new PhabricatorWorkerArchiveTaskQuery())
      ->withIDs($args['ids'])
      ->execute();
    foreach (array_merge($active, $archived) as $task) {
      $out[] = interop_fields(interop_attach_data($task));
    }
    break;
  case 'lease':
    // PhabricatorWorkerLeaseQuery, as a taskmaster runs it (optionally limited to ids).
    $out = array();
    foreach (interop_lease($args) as $task) {
      $out[] = interop_fields($task);
    }
    break;
  case 'lease-loop':
    // A taskmaster's lease loop, one task at a time, until no row is left unleased (an
    // empty lease alone may just be a race lost to another leaser).
    interop_wait_for_go();
    $out = array();
    $table = new PhabricatorWorkerActiveTask();
    do {
      $tasks = interop_lease(array('limit' => 1, 'ids' => $args['ids']));
      foreach ($tasks as $task) {
        $out[] = array('id' => (int)$task->getID(), 'owner' => $task->getLeaseOwner());
      }
      $left = queryfx_one(
        $table->establishConnection('w'),
        'SELECT COUNT(*) AS n FROM %T WHERE id IN (%Ld) AND leaseOwner IS NULL',
        $table->getTableName(),
        $args['ids']);
    } while ($tasks || $left['n'] > 0);
    break;
  case 'schedule':
    $out = array();
    foreach ($args['tasks'] as $spec) {
      $task = PhabricatorWorker::scheduleTask(
        $spec['class'],
        $spec['data'],
        $spec['options']);
      $out[] = (int)$task->getID();
    }
    break;
  case 'schedule-loop':
    interop_wait_for_go();
    $out = array();
    for ($ii = 0; $ii < $args['count']; $ii++) {
      $task = PhabricatorWorker::scheduleTask(
        $args['class'],
        array('writer' => 'php', 'n' => $ii));
      $out[] = (int)$task->getID();
    }
    break;
  case 'run':
    // PhabricatorTaskmasterDaemon::run(), once per leased task.
    $out = array();
    foreach (interop_lease($args) as $task) {
      $owner = $task->getLeaseOwner();
      $result = $task->executeTask();
      $ex = $result->getExecutionException();
      $fields = interop_fields($result);
      $fields['ranAs'] = $owner;
      $fields['exception'] = $ex ? get_class($ex) : null;
      $out[] = $fields;
    }
    break;
  case 'awaken':
    PhabricatorWorker::awakenTaskIDs($args['ids']);
    break;
  default:
    throw new Exception("unknown command {$command}");
}
echo json_encode($out);
"""


def normalize(fields: dict[str, Any]) -> dict[str, Any]:
    """A task as PHP printed it, with its integer columns as Python integers."""
    return {
        key: int(value) if key in INT_FIELDS and value is not None else value
        for key, value in fields.items()
    }


def php_value(value: Any) -> Any:
    """``value`` as PHP's ``json_encode(json_decode($json, true))`` gives it back.

    PHP has one array type: an empty JSON object decodes to ``array()``, which encodes
    as ``[]``.
    """
    if isinstance(value, dict):
        return {key: php_value(item) for key, item in value.items()} if value else []
    if isinstance(value, list):
        return [php_value(item) for item in value]
    return value


class InteropPHP:
    """The PHP commands above, run against the Phorge at PHORGE_ROOT."""

    def __init__(self, phorge: Phorge) -> None:
        self.phorge = phorge

    def call(self, command: str, **args: Any) -> Any:
        return self.phorge.php(command, json.dumps(args))

    def load(self, ids: list[int]) -> dict[int, dict[str, Any]]:
        """Tasks by id, active or archived, with the data PHP decodes from their data row."""
        return {int(t["id"]): normalize(t) for t in self.call("load", ids=ids)}

    def lease(self, limit: int, ids: list[int] | None = None) -> list[dict[str, Any]]:
        """What ``PhabricatorWorkerLeaseQuery`` leases (only among ``ids`` if given)."""
        args: dict[str, Any] = {"limit": limit}
        if ids is not None:
            args["ids"] = ids
        return [normalize(t) for t in self.call("lease", **args)]

    def schedule_many(self, tasks: list[tuple[str, Any, dict[str, Any]]]) -> list[int]:
        """``PhabricatorWorker::scheduleTask`` for each (class, data, options); their ids.

        Options are scheduleTask's: priority, objectPHID, containerPHID, delayUntil.
        """
        specs = [
            {"class": task_class, "data": data, "options": options or {}}
            for task_class, data, options in tasks
        ]
        return self.call("schedule", tasks=specs)

    def run(self, limit: int, ids: list[int]) -> list[dict[str, Any]]:
        """Lease and execute like a taskmaster; each task as it ended, with ``exception``."""
        return [normalize(t) for t in self.call("run", limit=limit, ids=ids)]

    def awaken(self, ids: list[int]) -> None:
        self.call("awaken", ids=ids)

    @contextmanager
    def started(self, command: str, **args: Any) -> Iterator[subprocess.Popen]:
        """A concurrent command, started; it prints ``ready`` and waits for :meth:`go`.

        Whatever happens in the block, the process is gone when it ends.
        """
        process = subprocess.Popen(
            self.phorge.helper_command(command, json.dumps(args)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            assert process.stdout is not None and process.stderr is not None
            line = process.stdout.readline()
            if line != "ready\n":
                raise AssertionError(f"{command} did not start: {line}{process.stderr.read()}")
            yield process
        finally:
            if process.poll() is None:
                kill(process)

    @staticmethod
    def go(process: subprocess.Popen) -> None:
        assert process.stdin is not None
        process.stdin.write("go\n")
        process.stdin.flush()

    @staticmethod
    def finish(process: subprocess.Popen, timeout: float = 120) -> Any:
        """The JSON a started command printed; SIGKILL it if it overruns ``timeout``."""
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill(process)
            raise AssertionError(f"PHP did not finish within {timeout}s; killed it") from None
        assert process.returncode == 0, out + err
        return json.loads(out)
