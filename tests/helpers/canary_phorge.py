"""The canary on a real Phorge (``tests/phorge/test_canary_phorge.py``):
the install at PHORGE_ROOT, its Maniphest work, the shipped ``PhorgeBridgeQueueDaemon``
under ``bin/phd debug`` and a bridge deployment (``bridge_harness.Bridge``: real
``celery worker`` and ``celery beat``) on the install's own worker database.

Work is made as Phorge makes it: ``maniphest.edit`` (the edit engine, through
``ConduitCall`` inside Phorge) creates a task and queues its
``PhabricatorApplicationTransactionPublishWorker``; that one queues the search index
(``PhabricatorSearchWorker``), the feed (``FeedPublisherWorker``, which queues one
``FeedPublisherHTTPWorker`` per ``feed.http-hooks`` URI) and the mail
(``PhabricatorMetaMTAWorker``, void: no mailer is configured). Every row a test reads
is one of those, found by its class and an id above what the queue held before.

The install is shared: the canary options are changed only while the MariaDB lock
``phorge-bridge-test:canary-options`` is held (``phorge_daemon.options_held``, as in
``test_queue_daemon.py``), and their rows are put back as they were afterwards;
``feed.http-hooks`` (locked: local configuration only) is set for one test and put back
after it. The bridge serves only the Maniphest chain's classes
(``BRIDGE_HANDLERS_INCLUDE``) and the daemon only the classes the weights name below 100,
so the install's other rows (``bin/storage upgrade`` leaves some) are left alone; rows of
the chain a failed test left queued are cancelled. Other tests that run Phorge's queue
(``test_php_runner_phorge.py``) must not run at the same time.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa
from bridge_harness import Bridge, CeleryProcess, wait_until, write_plugin
from phorge_daemon import CanaryLab, Daemon, options_held
from phorge_env import HELPER_START, Phorge, phorge_root, worker_database_url

from bridge.canary.store import CanaryStore
from bridge.phorge.extension import install

T = TypeVar("T")

PUBLISH = "PhabricatorApplicationTransactionPublishWorker"
SEARCH = "PhabricatorSearchWorker"
FEED = "FeedPublisherWorker"
HOOK = "FeedPublisherHTTPWorker"
MAIL = "PhabricatorMetaMTAWorker"
CHAIN = (PUBLISH, SEARCH, FEED, HOOK, MAIL)  # what a Maniphest edit queues, in turn

HOOKS_OPTION = "feed.http-hooks"
WAIT = 45.0

HELPER = (
    HELPER_START
    + r"""
function lab_user(PhabricatorUser $viewer, $name, $admin = false) {
  $made = phorge_bridge_account($viewer, $name, $admin);
  return id(new PhabricatorPeopleQuery())->setViewer($viewer)
    ->withPHIDs(array($made->getPHID()))->needUserSettings(true)->executeOne();
}

