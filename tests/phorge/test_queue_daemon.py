"""The shipped ``PhorgeBridgeQueueDaemon`` and the canary weights it reads, on a real
Phorge: runs only when PHORGE_ROOT is set.

The weights are computed alike by PHP (``PhorgeBridgeCanary``), Python
(``bridge.canary.weights``) and SQL (the condition the daemon adds to its lease). The
daemon runs under ``bin/phd debug`` against the install's own queue, and is stopped with
SIGKILL (Phorge's CLI ignores SIGTERM); one test runs it as the shipped systemd unit does,
beside phd's own daemons.

Keeping apart from whatever else uses the install's queue: the daemon runs only the two
test classes this module installs (``PhorgeBridgeDaemonTestWorker``, ``...OtherTestWorker``,
copied into ``src/extensions/`` and removed afterwards), because the weights it is given
name them alone, and every other class stays at the default 100% (the bridge's, so the
daemon leaves it alone). The two config options are shared by the whole install: the
module holds the MariaDB lock ``phorge-bridge-test:canary-options`` while it uses them and
puts their previous values back afterwards. Tests wait for conditions in the database,
never for a fixed time.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from bridge_harness import wait_until
from canary import EVERY_FEATURE
from phorge_daemon import DAEMON, CanaryLab, Daemon, daemon, options_held, unit_daemon
from phorge_env import Phorge, phorge_root, worker_database_url
from phorge_php import HELPER as INTEROP_HELPER
from phorge_php import InteropPHP

from bridge.canary.weights import OPTION, SCALE, STATE_OPTION, bucket, canary_of
from bridge.errors import ConfigError
from bridge.phorge.extension import install
from bridge.queue.beat_lock import BeatLock
from bridge.queue.implementations import CELERY, PYTHON

WORKER = "PhorgeBridgeDaemonTestWorker"
OTHER = "PhorgeBridgeDaemonOtherTestWorker"  # the sentinel class: always the daemon's
FIXTURE = Path(__file__).with_name("phorge_fixtures") / f"{WORKER}.php"
OWNER = re.compile(r"^(phd|phd-fallback):(\d+):(\d+):([^:]+):(\d+)$")
TIMEOUT = 30.0

HELPER = r"""<?php
$root = $argv[1];
$command = $argv[2];
$args = json_decode(isset($argv[3]) ? $argv[3] : '{}', true);
require_once $root.'/scripts/init/init-script.php';

