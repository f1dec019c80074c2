"""One reader of a task spec in PHP (``PhorgeBridgeTaskRun::newTaskFromSpec``): a
malformed spec is refused alike by ``worker.execute`` (an ERR-BRIDGE-PARAMETER error)
and by the PHP runner (an "error" answer), with the same message naming the field.

Runs inside a real Phorge, as ``test_conduit_phorge.py`` does: collected only when
PHORGE_ROOT is set (``tests/conftest.py``; the admin account ``bridgetestadmin`` is shared
with that module).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from phorge_env import Phorge, phorge_root, php_server

from bridge.phorge.extension import check, install
from bridge.transports.conduit.client import ConduitClient
from bridge.transports.php_runner.process import RunnerCommand, RunnerProcess

HELPER = r"""<?php
require_once $argv[1].'/scripts/init/init-script.php';
require_once $argv[0].'.accounts.php';
$viewer = PhabricatorUser::getOmnipotentUser();
$admin = phorge_bridge_account($viewer, 'bridgetestadmin', true);
echo json_encode(array(
  'baseURI' => PhabricatorEnv::getEnvConfig('phabricator.base-uri'),
  'token' => phorge_bridge_api_token($viewer, $admin),
));
"""

GOOD = {"taskID": 1, "taskClass": "PhabricatorTestWorker", "data": "{}",
        "failureCount": 0, "priority": 1}  # fmt: skip
# Each malformed spec (None drops the field) and the field its refusal must name.
MALFORMED: dict[str, tuple[dict[str, Any], str, str]] = {
    "missing-taskID": ({"taskID": None}, "taskID", "an integer no smaller than 1"),
    "taskID-0": ({"taskID": 0}, "taskID", "an integer no smaller than 1"),
    "data-not-a-string": ({"data": {"a": 1}}, "data", "the raw JSON string"),
    "failureCount-negative": ({"failureCount": -1}, "failureCount", "no smaller than 0"),
    "failureCount-not-a-number": ({"failureCount": "x"}, "failureCount", "no smaller than 0"),
}


def malformed(name: str) -> dict[str, Any]:
    spec = {**GOOD, **MALFORMED[name][0]}
    return {key: value for key, value in spec.items() if value is not None}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConduitClient]:
    root = phorge_root()
    install(root)
    assert check(root), "installed extension is not current"
    work = tmp_path_factory.mktemp("phorge-spec")
    found = Phorge.with_helper(root, work, HELPER).php()
    url = (os.environ.get("PHORGE_URL") or found["baseURI"]).rstrip("/")
    client = ConduitClient(url, found["token"], read_timeout=120)
    if os.environ.get("PHORGE_URL"):
        yield client
    else:
        with php_server(root, url, work):
            yield client


@pytest.fixture(scope="module")
def runner() -> Iterator[RunnerProcess]:
    process = RunnerProcess(RunnerCommand("php", Path(phorge_root())))
    try:
        process.ready(120)
        yield process
    finally:
        process.stop()


def conduit_refusal(client: ConduitClient, params: dict[str, Any]) -> str:
    with pytest.raises(Exception) as refused:
        client.call("worker.execute", params)
    assert getattr(refused.value, "error_code", None) == "ERR-BRIDGE-PARAMETER", refused.value
    return str(getattr(refused.value, "error_info", ""))


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_spec_is_refused_alike(
    name: str, client: ConduitClient, runner: RunnerProcess
) -> None:
    _, field, rule = MALFORMED[name]
    spec = malformed(name)
    answer = runner.request({"op": "run", "task": spec}, 60)
    assert answer["type"] == "error", answer
    message = answer["message"]
    assert message.startswith(f'Parameter "{field}" must be') and rule in message
    # The same words from worker.execute, for one task and in a batch (nothing runs).
    assert conduit_refusal(client, spec) == message
    assert conduit_refusal(client, {"tasks": [GOOD, spec]}) == message
    for op in ("describe", "wait"):
        assert runner.request({"op": op, "task": spec, "message": "x"}, 60) == answer


def test_a_good_spec_still_runs(client: ConduitClient, runner: RunnerProcess) -> None:
    assert runner.request({"op": "run", "task": GOOD}, 60)["result"] == "success"
    assert client.call("worker.execute", GOOD)["result"] == "success"
    assert runner.request({"op": "unknown"}, 60) == {"type": "error", "message": "unknown op"}