$out = null;
switch ($command) {
  case 'env':
    $conn = id(new PhabricatorWorkerActiveTask())->establishConnection('w');
    $out = queryfx_one($conn, 'SELECT DATABASE() AS db');
    foreach (array('host', 'port', 'user', 'pass') as $key) {
      $out[$key] = PhabricatorEnv::getEnvConfig('mysql.'.$key);
    }
    $out['baseURI'] = PhabricatorEnv::getEnvConfig('phabricator.base-uri');
    $out['silent'] = PhabricatorEnv::getEnvConfig('phabricator.silent');
    break;
  case 'users':
    // The editor, a subscriber (so the edit sends mail) and the bridge's bot.
    lab_user($viewer, 'bridgegraytest');
    lab_user($viewer, 'bridgegraycc');
    $admin = lab_user($viewer, 'bridgetestadmin', true);
    $out = array('token' => phorge_bridge_api_token($viewer, $admin));
    break;
  case 'edit':
    // Maniphest tasks, made as a web or API edit makes them (the edit engine).
    $user = lab_user($viewer, 'bridgegraytest');
    $cc = lab_user($viewer, 'bridgegraycc');
    $out = array();
    for ($ii = 0; $ii < $args['count']; $ii++) {
      $edit = id(new ConduitCall('maniphest.edit', array(
        'transactions' => array(
          array('type' => 'title', 'value' => $args['title'].' #'.$ii),
          array('type' => 'description', 'value' => 'Made by the canary test.'),
          array('type' => 'subscribers.add', 'value' => array($cc->getPHID())),
        ),
      )))->setUser($user)->execute();
      $out[] = $edit['object']['phid'];
    }
    break;
  case 'effects':
    // What the edits' work left, per task: feed stories, search index, transactions,
    // mail (and the mail's state).
    $out = array();
    foreach ($args['phids'] as $phid) {
      $out[$phid] = phorge_bridge_effects($viewer, $phid);
    }
    break;
  case 'console':
    $out = phorge_bridge_console($viewer);
    break;
  case 'stories':
    // Each task's feed stories: id, chronological key, and the body
    // FeedPublisherHTTPWorker::doWork() POSTs for it.
    $out = array();
    foreach ($args['phids'] as $phid) {
      $out[$phid] = array();
      $stories = id(new PhabricatorFeedQuery())->setViewer($viewer)
        ->withFilterPHIDs(array($phid))->execute();
      foreach ($stories as $story) {
        $data = $story->getStoryData();
        $out[$phid][] = array(
          'id' => (int)$data->getID(),
          'key' => (string)$data->getChronologicalKey(),
          'body' => phorge_bridge_hook_body($story),
        );
      }
    }
    break;
  case 'reindex':
    $conn = id(new PhabricatorWorkerActiveTask())->establishConnection('w');
    $now = queryfx_one($conn, 'SELECT UNIX_TIMESTAMP() AS now');
    foreach ($args['phids'] as $phid) {
      PhabricatorSearchWorker::queueDocumentForIndexing($phid, array('force' => true));
    }
    $out = (int)$now['now'];
    break;
  case 'cancel':
    // Rows a test left behind, archived as cancelled (as bin/worker cancel does).
    foreach ($args['ids'] as $id) {
      $task = id(new PhabricatorWorkerActiveTask())->load((int)$id);
      if ($task) {
        $task->archiveTask(PhabricatorWorkerArchiveTask::RESULT_CANCELLED, 0);
      }
    }
    break;
  default:
    throw new Exception("unknown command {$command}");
}
echo json_encode($out);
"""
)


def poll(
    condition: Callable[[], T],
    what: str,
    *,
    timeout: float = WAIT,
    interval: float = 0.1,
    diagnose: Callable[[], str] = lambda: "",
) -> T:
    """``bridge_harness.wait_until``, waiting ``WAIT`` s unless told."""
    return wait_until(condition, timeout, what, interval=interval, diagnose=diagnose)


def text(value: Any) -> Any:
    """A column's value, its varbinary ones (PHIDs, lease owners) as text."""
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class RealLab(CanaryLab):
    """The install under test (its helper script, worker, config and daemon databases)
    with the worker database's URL for the bridge and the helper's ``env`` answer."""

    url: str  # the worker database, as a URL for the bridge
    env: dict[str, Any]
    start: int  # the largest task id before the module made any

    def max_id(self) -> int:
        (row,) = self.sql(
            "SELECT GREATEST((SELECT COALESCE(MAX(id), 0) FROM worker_activetask),"
            " (SELECT COALESCE(MAX(id), 0) FROM worker_archivetask))"
        )
        return int(row[0])

    # -- options -------------------------------------------------------------------------

    @property
    def store(self) -> CanaryStore:
        """The bridge's own store of the canary options in this install."""
        return CanaryStore(self.worker, self.config_db)

    @contextmanager
    def local_option(self, key: str, value: Any) -> Iterator[None]:
        """``key`` set in Phorge's local configuration (``bin/config set``; a locked
        option such as ``feed.http-hooks`` can be set nowhere else) for the block, then
        put back as it was."""
        local = self.phorge.root / "conf" / "local" / "local.json"
        found = json.loads(local.read_text()) if local.exists() else {}
        done = self.phorge.bin("config", "set", key, json.dumps(value))
        assert done.returncode == 0, done.stdout + done.stderr
        try:
            yield
        finally:
            if key in found:
                undone = self.phorge.bin("config", "set", key, json.dumps(found[key]))
            else:
                undone = self.phorge.bin("config", "delete", key)
            assert undone.returncode == 0, undone.stdout + undone.stderr

    def config(self, key: str) -> Any:
        """An option's database value as an operator reads it: ``bin/config get`` (which
        prints its JSON through a format string, so the bridge stores no ``%``)."""
        done = self.phorge.bin("config", "get", key)
        assert done.returncode == 0, done.stdout + done.stderr
        [stored] = [c for c in json.loads(done.stdout)["config"] if c["source"] == "database"]
        return stored["value"]

    # -- the work ------------------------------------------------------------------------

    def edit(self, count: int) -> list[str]:
        """Make ``count`` Maniphest tasks; their PHIDs."""
        return list(self.call("edit", count=count, title=f"gray {secrets.token_hex(3)}"))

    def tasks(self, after: int, classes: Iterable[str] = CHAIN) -> dict[int, dict[str, Any]]:
        """Rows of ``classes`` with an id above ``after``: active (``archived`` False) or
        archived."""
        binds = ", ".join(f"'{c}'" for c in classes)
        found: dict[int, dict[str, Any]] = {}
        for table, archived in (("worker_activetask", False), ("worker_archivetask", True)):
            for row in self.sql(
                f"SELECT * FROM {table} WHERE id > :after AND taskClass IN ({binds})",
                after=after,
            ):
                fields = {k: text(v) for k, v in row._asdict().items()}
                found[int(row.id)] = {**fields, "archived": archived}
        return found

    def archived_all(
        self, after: int, classes: Iterable[str], ids: Iterable[int] | None = None
    ) -> bool:
        """Whether every row of ``classes`` above ``after`` (of ``ids`` when given) is
        archived."""
        rows = self.tasks(after, classes)
        wanted = rows if ids is None else ids
        return all(rows[i]["archived"] for i in wanted)

    def reindex(self, phids: list[str]) -> int:
        """Queue a forced search index of each object, as ``bin/search index --force``
        does (``PhabricatorSearchWorker::queueDocumentForIndexing``); the database's time
        before."""
        return int(self.call("reindex", phids=phids))

    def index_epochs(self, phids: list[str]) -> dict[str, int]:
        """When each object was last indexed (``search_indexversion.indexEpoch``)."""
        binds = ", ".join(f"'{phid}'" for phid in phids)
        rows = self.sql(
            f"SELECT objectPHID, MAX(indexEpoch) AS epoch FROM `{self.namespace}_search`"
            f".search_indexversion WHERE objectPHID IN ({binds}) GROUP BY objectPHID"
        )
        return {text(row.objectPHID): int(row.epoch) for row in rows}

    @property
    def namespace(self) -> str:
        return self.config_db.removesuffix("_config")

    def data(self, ids: Iterable[int]) -> dict[int, Any]:
        """Each task's data, decoded."""
        binds = ", ".join(str(int(i)) for i in ids) or "NULL"
        rows = self.sql(
            "SELECT t.id, d.data FROM worker_archivetask t JOIN worker_taskdata d"
            f" ON d.id = t.dataID WHERE t.id IN ({binds})"
            " UNION ALL SELECT t.id, d.data FROM worker_activetask t JOIN worker_taskdata d"
            f" ON d.id = t.dataID WHERE t.id IN ({binds})"
        )
        return {int(row.id): json.loads(row.data) for row in rows}

    def effects(self, phids: list[str]) -> dict[str, dict[str, Any]]:
        return dict(self.call("effects", phids=phids))

    def stories(self, phids: list[str]) -> dict[str, list[dict[str, Any]]]:
        return dict(self.call("stories", phids=phids))

    def cancel_leftovers(self) -> None:
        """Archive as cancelled the chain's rows above ``start`` that are still queued (a
        test that failed midway, or another module), so no test's daemon finds them."""
        left = [i for i, row in self.tasks(self.start).items() if not row["archived"]]
        if left:
            self.call("cancel", ids=left)

    def drain_with_phorge(self, after: int) -> None:
        """Run, with Phorge's own ``bin/worker execute``, every row queued after ``after``
        (a new account's indexing), until none is left."""
        for _ in range(10):
            ids = [int(r.id) for r in self.sql("SELECT id FROM worker_activetask WHERE id > :a",
                                               a=after)]  # fmt: skip
            if not ids:
                return
            for task_id in ids:
                self.phorge.bin("worker", "execute", "--id", str(task_id))
        pytest.fail(f"rows still queued after 10 rounds of bin/worker execute (> {after})")


