"""bridge.queue.model: Phorge's constants, input checks, task states and bin/worker's
selectors. No database. (JSON as PHP reads it: ``test_php.py``.)"""

from __future__ import annotations

import pytest

from bridge.queue import model
from bridge.queue.model import (
    MAX_UINT32,
    YIELD_OWNER,
    NewTask,
    State,
    Task,
    TaskFilter,
    check_owner,
    check_priority,
    check_seconds,
    check_task_class,
    new_owner,
    state_of,
)

NOW = 1_700_000_000


def test_phorges_wire_constants():
    assert (model.RESULT_SUCCESS, model.RESULT_FAILURE, model.RESULT_CANCELLED) == (0, 1, 2)
    assert (YIELD_OWNER, model.PRIORITY_DEFAULT) == ("(yield)", 2000)
    assert (model.DEFAULT_LEASE_SECONDS, model.DEFAULT_RETRY_WAIT) == (7200, 300)
    assert (model.MIN_YIELD_SECONDS, model.MAX_NAME) == (5, 64)


# -- input checks --------------------------------------------------------------------------


@pytest.mark.parametrize("task_class", ["PhabricatorSearchWorker", "W", "C" * 64])
def test_task_class_accepted(task_class):
    assert check_task_class(task_class) == task_class


@pytest.mark.parametrize("task_class", ["", "C" * 65, None, 5, b"Worker"])
def test_task_class_refused(task_class):
    with pytest.raises(ValueError):
        check_task_class(task_class)


@pytest.mark.parametrize("priority", [1, 1000, 2000, 4000, MAX_UINT32])
def test_priority_accepted(priority):
    assert check_priority(priority) == priority


@pytest.mark.parametrize("priority", [0, -1, "5", True, False, 2.0, None, MAX_UINT32 + 1])
def test_priority_refused(priority):
    with pytest.raises(ValueError, match="positive integer"):
        check_priority(priority)


@pytest.mark.parametrize("owner", ["o", "12345:1700000000:host:1", "o" * 64])
def test_owner_accepted(owner):
    assert check_owner(owner) == owner


@pytest.mark.parametrize("owner", ["", "o" * 65, None, YIELD_OWNER, 7])
def test_owner_refused(owner):
    with pytest.raises(ValueError):
        check_owner(owner)


@pytest.mark.parametrize("value", [-1, True, 1.5, "10", None, MAX_UINT32 + 1])
def test_seconds_refused(value):
    with pytest.raises(ValueError):
        check_seconds("wait", value)


def test_seconds_minimum():
    assert check_seconds("wait", 0) == 0
    assert check_seconds("lease", 1, minimum=1) == 1
    with pytest.raises(ValueError):
        check_seconds("lease", 0, minimum=1)


# -- NewTask -------------------------------------------------------------------------------


def test_new_task_defaults_are_phorges():
    task, text = NewTask("PhabricatorSearchWorker", {"a": 1}).validated()
    fields = (task.priority, task.delay_until, task.object_phid, text)
    assert fields == (2000, None, None, '{"a":1}')


@pytest.mark.parametrize(
    "fields",
    [
        {"task_class": ""},
        {"priority": 0},
        {"data": {1}},
        {"delay_until": -1},
        {"delay_until": "tomorrow"},
        {"object_phid": "P" * 65},
        {"container_phid": b"PHID-REPO-1"},
    ],
)
def test_new_task_validated_refuses_bad_fields(fields):
    with pytest.raises(ValueError):
        NewTask(**{"task_class": "W", **fields}).validated()


# -- owners --------------------------------------------------------------------------------


def test_new_owner_is_unique_and_fits_the_column():
    owners = {new_owner("bridge", NOW) for _ in range(1000)}
    assert len(owners) == 1000
    assert all(len(owner) <= 64 and owner.startswith("bridge:") for owner in owners)


def test_new_owner_stays_unique_with_a_long_prefix_and_host(monkeypatch):
    # BRIDGE_OWNER_PREFIX may be 24 characters; hosts and pids can be long too. The
    # per-call sequence must survive the cut to 64 characters, or two leases share an
    # owner and each one's final read returns the other's rows.
    monkeypatch.setattr(model.socket, "gethostname", lambda: "h" * 40)
    monkeypatch.setattr(model.os, "getpid", lambda: 4194304)
    owners = [new_owner("p" * 24, 1764460000) for _ in range(3)]
    assert all(len(owner) <= 64 for owner in owners)
    assert len(set(owners)) == 3, owners


