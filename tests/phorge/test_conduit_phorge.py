"""The extension inside a real Phorge, over real HTTP: runs only when PHORGE_ROOT is set.

PHORGE_ROOT must be a Phorge checkout (with arcanist beside it) whose database is set up
(``bin/storage upgrade``); its PHP taskmasters should be stopped, as in production with the
bridge. The tests install the extension into that checkout, create two accounts through
Phorge's own classes (``bridgetestadmin``, an administrator, and ``bridgetestuser``) with
API tokens, and call Phorge at PHORGE_URL, or else at ``phabricator.base-uri`` through a
``php -S`` server they start when that URI is on this machine. They create a Maniphest
task to get real queue rows, and cancel the rows they created when done.

    PHORGE_ROOT=/srv/phorge python -m pytest tests/phorge/test_conduit_phorge.py
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from phorge_env import Phorge, phorge_root, php_server

from bridge.errors import ConduitAuthError
from bridge.handlers.api import PermanentFailure, TaskContext, TemporaryFailure
from bridge.handlers.outcome import run_handlers
from bridge.phorge.extension import check, install
from bridge.phorge.php import http_build_query
from bridge.queue.model import Outcome
from bridge.transports.conduit.client import ConduitClient
from bridge.transports.conduit.feed import FeedPublisherHTTPHandler
from bridge.transports.conduit.handler import ConduitProxyHandler

# Runs inside Phorge (scripts/init/init-script.php): the test's window on Phorge's side.
HELPER = r"""<?php
$root = $argv[1];
$command = $argv[2];
require_once $root.'/scripts/init/init-script.php';
require_once $argv[0].'.accounts.php';
require_once $argv[0].'.effects.php';
$viewer = PhabricatorUser::getOmnipotentUser();

function bridge_test_rows($min_id) {
  $task = new PhabricatorWorkerActiveTask();
  $data = new PhabricatorWorkerTaskData();
  $conn = $task->establishConnection('r');
  return queryfx_all(
    $conn,
    'SELECT t.id, t.taskClass, t.failureCount, t.priority, t.objectPHID,
        t.containerPHID, t.leaseOwner, d.data FROM %T t JOIN %T d ON d.id = t.dataID
      WHERE t.id > %d ORDER BY t.id',
    $task->getTableName(),
    $data->getTableName(),
    $min_id);
}

switch ($command) {
  case 'users':
    $tokens = array();
    foreach (array('bridgetestadmin' => true, 'bridgetestuser' => false) as $name => $admin) {
      $user = phorge_bridge_account($viewer, $name, $admin);
      $tokens[$name] = phorge_bridge_api_token($viewer, $user);
    }
    echo json_encode($tokens);
    break;
  case 'env':
    echo json_encode(array(
      'baseURI' => PhabricatorEnv::getEnvConfig('phabricator.base-uri'),
      'hooks' => PhabricatorEnv::getEnvConfig('feed.http-hooks'),
      'silent' => PhabricatorEnv::getEnvConfig('phabricator.silent'),
    ));
    break;
  case 'maxid':
    $task = new PhabricatorWorkerActiveTask();
    $row = queryfx_one(
      $task->establishConnection('r'),
      'SELECT MAX(id) AS m FROM %T',
      $task->getTableName());
    echo json_encode((int)$row['m']);
    break;
  case 'rows':
    echo json_encode(bridge_test_rows((int)$argv[3]));
    break;
  case 'cancel':
    foreach (array_slice($argv, 3) as $id) {
      $task = id(new PhabricatorWorkerActiveTask())->load((int)$id);
      if ($task && !$task->getLeaseOwner()) {
        $task->archiveTask(PhabricatorWorkerArchiveTask::RESULT_CANCELLED, 0);
      }
    }
    break;
  case 'body':
    // What FeedPublisherHTTPWorker::doWork() would POST for this story.
    $story = id(new PhabricatorFeedQuery())
      ->setViewer($viewer)
      ->withChronologicalKeys(array($argv[3]))
      ->executeOne();
    echo phorge_bridge_hook_body($story);
    break;
}
"""


class ConduitPhorge(Phorge):
    """The Phorge under test, with this module's helper commands and its HTTP address."""

    def rows(self, after: int) -> list[dict[str, Any]]:
        return self.php("rows", str(after))

    def client(self, token: str) -> ConduitClient:
        return ConduitClient(self.url, token, read_timeout=120)


@pytest.fixture(scope="module")
def phorge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConduitPhorge]:
    root = phorge_root()
    install(root)
    assert check(root), "installed extension is not current"
    work = tmp_path_factory.mktemp("phorge")
    instance = ConduitPhorge.with_helper(root, work, HELPER)
    url = os.environ.get("PHORGE_URL") or instance.php("env")["baseURI"]
    instance.url = url.rstrip("/")
    if os.environ.get("PHORGE_URL"):
        yield instance
    else:
        with php_server(root, url, work):
            yield instance