@contextmanager
def gray_lab(work: Path) -> Iterator[RealLab]:
    """The install with the extension, the accounts made, and the options held (the
    MariaDB lock) and restored afterwards, with the rows the module left cancelled."""
    root = phorge_root()
    install(root)
    phorge = Phorge.with_helper(root, work, HELPER)
    env = phorge.php("env")
    assert not env["silent"], "phabricator.silent is on: Phorge would send no feed hook"
    url = worker_database_url(env)
    engine = sa.create_engine(url, pool_pre_ping=True)
    namespace = str(env["db"]).removesuffix("_worker")
    lab = RealLab(phorge, engine, f"{namespace}_config", f"{namespace}_daemon", work, url, env, 0)
    with options_held(lab):
        try:
            # The chain's rows other modules left queued (lab.start is 0 here) would be
            # taken by the daemon as this module's.
            lab.cancel_leftovers()
            before = lab.max_id()
            env.update(lab.call("users"))
            lab.drain_with_phorge(before)  # the accounts' own work, the first time only
            lab.start = lab.max_id()
            yield lab
        finally:
            lab.cancel_leftovers()
    engine.dispose()


# -- the bridge ------------------------------------------------------------------------------

# A native handler broken on purpose: every run raises, as a handler with a bug would.
BROKEN_HANDLER = '''"""The canary test's broken handler (tests/helpers/canary_phorge.py)."""

import time

import run_record

from bridge.handlers.api import Handler


class BrokenHandler(Handler):
    task_classes = ("{task_class}",)
    phorge_defaults = True

    def run(self, task):
        run_record.append({{"event": "start", "id": task.id, "taskClass": task.task_class}})
        time.sleep({seconds})  # what it tried before it failed
        raise RuntimeError("broken on purpose by the canary test")
'''


