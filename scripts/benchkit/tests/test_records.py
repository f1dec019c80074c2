"""What measured processes record, and the counts the report divides."""

from __future__ import annotations

import os

import pytest
from benchkit import records
from benchkit.records import Counters, Record, RecordWriter


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        (b"START TRANSACTION;INSERT INTO a SELECT 1;DELETE FROM b WHERE id = 7;COMMIT;SELECT 8",
         (3, 1)),
        (b"SELECT 'a;b' FROM t;SELECT `odd;name`; SELECT 'it\\'s; fine'", (3, 0)),
        (b"SELECT '' FROM t; ;SELECT 1;", (2, 0)),
        ("commit", (0, 1)),
        ("SELECT %s; SELECT 2", (2, 0)),  # a cursor's template: parameters add no separator
    ],
)  # fmt: skip
def test_a_query_is_split_into_statements_and_commits(query, expected):
    assert records.split(query) == expected


def test_a_record_reads_back_and_a_forked_child_writes_its_own_file(tmp_path):
    writer = RecordWriter(tmp_path)
    line = ("bridge.run", 42, 1700000000.25, 1700000000.5, 0.000125)
    writer.write(*line, counters=Counters(3, 1, 2))
    child = os.fork()
    if child == 0:  # pragma: no cover
        try:
            writer.write("child", None, 1.0, 2.0, 0.5, counters=Counters())
        finally:
            os._exit(0)
    assert os.waitpid(child, 0)[1] == 0
    by_pid = {r.pid: r for r in records.read_records(tmp_path)}
    assert by_pid[os.getpid()] == Record(os.getpid(), *line, Counters(3, 1, 2))
    assert (by_pid[child].name, by_pid[child].task_id) == ("child", None)


def test_requests_between_two_instants_come_from_each_processes_latest_counters():
    def rec(pid: int, end: float, *counts: int) -> Record:
        return Record(pid, "bridge.run", 1, end - 0.1, end, 0.0, Counters(*counts))

    found = [
        rec(1, 10.0, 5, 1, 5), rec(1, 12.0, 9, 3, 8),
        rec(1, 11.5, 10, 3, 9),  # a thread's line, written late
        rec(1, 20.0, 99, 9, 99),  # after the run: not counted
        rec(2, 11.0, 4, 1, 2),  # a process that started during the run
    ]  # fmt: skip
    assert records.counters_between(found, since=10.0, until=12.0) == Counters(9, 3, 6)
