"""The bench's count of database requests: its "commits / statements / round trips per
task" figures are only as true as this split of a query into statements."""

from __future__ import annotations

import pytest
from benchkit import bridge_api, hook
from benchkit.records import Counters, RecordWriter, read_records

OUTCOME_THEN_CHECK = (
    b"START TRANSACTION;INSERT INTO worker_archivetask (id) SELECT id FROM worker_activetask "
    b"WHERE id = 7 AND `leaseOwner` = 'bridge:host:1:1700000000:ab:1';DELETE FROM "
    b"worker_activetask WHERE id = 7;COMMIT;SELECT id FROM worker_activetask WHERE id = 8"
)


def counted(query: bytes) -> dict[str, int]:
    before = Counters(*hook.counters().snapshot())
    hook.count_query(query)
    after = Counters(*hook.counters().snapshot()) - before
    return {k: v for k, v in vars(after).items() if v}


def test_a_batch_round_trip_is_one_request_of_five_statements_one_commit():
    assert counted(OUTCOME_THEN_CHECK) == {
        "round_trips": 1,
        "begins": 1,
        "commits": 1,
        "statements": 3,
    }


@pytest.mark.parametrize(
    "query",
    [
        b"SELECT 'a;b' FROM t;SELECT 1",
        b'SELECT "a;b" FROM t;SELECT 1',
        b"SELECT `odd;name` FROM t;SELECT 1",
        b"SELECT 'it\\'s; fine' FROM t;SELECT 1",
        b"SELECT '' FROM t; ;SELECT 1;",
    ],
    ids=["single-quoted", "double-quoted", "identifier", "escaped-quote", "empty-parts"],
)
def test_separators_inside_quotes_do_not_split_statements(query):
    assert counted(query) == {"round_trips": 1, "statements": 2}


def test_a_query_without_separator_is_one_statement():
    assert hook.statements(b"COMMIT") == [b"COMMIT"]
    assert counted(b"commit") == {"round_trips": 1, "commits": 1}


def test_a_cursor_execute_is_counted_by_its_sql_before_the_parameters_go_in():
    template = OUTCOME_THEN_CHECK.decode().replace("'bridge:host:1:1700000000:ab:1'", "%s")
    before = Counters(*hook.counters().snapshot())
    for _ in range(3):  # split once, counted every time
        hook.count_template(template)
    after = Counters(*hook.counters().snapshot()) - before
    assert (after.round_trips, after.begins, after.commits, after.statements) == (3, 3, 3, 9)


def test_each_phorge_task_run_is_one_record_with_the_counters_at_its_end(tmp_path, monkeypatch):
    observed = {}
    monkeypatch.setattr(
        bridge_api, "observe_runs", lambda started, ended: observed.update(s=started, e=ended)
    )
    hook.record_runs(RecordWriter(tmp_path), "bridge.run")
    observed["s"](7)
    observed["s"](8)  # a batch: both runs are open at once
    observed["e"](8)
    hook.count_query(b"COMMIT")
    observed["e"](7)

    inner, outer = read_records(tmp_path)
    assert [inner.task_id, outer.task_id] == [8, 7]
    assert outer.start <= inner.start <= inner.end <= outer.end
    assert outer.counters - inner.counters == Counters(commits=1, round_trips=1)
    assert outer.counters == Counters(*hook.counters().snapshot())