$out = null;
switch ($command) {
  case 'buckets':
    $out = array();
    for ($id = $args['first']; $id <= $args['last']; $id++) {
      $out[] = PhorgeBridgeCanary::bucket($args['level'], $id);
    }
    break;
  case 'canary':
    // Per case: the effective weights of the classes named, the ids the new side takes
    // at the celery level (failureTime NULL, then set), and the rows the daemon's SQL
    // condition gives the old side; or the error.
    $table = new PhabricatorWorkerActiveTask();
    $conn = $table->establishConnection('w');
    queryfx(
      $conn,
      'CREATE TEMPORARY TABLE bridge_canary_rows (id INT UNSIGNED NOT NULL,
        taskClass VARCHAR(64) NOT NULL, failureTime INT UNSIGNED NULL)');
    $out = array();
    foreach ($args['cases'] as $case) {
      try {
        $canary = PhorgeBridgeCanary::newFromValues($case['weights'], $case['state']);
      } catch (PhorgeBridgeCanaryConfigException $ex) {
        $out[] = array('error' => $ex->getMessage());
        continue;
      }
      $weights = array();
      $takes = array();
      $values = array();
      foreach ($case['classes'] as $class) {
        $levels = array(PhorgeBridgeCanary::LEVEL_CELERY, PhorgeBridgeCanary::LEVEL_PYTHON);
        foreach ($levels as $level) {
          $weights[$class][$level] = $canary->getWeight($class, $level);
        }
        foreach (array(null, 1) as $failure) {
          $key = $failure === null ? 'fresh' : 'failed';
          $takes[$class][$key] = array();
          for ($id = 1; $id <= $args['ids']; $id++) {
            if ($canary->takes(PhorgeBridgeCanary::LEVEL_CELERY, $class, $id, $failure)) {
              $takes[$class][$key][] = $id;
            }
            $values[] = qsprintf($conn, '(%d, %s, %nd)', $id, $class, $failure);
          }
        }
      }
      queryfx($conn, 'DELETE FROM bridge_canary_rows');
      foreach (array_chunk($values, 500) as $chunk) {
        queryfx($conn, 'INSERT INTO bridge_canary_rows VALUES %LQ', $chunk);
      }
      $condition = $canary->newOldSideCondition($conn);
      $old = array();
      if ($condition !== null) {
        $rows = queryfx_all(
          $conn,
          'SELECT id, taskClass, failureTime FROM bridge_canary_rows WHERE %Q',
          $condition);
        foreach ($rows as $row) {
          $key = $row['failureTime'] === null ? 'fresh' : 'failed';
          $old[$row['taskClass']][$key][] = (int)$row['id'];
        }
      }
      $out[] = array('weights' => $weights, 'takes' => $takes, 'old' => $old);
    }
    break;
  case 'setup-issues':
    // Phorge's daemon check and the extension's, found among every check as Phorge
    // finds them (runNormalChecks() stops at the CLI's fatal "no request host"): the
    // issue keys raised, each with whether config.ignore-issues hides it.
    $ignored = PhabricatorEnv::getEnvConfig('config.ignore-issues');
    $out = array();
    foreach (PhabricatorSetupCheck::loadAllChecks() as $check) {
      $class = get_class($check);
      if ($class == 'PhabricatorDaemonsSetupCheck' ||
          $class == 'PhorgeBridgeQueueSetupCheck') {
        $check->runSetupChecks();
        foreach ($check->getIssues() as $key => $issue) {
          $out[$key] = !empty($ignored[$key]);
        }
      }
    }
    break;
  default:
    throw new Exception("unknown command {$command}");
}
echo json_encode($out);
"""


# -- fixtures -----------------------------------------------------------------------------


@dataclass
class Lab(CanaryLab):
    """The install (this module's helper commands), and ``phorge_php``'s commands in it
    (the env, ``scheduleTask``)."""

    interop: InteropPHP

    def schedule(self, tasks: list[tuple[str, Any, dict[str, Any]]]) -> list[int]:
        return self.interop.schedule_many(tasks)

    def rows(self, ids: list[int]) -> dict[int, dict[str, Any]]:
        """Each id's row: active (with ``archived`` False) or archived."""
        found: dict[int, dict[str, Any]] = {}
        if not ids:
            return found
        binds = ", ".join(str(int(i)) for i in ids)
        for table, archived in (("worker_activetask", False), ("worker_archivetask", True)):
            for row in self.sql(f"SELECT * FROM {table} WHERE id IN ({binds})"):
                found[int(row.id)] = {**row._asdict(), "archived": archived}
        return found

    def archived(self, ids: list[int]) -> dict[int, dict[str, Any]]:
        return {i: r for i, r in self.rows(ids).items() if r["archived"]}


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """The install, with the extension and the test classes, and the canary options held
    (the MariaDB lock) and restored afterwards."""
    root = phorge_root()
    work = tmp_path_factory.mktemp("daemon")
    phorge = Phorge.with_helper(root, work, HELPER)
    (work / "interop").mkdir()
    interop = InteropPHP(Phorge.with_helper(root, work / "interop", INTEROP_HELPER))
    install(root)
    fixture = root / "src" / "extensions" / FIXTURE.name
    shutil.copyfile(FIXTURE, fixture)
    env = interop.call("env")
    engine = sa.create_engine(worker_database_url(env), pool_pre_ping=True)
    namespace = str(env["db"]).removesuffix("_worker")
    lab = Lab(phorge, engine, f"{namespace}_config", f"{namespace}_daemon", work, interop)
    with options_held(lab):
        try:
            yield lab
        finally:
            lab.sql("DELETE FROM worker_activetask WHERE taskClass IN (:a, :b)", a=WORKER, b=OTHER)
            fixture.unlink(missing_ok=True)
    engine.dispose()


@pytest.fixture
def fresh(lab: Lab) -> Lab:
    """No state, and none of the test classes' rows left active from an earlier test."""
    lab.forget_option(STATE_OPTION)
    lab.sql("DELETE FROM worker_activetask WHERE taskClass IN (:a, :b)", a=WORKER, b=OTHER)
    return lab


def wait_for(condition: Callable[[], bool], what: str, d: Daemon, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if d.process.poll() is not None:
            pytest.fail(f"the daemon exited while waiting for {what}:\n{d.output()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout}s: {what}\n{d.output()[-3000:]}")
        time.sleep(0.05)


def noop(count: int, task_class: str = WORKER, priority: int | None = None) -> list[Any]:
    options = {} if priority is None else {"priority": priority}
    return [(task_class, {"n": n}, options) for n in range(count)]


def owner_fields(owner: str) -> tuple[str, int, int, str, int]:
    found = OWNER.match(owner)
    assert found, f"not a shipped daemon's owner: {owner!r}"
    label, pid, epoch, host, seq = found.groups()
    assert len(owner) <= 64
    return label, int(pid), int(epoch), host, int(seq)


def untouched(row: dict[str, Any]) -> bool:
    return not row["archived"] and row["leaseOwner"] is None and row["failureCount"] == 0


# -- the weights: PHP, Python and SQL alike ------------------------------------------------


def test_php_buckets_are_pythons_and_sqls_and_20_percent_is_a_fifth(lab: Lab) -> None:
    ids = range(1, 10_001)
    php = lab.call("buckets", level=CELERY, first=ids[0], last=ids[-1])
    assert php == [bucket(CELERY, i) for i in ids]
    assert lab.call("buckets", level=PYTHON, first=1, last=500) == [
        bucket(PYTHON, i) for i in range(1, 501)
    ]
    digits = (
        "(SELECT 0 d UNION ALL " + " UNION ALL ".join(f"SELECT {n}" for n in range(1, 10)) + ")"
    )
    sql = lab.sql(
        "SELECT 1 + a.d + 10 * b.d + 100 * c.d + 1000 * e.d AS id,"
        " MOD(CRC32(CONCAT('celery:', 1 + a.d + 10 * b.d + 100 * c.d + 1000 * e.d)), 10000)"
        f" FROM {digits} a, {digits} b, {digits} c, {digits} e ORDER BY id"
    )
    assert [int(row[1]) for row in sql] == php
    share = sum(1 for b in php if b < 2000) / len(php)
    assert abs(share - 0.20) <= 0.015, share


CASES: list[dict[str, Any]] = [
    {"weights": None, "state": None},
    {"weights": [], "state": []},
    {
        "weights": EVERY_FEATURE,
        "state": {
            "classes": {
                "D": {"celery": {"step": 2, "step_since": 1700000000}},
                "G": {"celery": {"rolled_back": {"at": 1700000000, "reason": "guard"}}},
                "H": {"celery": {"rolled_back": {"at": 1700000001, "reason": "cli"}}},
                "B": {"python": {"rolled_back": {"at": 1700000002, "reason": "x"}}},
            },
            "history": [
                {"at": 1, "class": "G", "level": "celery", "event": "rollback", "weight": 0}
            ],
        },
    },
    {
        "weights": {"A": {"celery": 50}, "D": {"ramp": {"level": "celery", "steps": [10, 30]}}},
        "state": {
            "classes": {
                "D": {"celery": {"step": 7, "rolled_back": None}},
                "A": {"celery": {"rolled_back": {"at": None}}},
                "X": {"celery": {"rolled_back": {"at": 5}}},
            }
        },
    },
    {"weights": {"*": {"celery": 100, "python": 0}, "B": {"celery": 30}}, "state": None},
    # Refused alike.
    {"weights": {"*": {"celery": 50}}, "state": None},
    {"weights": {"A": {"celery": 50, "python": 20}}, "state": None},
    {"weights": {"A": {"celery": 101}}, "state": None},
    {"weights": {"A": {"celery": True}}, "state": None},
    {"weights": {"A": {"celery": None}}, "state": None},
    {"weights": {"A": {"web": 5}}, "state": None},
    {"weights": {"A": {"ramp": {"level": "celery", "steps": [5, 5]}}}, "state": None},
    {"weights": {"A": {"ramp": {"level": "celery", "steps": [0, 5]}}}, "state": None},
    {"weights": {"A": {"ramp": {"level": "web", "steps": [5]}}}, "state": None},
    {"weights": {"A": {"ramp": {"level": "celery", "steps": [5], "dwell": 0}}}, "state": None},
    {"weights": {"A": {"celery": 5, "ramp": {"level": "celery", "steps": [5]}}}, "state": None},
    {"weights": {"A": 5}, "state": None},
    {"weights": [1, 2], "state": None},
    {"weights": None, "state": {"classes": {"A": {"celery": {"step": None}}}}},
    {"weights": None, "state": {"history": [{"at": 1}]}},
]
CLASSES = ["A", "B", "C", "D", "E", "F", "G", "H", "X", "Unnamed"]


def python_answer(case: dict[str, Any], ids: int) -> dict[str, Any]:
    try:
        canary = canary_of(case["weights"], case["state"])
    except (ConfigError, ValueError) as exc:
        return {"error": str(exc)}
    weights = {c: {lv: canary.weight(c, lv) for lv in (CELERY, PYTHON)} for c in CLASSES}
    takes = {
        c: {
            key: [i for i in range(1, ids + 1) if canary.takes(CELERY, c, i, failure)]
            for key, failure in (("fresh", None), ("failed", 1))
        }
        for c in CLASSES
    }
    return {"weights": weights, "takes": takes}


def test_php_weights_and_choices_are_pythons_and_the_sql_gives_phd_the_rest(lab: Lab) -> None:
    ids = 300
    cases = [{**case, "classes": CLASSES} for case in CASES]
    answers = lab.call("canary", cases=cases, ids=ids)
    assert len(answers) == len(CASES)
    for case, php in zip(CASES, answers, strict=True):
        expected = python_answer(case, ids)
        if "error" in expected or "error" in php:
            assert "error" in php and "error" in expected, (case, php, expected)
            option = STATE_OPTION if case["weights"] is None else OPTION
            assert php["error"].startswith(option), php
            continue
        assert php["weights"] == expected["weights"], case
        assert php["takes"] == expected["takes"], case
        # The daemon's lease condition: exactly the rows the bridge does not take.
        for c in CLASSES:
            for key in ("fresh", "failed"):
                taken = set(expected["takes"][c][key])
                old = set(((php["old"] or {}).get(c) or {}).get(key, []))  # PHP: {} is []
                assert old == set(range(1, ids + 1)) - taken, (case["weights"], c, key)


def test_bin_config_knows_the_options_and_refuses_bad_weights(lab: Lab) -> None:
    done = lab.phorge.bin("config", "set", "--database", OPTION, '{"X": {"celery": 250}}')
    assert done.returncode != 0
    assert "phorge-bridge.canary: X.celery: 250 is outside [0, 100]" in done.stdout + done.stderr
    lab.set_weights({WORKER: {"celery": 40}})
    shown = lab.phorge.bin("config", "get", OPTION)
    assert shown.returncode == 0, shown.stderr
    values = {entry["source"]: entry["value"] for entry in json.loads(shown.stdout)["config"]}
    assert values["database"] == {WORKER: {"celery": 40}}
    listed = lab.phorge.bin("config", "list")
    assert OPTION in listed.stdout and STATE_OPTION in listed.stdout
    launchable = lab.phorge.bin("phd", "list")
    assert DAEMON in launchable.stdout


# -- the daemon ----------------------------------------------------------------------------


def test_at_weight_0_the_daemon_runs_every_row_and_goes_on_past_a_failure(fresh: Lab) -> None:
    lab = fresh
    lab.set_weights({WORKER: {"celery": 0}, OTHER: {"celery": 0}})
    failing = lab.schedule([(WORKER, {"fail": True}, {})])
    ids = lab.schedule(noop(20) + noop(5, OTHER))
    with daemon(lab) as d:
        wait_for(lambda: len(lab.archived(ids)) == len(ids), "every row archived", d)
        wait_for(lambda: "failing on purpose" in d.output(), "the failure logged", d)
        rows = lab.rows(failing + ids)
    for i in ids:
        assert rows[i]["result"] == 0
        label, _, _, host, _ = owner_fields(rows[i]["leaseOwner"])
        assert label == "phd" and host
    # The temporary failure was recorded as Phorge records it, and the daemon went on.
    failed = rows[failing[0]]
    assert not failed["archived"] and failed["failureCount"] == 1
    assert failed["failureTime"] is not None and failed["leaseOwner"].startswith("phd:")
    # One process, its owners' sequence rising one lease at a time, the epoch the database's.
    owners = [owner_fields(rows[i]["leaseOwner"]) for i in failing + ids]
    assert len({o[1] for o in owners}) == 1
    assert sorted(o[4] for o in owners) == list(range(1, len(owners) + 1))
    (now,) = lab.sql("SELECT UNIX_TIMESTAMP()")[0]
    assert all(now - 120 <= o[2] <= now for o in owners)


def test_at_weight_100_the_daemon_runs_none_even_failed_rows(fresh: Lab) -> None:
    lab = fresh
    lab.set_weights({WORKER: {"celery": 100}, OTHER: {"celery": 0}})
    # The bridge's rows first in the queue (a smaller priority runs first): the daemon
    # reaches the sentinel's rows only past them.
    mine = lab.schedule(noop(10, priority=1000))
    lab.sql(
        f"UPDATE worker_activetask SET failureTime = UNIX_TIMESTAMP() - 5"
        f" WHERE id IN ({', '.join(map(str, mine[:3]))})"
    )
    sentinel = lab.schedule(noop(5, OTHER, priority=3000))
    with daemon(lab) as d:
        wait_for(lambda: len(lab.archived(sentinel)) == 5, "the sentinel rows archived", d)
    assert all(untouched(row) for row in lab.rows(mine).values())


def test_at_50_percent_the_daemon_runs_exactly_the_old_share(fresh: Lab) -> None:
    lab = fresh
    lab.set_weights({WORKER: {"celery": 50}, OTHER: {"celery": 0}})
    ids = lab.schedule(noop(60, priority=1000))
    fallback, failed = ids[:4], ids[4:8]  # fell back from the bridge; failed on phd before
    lab.sql(
        "UPDATE worker_activetask SET failureTime = UNIX_TIMESTAMP() - 5"
        f" WHERE id IN ({', '.join(map(str, fallback + failed))})"
    )
    lab.sql(
        f"UPDATE worker_activetask SET failureCount = 1 WHERE id IN ({', '.join(map(str, failed))})"
    )
    sentinel = lab.schedule(noop(3, OTHER, priority=3000))
    sticky = set(fallback + failed)
    old = {i for i in ids if i in sticky or bucket(CELERY, i) >= SCALE // 2}
    assert 10 < len(old - sticky) < 46  # both sides have rows
    with daemon(lab) as d:
        wait_for(lambda: len(lab.archived([*old, *sentinel])) == len(old) + 3, "phd's share", d)
    rows = lab.rows(ids)
    assert {i for i, r in rows.items() if r["archived"]} == old
    assert all(untouched(rows[i]) for i in set(ids) - old)
    for i in old:
        label = owner_fields(rows[i]["leaseOwner"])[0]
        assert label == ("phd-fallback" if i in fallback else "phd"), (i, rows[i])
        assert rows[i]["result"] == 0
        assert rows[i]["failureCount"] == (1 if i in failed else 0)


def test_the_daemon_leases_in_phorges_phases_and_order_and_honours_delays(fresh: Lab) -> None:
    lab = fresh
    lab.set_weights({WORKER: {"celery": 0}})
    priorities = [3000, 1000, 2000, 1000, 4000, 2000]
    new = lab.schedule([(WORKER, {"n": n}, {"priority": p}) for n, p in enumerate(priorities)])
    expired = lab.schedule(noop(4, priority=1))  # phase 2 despite the smallest priority
    delayed, alive, yielded = lab.schedule(noop(3, priority=1))
    ages = {expired[0]: 50, expired[1]: 300, expired[2]: 10, expired[3]: 120}
    for task_id, age in ages.items():  # leases of a dead worker, run out ``age`` s ago
        lab.sql(
            "UPDATE worker_activetask SET leaseOwner = :owner,"
            " leaseExpires = UNIX_TIMESTAMP() - :age WHERE id = :id",
            owner=f"1:1:deadhost:{task_id}",
            age=age,
            id=task_id,
        )
    lab.sql(
        "UPDATE worker_activetask SET leaseExpires = UNIX_TIMESTAMP() + 3600 WHERE id = :id",
        id=delayed,
    )
    lab.sql(
        "UPDATE worker_activetask SET leaseOwner = 'bridge:1:1:alive:1',"
        " leaseExpires = UNIX_TIMESTAMP() + 3600 WHERE id = :id",
        id=alive,
    )
    lab.sql(
        "UPDATE worker_activetask SET leaseOwner = '(yield)',"
        " leaseExpires = UNIX_TIMESTAMP() + 3600 WHERE id = :id",
        id=yielded,
    )
    ids = new + expired
    with daemon(lab) as d:
        wait_for(lambda: len(lab.archived(ids)) == len(ids), "phase 1 and 2 rows archived", d)
    rows = lab.rows([*ids, delayed, alive, yielded])
    by_lease = sorted(ids, key=lambda i: owner_fields(rows[i]["leaseOwner"])[4])
    phase1 = sorted(new, key=lambda i: (rows[i]["priority"], i))
    phase2 = sorted(expired, key=lambda i: -ages[i])
    assert by_lease == phase1 + phase2
    # A delayed row would have come first of all (phase 1, priority 1): it waits.
    assert rows[delayed]["leaseOwner"] is None and not rows[delayed]["archived"]
    assert rows[alive]["leaseOwner"] == "bridge:1:1:alive:1" and not rows[alive]["archived"]
    assert rows[yielded]["leaseOwner"] == "(yield)" and not rows[yielded]["archived"]


def test_a_rollback_hands_the_class_to_the_daemon_within_5_s(fresh: Lab) -> None:
    lab = fresh
    lab.set_weights({WORKER: {"celery": 50}})
    ids = lab.schedule(noop(30))
    with daemon(lab) as d:
        old = [i for i in ids if bucket(CELERY, i) >= SCALE // 2]
        wait_for(lambda: len(lab.archived(ids)) == len(old), "phd's share archived", d)
        # A bad value (not JSON) is logged, and the weights in force stay: phd's share of
        # new rows is run, the bridge's left alone.
        lab.write_option(OPTION, '{"PhorgeBridgeDaemonTestWorker": {"celery": 0')
        wait_for(lambda: "ignoring the value" in d.output(), "the bad value logged", d)
        ids += lab.schedule(noop(30))
        old = [i for i in ids if bucket(CELERY, i) >= SCALE // 2]
        wait_for(lambda: len(lab.archived(ids)) == len(old), "phd's share of the new rows", d)
        bridges = lab.schedule(noop(10, OTHER))  # not named: 100%, the bridge's
        state = {
            "classes": {WORKER: {CELERY: {"rolled_back": {"at": 1, "reason": "test"}}}},
            "history": [],
        }
        written = time.monotonic()
        lab.write_option(STATE_OPTION, json.dumps(state))
        wait_for(lambda: len(lab.archived(ids)) == len(ids), "the class, rolled back", d, 5.0)
        took = time.monotonic() - written
    assert took < 5.0
    assert all(untouched(row) for row in lab.rows(bridges).values())
    assert all(r["result"] == 0 for r in lab.rows(ids).values())


# -- Phorge's setup issues ------------------------------------------------------------------

IGNORE_ISSUES = "config.ignore-issues"
OLD_SIDE, NOTHING, PHORGES = (
    "phorge-bridge.old-side-not-running",
    "phorge-bridge.queue-not-running",
    "daemons.not-running",
)


@pytest.fixture
def ignoring_phorges_daemon_check(lab: Lab) -> Iterator[None]:
    """``daemons.not-running`` ignored, as docs/canary.md says once the bridge runs
    the queue; the install's own value put back afterwards."""
    (saved,) = lab.sql(
        f"SELECT COUNT(*), MAX(value), MAX(isDeleted) FROM `{lab.config_db}`.config_entry"
        " WHERE namespace = 'default' AND configKey = :key",
        key=IGNORE_ISSUES,
    )
    lab.write_option(IGNORE_ISSUES, json.dumps({PHORGES: True}))
    try:
        yield
    finally:
        lab.forget_option(IGNORE_ISSUES)
        if saved[0]:
            lab.write_option(IGNORE_ISSUES, saved[1], int(saved[2]))


def test_phorges_setup_issues_know_the_shipped_daemon_and_the_bridge(
    fresh: Lab, ignoring_phorges_daemon_check: None
) -> None:
    """Read through Phorge's own setup checks: a share for phd with no daemon alive is an
    issue of its own; with Phorge's daemon check ignored, nothing running the queue is
    still one, and a bridge beat (the holder of its beat lock) or the daemon ends it."""
    lab = fresh
    lab.set_weights({WORKER: {"celery": 50}})
    issues = lab.call("setup-issues")
    assert issues[PHORGES] is True, "ignored: the bridge's own check stands in"
    assert issues[OLD_SIDE] is False and issues[NOTHING] is False
    beat = BeatLock(lab.worker, "bridge")
    try:
        assert beat.held()
        issues = lab.call("setup-issues")
        assert NOTHING not in issues and OLD_SIDE in issues, "the beat runs only its share"
    finally:
        beat.close()
    running = f"SELECT 1 FROM `{lab.daemon_db}`.daemon_log WHERE daemon = :d AND status = 'run'"
    with daemon(lab) as d:
        wait_for(lambda: lab.sql(running, d=DAEMON) != [], "the daemon's heartbeat", d)
        issues = lab.call("setup-issues")
    assert OLD_SIDE not in issues and NOTHING not in issues
    lab.set_weights({WORKER: {"celery": 100}})
    assert OLD_SIDE not in lab.call("setup-issues"), "no share for phd: no daemon needed"


def test_a_daemon_that_cannot_read_the_weights_takes_the_whole_shared_class(
    fresh: Lab,
) -> None:
    """Fail closed, inside Phorge: with its config table gone from under it (as a lost
    grant would), the daemon runs the bridge's half of a class shared at 50% too, said
    once; the rows of a class wholly the bridge's it leaves alone."""
    lab = fresh
    lab.set_weights({WORKER: {"celery": 50}})
    ids = lab.schedule(noop(30))
    bridges = lab.schedule(noop(5, OTHER))  # not named: 100%, the bridge's
    ours = [i for i in ids if bucket(CELERY, i) < SCALE // 2]
    assert 0 < len(ours) < len(ids)
    table = f"`{lab.config_db}`.config_entry"
    with daemon(lab) as d:
        phds = len(ids) - len(ours)
        wait_for(lambda: len(lab.archived(ids)) == phds, "phd's share archived", d)
        assert not lab.archived(ours), "the bridge's half waits for the bridge"
        lab.sql(f"RENAME TABLE {table} TO {table}_hidden")
        try:
            wait_for(lambda: len(lab.archived(ids)) == len(ids), "the whole class", d)
            # The daemon's output reaches its log a moment after its work.
            last = f"Task {max(ours)} complete!"
            wait_for(lambda: last in d.output(), "the daemon's log of its last task", d)
        finally:
            lab.sql(f"RENAME TABLE {table}_hidden TO {table}")
        said = d.output().count("can not read")
    assert said == 1
    assert all(row["result"] == 0 for row in lab.rows(ids).values())
    assert all(untouched(row) for row in lab.rows(bridges).values())


# -- the shipped unit: the old side outside phd's overseer ----------------------------------

TASKMASTERS = "phd.taskmasters"


@pytest.fixture
def phd_without_taskmasters(lab: Lab) -> Iterator[None]:
    """``phd.taskmasters`` 0, as docs/canary.md sets it for a canary (its
    local config, the only source of a locked option); phd's daemons stopped and the
    option deleted afterwards."""
    done = lab.phorge.bin("config", "set", TASKMASTERS, "0")
    assert done.returncode == 0, done.stdout + done.stderr
    try:
        yield
    finally:
        stopped = lab.phorge.bin("phd", "stop")
        lab.phorge.bin("config", "delete", TASKMASTERS)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr


def test_the_units_daemon_lists_itself_and_outlives_phd_restart_and_stop(
    fresh: Lab, phd_without_taskmasters: None
) -> None:
    """The daemon as deploy/systemd's unit runs it lists itself in Phorge's daemon log
    (Phorge's own setup check counts it alive), runs phd's share, goes on running it
    through ``bin/phd restart`` (which starts phd's other daemons), ``stop`` and
    ``start``, and stops on the unit's stop signal, marked exited."""
    lab = fresh
    lab.set_weights({WORKER: {"celery": 0}, OTHER: {"celery": 0}})
    with unit_daemon(lab) as d:
        wait_for(lambda: d.daemon_pid() is not None, "the unit's shell to start the daemon", d)
        pid = d.daemon_pid()

        def listed() -> list[sa.Row[Any]]:
            return lab.sql(
                f"SELECT status, argv, runningAsUser FROM `{lab.daemon_db}`.daemon_log"
                " WHERE daemon = :daemon AND pid = :pid",
                daemon=DAEMON,
                pid=pid,
            )

        wait_for(lambda: bool(listed()), "the daemon listed", d)
        (row,) = listed()
        assert row.status == "run" and json.loads(row.argv) == ["--standalone"], row
        assert row.runningAsUser
        assert OLD_SIDE not in lab.call("setup-issues"), "Phorge counts it alive"

        def runs(count: int) -> list[int]:
            ids = lab.schedule(noop(count))
            wait_for(lambda: len(lab.archived(ids)) == count, f"{count} rows archived", d)
            return ids

        ran = runs(5)
        for command in ("restart", "stop", "start"):
            done = lab.phorge.bin("phd", command)
            assert done.returncode == 0, (command, done.stdout + done.stderr)
            ran += runs(5)
        assert d.daemon_pid() == pid
        assert {owner_fields(r["leaseOwner"])[1] for r in lab.rows(ran).values()} == {pid}
        d.stop(d.unit.stop_signal)
        wait_until(
            lambda: not Path(f"/proc/{pid}").exists() and listed()[0].status == "exit",
            TIMEOUT,
            "the daemon to end, marked exited",
            diagnose=d.tail,
        )