@pytest.fixture(scope="module")
def tokens(phorge: ConduitPhorge) -> dict[str, str]:
    return phorge.php("users")


def proxy_task(row: dict[str, Any]) -> TaskContext:
    return TaskContext(
        id=int(row["id"]),
        task_class=row["taskClass"],
        data=json.loads(row["data"]),
        failure_count=int(row["failureCount"]),
        priority=int(row["priority"]),
        object_phid=row["objectPHID"],
        container_phid=row["containerPHID"],
        raw_data=row["data"],
    )


def execute_params(**overrides: Any) -> dict[str, Any]:
    params = {
        "taskID": 1,
        "taskClass": "PhabricatorTestWorker",
        "data": "{}",
        "failureCount": 0,
        "priority": 2000,
        "objectPHID": None,
        "containerPHID": None,
    }
    params.update(overrides)
    return params


# -- who may call ------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["worker.execute", "worker.feedstory"])
def test_anonymous_calls_are_refused(phorge: ConduitPhorge, method: str) -> None:
    params = execute_params() if method == "worker.execute" else {"key": "1"}
    response = requests.post(
        f"{phorge.url}/api/{method}",
        data={"params": json.dumps(params), "output": "json"},
        timeout=60,
    )
    envelope = response.json()
    assert envelope["result"] is None
    assert envelope["error_code"] in {"ERR-INVALID-SESSION", "ERR-INVALID-AUTH"}


@pytest.mark.parametrize("method", ["worker.execute", "worker.feedstory"])
def test_non_admin_token_is_refused(
    phorge: ConduitPhorge, tokens: dict[str, str], method: str
) -> None:
    params = execute_params() if method == "worker.execute" else {"key": "1"}
    with pytest.raises(ConduitAuthError) as info:
        phorge.client(tokens["bridgetestuser"]).call(method, params)
    assert info.value.error_code == "ERR-BRIDGE-PERMISSION"
    assert "not an administrator" in (info.value.error_info or "")


def test_invalid_token_is_refused(phorge: ConduitPhorge) -> None:
    with pytest.raises(ConduitAuthError) as info:
        phorge.client("api-" + "0" * 28).call("worker.execute", execute_params())
    assert info.value.error_code == "ERR-INVALID-AUTH"


# -- what the admin gets -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "failure_count", "expected"),
    [
        ("{}", 0, {"result": "success"}),
        (
            '{"doWork":"fail-temporary","getWaitBeforeRetry":17}',
            0,
            {"result": "failure", "retryWait": 17, "message": "Exception: Temporary failure!"},
        ),
        ('{"doWork":"fail-temporary"}', 3, {"result": "failure", "retryWait": 300}),
        ('{"doWork":"fail-permanent"}', 0, {"result": "permanent-failure"}),
        ('{"getMaximumRetryCount":3}', 3, {"result": "success"}),
        ('{"getMaximumRetryCount":3}', 4, {"result": "permanent-failure"}),
        ('{"getRequiredLeaseTime":9000}', 0, {"result": "success", "requiredLease": 9000}),
    ],
)
def test_test_worker_outcomes(
    phorge: ConduitPhorge,
    tokens: dict[str, str],
    data: str,
    failure_count: int,
    expected: dict[str, Any],
) -> None:
    result = phorge.client(tokens["bridgetestadmin"]).call(
        "worker.execute", execute_params(data=data, failureCount=failure_count)
    )
    assert {key: result[key] for key in expected} == expected
    assert result["followups"] == []


@pytest.mark.parametrize(
    ("task_class", "message"),
    [
        ("BridgeTestNoSuchWorker", "does not exist"),
        ("PhabricatorUser", "does not extend PhabricatorWorker"),
        ("FeedPushWorker", "is abstract"),
        ("../etc/passwd", "not a valid class name"),
    ],
)
def test_classes_that_cannot_run_fail_permanently(
    phorge: ConduitPhorge, tokens: dict[str, str], task_class: str, message: str
) -> None:
    handler = ConduitProxyHandler(phorge.client(tokens["bridgetestadmin"]))
    task = TaskContext(
        id=1, task_class=task_class, data={}, failure_count=0, priority=2000, raw_data="{}"
    )
    with pytest.raises(PermanentFailure, match=message):
        handler.run(task)


def test_proxy_does_not_touch_the_queue(phorge: ConduitPhorge, tokens: dict[str, str]) -> None:
    before = phorge.rows(0)
    handler = ConduitProxyHandler(phorge.client(tokens["bridgetestadmin"]))
    task = TaskContext(
        id=10**9, task_class="PhabricatorTestWorker", data={}, failure_count=0, priority=1,
        raw_data='{"doWork":"fail-temporary","getWaitBeforeRetry":5}',
    )  # fmt: skip
    with pytest.raises(TemporaryFailure) as info:
        handler.run(task)
    assert info.value.delay == 5
    assert phorge.rows(0) == before