def with_broken_handler(bridge: Bridge, task_class: str, seconds: float = 0.0) -> None:
    """Publish, in ``bridge``'s workers, a native handler of ``task_class`` that raises
    after ``seconds`` of work."""
    source = bridge.directory / "gray_broken_handler.py"
    source.write_text(BROKEN_HANDLER.format(task_class=task_class, seconds=seconds))
    bridge.plugin_dir = write_plugin(
        bridge.directory / "broken-plugin",
        source,
        "BrokenHandler = gray_broken_handler:BrokenHandler",
    )


def start_bridge(bridge: Bridge) -> CeleryProcess:
    """A worker (default and control queues) and beat; returns the worker, ready."""
    worker = bridge.worker("worker", [bridge.default_queue, bridge.control_queue], concurrency=2)
    bridge.beat()
    bridge.wait_ready(worker)
    return worker


def diagnosis(lab: RealLab, bridge: Bridge, d: Daemon | None, after: int) -> Callable[[], str]:
    """What a failed wait shows: the chain's rows, the daemon's and the bridge's logs;
    fails at once when the daemon died."""

    def show() -> str:
        rows = sorted(lab.tasks(after).items())
        lines = [
            f"  {i} {r['taskClass']} archived={r['archived']} owner={r['leaseOwner']}"
            f" result={r.get('result')} failures={r['failureCount']}"
            for i, r in rows[-40:]
        ]
        parts = ["rows:", *lines]
        if d is not None:
            parts.append(f"--- daemon (exit {d.process.poll()}) ---\n{d.tail()}")
        parts += [f"--- {p.name} ---\n{p.tail()}" for p in bridge.processes]
        return "\n".join(parts)

    return show


def pair_up(
    condition: Callable[[], T], d: Daemon | None, show: Callable[[], str]
) -> Callable[[], T]:
    """``condition``, failing the test as soon as the daemon has exited."""

    def checked() -> T:
        if d is not None and d.process.poll() is not None:
            pytest.fail(f"the daemon exited:\n{show()}")
        return condition()

    return checked