# -- states --------------------------------------------------------------------------------


def leased_at(epoch: int) -> str:
    """An owner string as PHP writes it (pid:epoch:host:sequence), leased at ``epoch``."""
    return f"4242:{epoch}:web01:1"


@pytest.mark.parametrize(
    "owner, expires, failure_time, state",
    [
        (None, None, None, State.QUEUED),
        (None, NOW - 10, None, State.QUEUED),  # freed, or delayed until the past
        (None, 0, None, State.QUEUED),  # retried (leaseExpires 0)
        (None, NOW, None, State.QUEUED),  # due this second
        (None, NOW + 10, None, State.DELAYED),
        (leased_at(NOW), NOW + 10, None, State.LEASED),
        (leased_at(NOW - 60), NOW, None, State.EXPIRED),
        (leased_at(NOW - 60), NOW - 10, None, State.EXPIRED),
        (leased_at(NOW - 60), None, None, State.EXPIRED),
        (leased_at(NOW), NOW + 300, NOW, State.RETRY_WAIT),  # failed in its lease's second
        (leased_at(NOW - 20), NOW + 300, NOW - 5, State.RETRY_WAIT),
        (leased_at(NOW - 400), NOW - 1, NOW - 301, State.RETRY_DUE),  # wait over: re-leasable
        (leased_at(NOW - 100), NOW + 7000, NOW - 400, State.LEASED),  # re-leased after it
        (f"bridge:{leased_at(NOW - 100)}", NOW + 7000, NOW - 400, State.LEASED),
        ("not-an-owner-string", NOW + 300, NOW - 5, State.RETRY_WAIT),
        (YIELD_OWNER, NOW + 5, None, State.YIELDED),
        (YIELD_OWNER, NOW - 3600, None, State.YIELD_ENDED),  # awakened
    ],
)
def test_state_of(owner, expires, failure_time, state):
    assert state_of(owner, expires, failure_time, NOW) is state


def _task(**fields) -> Task:
    row = {
        "id": 7,
        "task_class": "PhabricatorSearchWorker",
        "lease_owner": None,
        "lease_expires": None,
        "failure_count": 0,
        "data_id": 3,
        "priority": 2000,
        "object_phid": None,
        "container_phid": None,
        "date_created": NOW,
        "date_modified": NOW,
        "server_time": NOW,
    }
    return Task(**{**row, **fields})


def test_task_state_is_judged_by_the_database_clock():
    task = _task(lease_owner="o", lease_expires=NOW + 60)
    assert task.state is State.LEASED  # whatever this host's clock says
    later = _task(lease_owner="o", lease_expires=NOW + 60, server_time=NOW + 61)
    assert later.state is State.EXPIRED
    assert _task(archived=True, result=0).state is State.ARCHIVED
    assert _task().label == "PhabricatorSearchWorker#7"


# -- bin/worker's selectors ----------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"active": True, "archived": True}, "both active and archived"),
        ({"min_failure_count": 3, "max_failure_count": 2}, "failure count"),
        ({"min_priority": 3000, "max_priority": 2000}, "priority"),
        ({"limit": 0}, "limit"),
        ({"limit": -1}, "limit"),
    ],
)
def test_task_filter_refusals(fields, message):
    with pytest.raises(ValueError, match=message):
        TaskFilter(**fields)


def test_task_filter_accepts_equal_bounds():
    selector = TaskFilter(min_failure_count=2, max_failure_count=2, min_priority=5, max_priority=5)
    assert selector.constrained


@pytest.mark.parametrize(
    "fields",
    [
        {"ids": [1]},
        {"classes": ["W"]},
        {"active": True},
        {"archived": True},
        {"container_phids": ["PHID-REPO-1"]},
        {"object_phids": ["PHID-TASK-1"]},
        {"min_failure_count": 0},
        {"max_failure_count": 0},
        {"min_priority": 1},
        {"max_priority": 1},
    ],
)
def test_task_filter_constrained_by_any_selector(fields):
    assert TaskFilter(**fields).constrained


def test_task_filter_unconstrained():
    assert not TaskFilter().constrained
    assert not TaskFilter(limit=5).constrained  # bin/worker: --limit alone selects nothing
