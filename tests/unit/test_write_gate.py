"""The write gate and the errors that close it: one line each way, probes until open."""

from __future__ import annotations

import logging
import sqlite3

import MySQLdb
import pytest
from prometheus_client import REGISTRY

from bridge.engine.writes import WriteGate
from bridge.errors import WritesRefused
from bridge.metrics import count_runs
from bridge.queue.retry import is_transient, refuses_writes, retrying


@pytest.mark.parametrize(
    "error",
    [
        MySQLdb.OperationalError(1290, "The MariaDB server is running with the --read-only option"),
        MySQLdb.OperationalError(1792, "Cannot execute statement in a READ ONLY transaction"),
        MySQLdb.OperationalError(1836, "Running in read-only mode"),
        MySQLdb.OperationalError(1874, "InnoDB is in read only mode"),
        MySQLdb.OperationalError(1114, "The table 'worker_archivetask' is full"),
        MySQLdb.OperationalError(1021, "Disk full"),
        sqlite3.OperationalError("attempt to write a readonly database"),
        sqlite3.OperationalError("database or disk is full"),
    ],
)
def test_refused_writes_are_raised_at_once_not_retried(error):
    calls: list[int] = []

    def write() -> None:
        calls.append(1)
        raise error

    assert refuses_writes(error) and not is_transient(error)
    with pytest.raises(WritesRefused):
        retrying("outcome", write, attempts=5)
    assert calls == [1]


@pytest.mark.parametrize("code", [1205, 1213, 2006, 2013])
def test_lock_conflicts_and_lost_connections_still_retry(code):
    error = MySQLdb.OperationalError(code, "transient")
    assert is_transient(error) and not refuses_writes(error)


def gauge() -> float | None:
    return REGISTRY.get_sample_value("phorge_bridge_database_writes_refused")


def test_the_gate_logs_each_change_once_and_shows_it_in_a_gauge(caplog):
    count_runs()  # the gauge is the metrics' observer's, as a worker installs it
    gate = WriteGate(lambda: None, sleep=lambda _: None)
    with caplog.at_level(logging.INFO, logger="bridge.engine.writes"):
        for _ in range(3):
            gate.refused(WritesRefused("read-only"))
        assert not gate.is_open and gauge() == 1
        gate.accepted()
        gate.accepted()
    assert gate.is_open and gauge() == 0
    assert [r.levelname for r in caplog.records] == ["ERROR", "WARNING"]


def test_waiting_probes_until_writes_are_accepted():
    answers = [WritesRefused("read-only")] * 3
    probes: list[int] = []

    def probe() -> None:
        probes.append(1)
        if answers:
            raise answers.pop()

    gate = WriteGate(probe, sleep=lambda _: None)
    gate.refused(WritesRefused("read-only"))
    assert gate.wait_open(timeout=60)
    assert len(probes) == 4


def test_waiting_gives_up_after_its_timeout():
    def refuse() -> None:
        raise WritesRefused("read-only")

    gate = WriteGate(refuse, interval=0.01)
    gate.refused(WritesRefused("read-only"))
    assert not gate.wait_open(timeout=0.05)