def test_one_request_runs_a_batch_each_task_with_its_own_outcome(
    phorge: ConduitPhorge, tokens: dict[str, str]
) -> None:
    """The extension runs a batch in order, in one request, and answers each task's end;
    a malformed entry refuses the whole batch before anything runs."""
    proxy = ConduitProxyHandler(phorge.client(tokens["bridgetestadmin"]), batch=16)
    ends = ['{}', '{"doWork":"fail-temporary","getWaitBeforeRetry":7}',
            '{"doWork":"fail-permanent"}', '{}']  # fmt: skip
    tasks = [
        TaskContext(id=10**9 + i, task_class="PhabricatorTestWorker", data=json.loads(raw),
                    failure_count=0, priority=1, raw_data=raw)
        for i, raw in enumerate(ends)
    ]  # fmt: skip
    before = phorge.rows(0)
    results = run_handlers(proxy, tasks)
    assert [r.outcome for r in results] == [
        Outcome.SUCCESS,
        Outcome.FAILURE,
        Outcome.PERMANENT_FAILURE,
        Outcome.SUCCESS,
    ]
    assert results[1].delay == 7
    assert proxy.batch_limit == 16, "the installed extension takes batches"
    assert phorge.rows(0) == before
    client = phorge.client(tokens["bridgetestadmin"])
    bad = [{"taskID": 1, "taskClass": "PhabricatorTestWorker", "data": "{}",
            "failureCount": 0, "priority": 1}, {"taskID": 0}]  # fmt: skip
    with pytest.raises(Exception, match="taskID") as refused:
        client.call("worker.execute", {"tasks": bad})
    assert getattr(refused.value, "error_code", None) == "ERR-BRIDGE-PARAMETER"


# -- Phorge's own task classes, end to end ------------------------------------------------------


def test_real_feed_publication(phorge: ConduitPhorge, tokens: dict[str, str]) -> None:
    """Create a task in Maniphest, run the publish and feed workers through the proxy, and
    check the feed hook body against PHP's own http_build_query."""
    admin = phorge.client(tokens["bridgetestadmin"])
    proxy = ConduitProxyHandler(admin)
    start = phorge.php("maxid")
    created: list[int] = []
    try:
        edit = admin.call(
            "maniphest.edit",
            {
                "transactions": [
                    {"type": "title", "value": "bridge test ~ & ü 100% [x]"},
                    {"type": "description", "value": "hello *world*"},
                ]
            },
        )
        phid = edit["object"]["phid"]
        rows = phorge.rows(start)
        created += [int(r["id"]) for r in rows]
        (publish,) = [
            r
            for r in rows
            if r["taskClass"] == "PhabricatorApplicationTransactionPublishWorker"
            and r["objectPHID"] == phid
        ]
        proxy.run(proxy_task(publish))

        rows = phorge.rows(int(publish["id"]))
        created += [int(r["id"]) for r in rows]
        (feed,) = [r for r in rows if r["taskClass"] == "FeedPublisherWorker"]
        feed_task = proxy_task(feed)
        proxy.run(feed_task)
        key = str(json.loads(feed["data"])["key"])
        env = phorge.php("env")
        hook_followups = [
            f for f in feed_task.followups if f.task_class == "FeedPublisherHTTPWorker"
        ]
        assert [f.data for f in hook_followups] == [
            {"key": key, "uri": uri} for uri in env["hooks"]
        ]
        assert all(f.priority == int(feed["priority"]) for f in hook_followups)

        info = admin.call("worker.feedstory", {"key": key})
        assert info["key"] == key
        assert info["hookURIs"] == env["hooks"]
        assert info["story"]["storyAuthorPHID"].startswith("PHID-USER-")
        fields = {
            name: info["story"][name]
            for name in (
                "storyID", "storyType", "storyData", "storyAuthorPHID", "storyText", "epoch",
            )
        }  # fmt: skip
        expected = phorge.php_text("body", key)
        assert http_build_query(fields) == expected
        if not env["silent"]:
            _deliver_to_local_hook(admin, key, expected)
    finally:
        leftovers = [str(i) for i in created if i]
        if leftovers:
            phorge.php("cancel", *leftovers)


def _deliver_to_local_hook(admin: ConduitClient, key: str, expected_body: str) -> None:
    """Deliver the real story to a local receiver (added to the allow-list Phorge returned)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from test_conduit_fakes import FakeServer, Reply

    with FakeServer(lambda request: Reply(200, b"ok")) as receiver:
        uri = receiver.url + "/hook"

        class LocalHooks:
            base_url = admin.base_url

            def call(self, method: str, params: Any = None, **kwargs: Any) -> Any:
                result = admin.call(method, params, **kwargs)
                result["hookURIs"] = [*result["hookURIs"], uri]
                return result

        task = TaskContext(
            id=1,
            task_class="FeedPublisherHTTPWorker",
            data={"key": key, "uri": uri},
            failure_count=0,
            priority=2000,
        )
        FeedPublisherHTTPHandler(LocalHooks()).run(task)  # type: ignore[arg-type]
    (request,) = receiver.requests
    assert request.body == expected_body.encode()
