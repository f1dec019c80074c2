"""ConduitProxyHandler against a real local HTTP server playing Phorge's worker.execute."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from conduit_fakes import (
    TOKEN,
    FakeServer,
    Reply,
    conduit_error,
    conduit_result,
    execute_answer,
)

from bridge.handlers.api import HandBack, PermanentFailure, TaskContext, TemporaryFailure, Yield
from bridge.handlers.outcome import run_handler
from bridge.queue.model import NewTask, Outcome
from bridge.transports.conduit.client import ConduitClient
from bridge.transports.conduit.handler import PHORGE_REQUIRED_LEASES, ConduitProxyHandler
from bridge.transports.task_run import apply_result, execute_params

RAW = '{"key":7713765376809813936,"uri":"https:\\/\\/hooks.example\\/x","n":[]}'


def make_task(**fields: Any) -> TaskContext:
    values: dict[str, Any] = {
        "id": 42,
        "task_class": "PhabricatorSearchWorker",
        "data": json.loads(RAW),
        "failure_count": 2,
        "priority": 3500,
        "object_phid": "PHID-TASK-abc",
        "container_phid": None,
        "raw_data": RAW,
    }
    values.update(fields)
    return TaskContext(**values)


def outcome(result: dict[str, Any]) -> dict[str, Any]:
    return execute_answer(**result)


def run_against(reply: Reply, task: TaskContext | None = None, **client_kwargs: Any):
    """Run the proxy for one task against a server answering ``reply``; return both."""
    task = task or make_task()
    with FakeServer(lambda request: reply) as server:
        handler = ConduitProxyHandler(ConduitClient(server.url, TOKEN, **client_kwargs))
        try:
            handler.run(task)
            error = None
        except Exception as exc:
            error = exc
    return task, server, error


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_request_parameters_carry_the_trace_context_as_a_parameter_and_a_header() -> None:
    task = make_task(traceparent=TRACEPARENT)
    _, server, error = run_against(conduit_result(outcome({"result": "success"})), task)
    assert error is None
    (request,) = server.requests
    assert request.path == "/api/worker.execute"
    assert request.headers["traceparent"] == TRACEPARENT
    params = request.params
    assert params.pop("__conduit__") == {"token": TOKEN}
    assert params == {
        "taskID": 42,
        "taskClass": "PhabricatorSearchWorker",
        "data": RAW,  # the stored string, byte for byte
        "failureCount": 2,
        "priority": 3500,
        "objectPHID": "PHID-TASK-abc",
        "containerPHID": None,
        "traceparent": TRACEPARENT,
    }


def test_a_proxied_success_archives_the_duration_php_measured() -> None:
    reply = conduit_result(outcome({"result": "success", "duration": 104_000}))
    with FakeServer(lambda request: reply) as server:
        handler = ConduitProxyHandler(ConduitClient(server.url, TOKEN))
        result = run_handler(handler, make_task())
    assert (result.outcome, result.duration_us) == (Outcome.SUCCESS, 104_000)


def test_data_fallback_without_raw_string() -> None:
    task = make_task(raw_data=None, data={"key": 7713765376809813936})
    assert json.loads(execute_params(task)["data"]) == {"key": 7713765376809813936}
    assert execute_params(make_task(raw_data=None, data=2))["data"] == "2"


def test_success_queues_followups() -> None:
    followups = [
        {
            "taskClass": "FeedPublisherHTTPWorker",
            "data": {"key": 7713765376809813936, "uri": "https://h.example/"},
            "options": {
                "priority": 3500,
                "objectPHID": None,
                "containerPHID": None,
                "delayUntil": None,
            },
        },
        {
            "taskClass": "PhabricatorSearchWorker",
            "data": [],
            "options": {
                "priority": 1000,
                "objectPHID": "PHID-X",
                "containerPHID": "PHID-Y",
                "delayUntil": 1900000000,
            },
        },
        {"taskClass": "Bare", "data": {"a": 1}, "options": []},
        {"no": "class"},
    ]
    result = outcome({"result": "success", "duration": 1234, "followups": followups})
    task, _, error = run_against(conduit_result(result))
    assert error is None
    assert task.followups == (
        NewTask(
            "FeedPublisherHTTPWorker",
            {"key": 7713765376809813936, "uri": "https://h.example/"},
            3500,
            None,
            None,
            None,
        ),
        NewTask("PhabricatorSearchWorker", [], 1000, "PHID-X", "PHID-Y", 1900000000),
        NewTask("Bare", {"a": 1}, None, None, None, None),
    )


def test_yield() -> None:
    _, _, error = run_against(conduit_result(outcome({"result": "yield", "yieldDuration": 90})))
    assert isinstance(error, Yield) and error.delay == 90
    # Phorge never yields for less than 5 s.
    _, _, error = run_against(conduit_result(outcome({"result": "yield", "yieldDuration": 0})))
    assert isinstance(error, Yield) and error.delay == 5


def test_permanent_failure() -> None:
    message = "Task class 'NoSuchWorker' does not exist!"
    reply = conduit_result(outcome({"result": "permanent-failure", "message": message}))
    task, _, error = run_against(reply)
    assert isinstance(error, PermanentFailure) and str(error) == message
    assert task.followups == ()


def test_failure_carries_the_workers_wait() -> None:
    reply = conduit_result(
        outcome({"result": "failure", "retryWait": 45, "message": "Exception: Temporary failure!"})
    )
    task, _, error = run_against(reply)
    assert isinstance(error, TemporaryFailure)
    assert (str(error), error.delay) == ("Exception: Temporary failure!", 45)
    assert task.followups == ()


def test_unknown_result_is_temporary(caplog: pytest.LogCaptureFixture) -> None:
    _, _, error = run_against(conduit_result(outcome({"result": "maybe"})))
    assert isinstance(error, TemporaryFailure)
    assert "unknown result" in str(error)
    _, _, error = run_against(conduit_result([]))
    assert isinstance(error, TemporaryFailure)


def test_auth_failure_hands_back_and_is_loud(caplog: pytest.LogCaptureFixture) -> None:
    info = f'API token "{TOKEN}" is not valid.'
    _, _, error = run_against(conduit_error("ERR-INVALID-AUTH", info))
    assert isinstance(error, HandBack)  # not the task's failure
    assert "ERR-INVALID-AUTH" in str(error)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and "BRIDGE_CONDUIT_TOKEN" in errors[0].getMessage()
    assert TOKEN not in caplog.text and TOKEN not in str(error)


def test_non_admin_is_an_auth_failure(caplog: pytest.LogCaptureFixture) -> None:
    reply = conduit_error("ERR-BRIDGE-PERMISSION", 'The calling account ("bob") is not an admin.')
    _, _, error = run_against(reply)
    assert isinstance(error, HandBack)
    assert any(r.levelno >= logging.ERROR for r in caplog.records)


def test_missing_extension_is_temporary_and_loud(caplog: pytest.LogCaptureFixture) -> None:
    reply = conduit_error("ERR-CONDUIT-CALL", 'Conduit API method "worker.execute" does not exist.')
    _, _, error = run_against(reply)
    assert isinstance(error, TemporaryFailure)
    assert "install-extension" in caplog.text


@pytest.mark.parametrize(
    ("status", "kind"), [(500, TemporaryFailure), (502, HandBack), (503, HandBack)]
)
def test_5xx(status: int, kind: type) -> None:
    """A 500 is PHP failing on the task (a failure); 502/503 are the web tier (a yield)."""
    _, _, error = run_against(Reply(status, b"<html><body>Service Unavailable</body></html>"))
    assert isinstance(error, kind)
    assert f"HTTP {status}" in str(error) and "Service Unavailable" in str(error)


def test_conduit_core_error_is_temporary() -> None:
    _, _, error = run_against(conduit_error("ERR-CONDUIT-CORE", "Lost connection to MySQL"))
    assert isinstance(error, TemporaryFailure) and "Lost connection" in str(error)


def test_read_only_phorge_yields() -> None:
    _, _, error = run_against(conduit_error("ERR-BRIDGE-READ-ONLY", "read-only"))
    assert isinstance(error, Yield) and error.delay == 300


def test_a_read_timeout_yields_for_phorges_wait() -> None:
    """No failure counted, but PHP may still run it: no second run before that wait."""
    _, _, error = run_against(Reply(delay=1.5), read_timeout=0.2)
    assert isinstance(error, Yield) and error.delay == 300
    assert "timed out" in str(error) and "still be running" in str(error)


def test_long_lease_classes() -> None:
    handler = ConduitProxyHandler(
        ConduitClient("http://127.0.0.1:9", TOKEN, read_timeout=600),
        lease_overrides={"SlowWorker": 7200},
    )
    git = make_task(task_class="PhabricatorRepositoryGitCommitChangeParserWorker")
    assert handler.required_lease(git) == PHORGE_REQUIRED_LEASES[git.task_class] == 86400
    assert handler._read_timeout(git) == 86400 - 60
    assert handler.required_lease(make_task(task_class="SlowWorker")) == 7200
    plain = make_task()
    assert handler.required_lease(plain) is None
    assert handler._read_timeout(plain) == 600


def test_longer_lease_than_held_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    reply = conduit_result(outcome({"result": "success", "requiredLease": 36000}))
    _, _, error = run_against(reply)
    assert error is None
    assert "required lease of 36000s" in caplog.text


def test_warnings_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    task = make_task()
    apply_result(task, outcome({"result": "success", "warnings": ["Dropped follow-up task X"]}))
    assert "Dropped follow-up task X" in caplog.text


def test_it_claims_no_class_so_it_only_serves_as_the_fallback() -> None:
    assert ConduitProxyHandler.task_classes == ()


def test_a_followup_priority_the_queue_refuses_falls_back_to_the_parents(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """PHP writes priority 0; the queue refuses it: queued anyway (not looping the parent),
    with the parent's priority, and said so; a class it can never take is skipped loudly."""
    followups = [
        {"taskClass": "Child", "data": {}, "options": {"priority": 0}},
        {"taskClass": "Child" + "X" * 70, "data": {}, "options": []},
    ]
    reply = conduit_result(outcome({"result": "success", "followups": followups}))
    task, _, error = run_against(reply)
    assert error is None
    # None: the parent's priority, filled in when the follow-up is written.
    assert [(f.task_class, f.priority) for f in task.followups] == [("Child", None)]
    assert "gets the default priority instead of 0" in caplog.text
    assert any(r.levelno == logging.ERROR and "skipped" in r.getMessage() for r in caplog.records)


def test_the_loud_token_error_names_the_token_file_when_that_is_the_setting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, _, error = run_against(
        conduit_error("ERR-INVALID-AUTH", "API token is not valid."),
        token_setting="BRIDGE_CONDUIT_TOKEN_FILE",
    )
    assert isinstance(error, HandBack)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and "operator fixes BRIDGE_CONDUIT_TOKEN_FILE " in errors[0]
