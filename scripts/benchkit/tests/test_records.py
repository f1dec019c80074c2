"""The bench's per-task records: what a measured process writes is what the bench reads,
the counters stay exact under threads, and a forked worker child writes its own file."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
from benchkit.records import CounterBox, Counters, RecordWriter, read_records


@pytest.fixture
def frequent_switches():
    """Threads switch as often as the interpreter lets them: a race has its best chance."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def test_a_written_record_reads_back(tmp_path: Path):
    writer = RecordWriter(tmp_path)
    writer.write("bridge.run", 42, 1700000000.25, 1700000000.5, 0.000125, (3, 1, 1, 0, 0, 0, 2))
    writer.write("celery.noop", None, 1.0, 2.0, 0.5, (0,) * 7)

    assert (tmp_path / f"{os.getpid()}.rec").read_text().splitlines() == [
        "bridge.run 42 1700000000.250000 1700000000.500000 0.000125 3 1 1 0 0 0 2",
        "celery.noop - 1.000000 2.000000 0.500000 0 0 0 0 0 0 0",
    ]
    first, second = read_records(tmp_path)
    assert (first.pid, first.name, first.task_id, first.cpu) == (
        os.getpid(),
        "bridge.run",
        42,
        0.000125,
    )
    assert first.counters == Counters(statements=3, begins=1, commits=1, round_trips=2)
    assert second.task_id is None


def test_a_record_written_after_a_fork_lands_in_the_childs_own_file(tmp_path: Path):
    writer = RecordWriter(tmp_path)
    writer.write("parent", 1, 1.0, 2.0, 0.5, (0,) * 7)  # the parent's file is open
    child = os.fork()
    if child == 0:  # pragma: no cover (the child's coverage is not collected)
        try:
            writer.write("child", 2, 1.0, 2.0, 0.5, (0,) * 7)
        finally:
            os._exit(0)
    assert os.waitpid(child, 0)[1] == 0
    writer.write("parent", 3, 1.0, 2.0, 0.5, (0,) * 7)

    by_pid = {pid: [] for pid in (os.getpid(), child)}
    for record in read_records(tmp_path):
        by_pid[record.pid].append((record.name, record.task_id))
    assert by_pid == {os.getpid(): [("parent", 1), ("parent", 3)], child: [("child", 2)]}


def test_lines_written_by_racing_threads_are_all_whole(tmp_path: Path, frequent_switches):
    writer = RecordWriter(tmp_path)  # not yet open: the threads race to open it too

    def write(thread: int) -> None:
        for n in range(200):
            writer.write("bridge.run", thread * 1000 + n, 1.0, 2.0, 0.5, (n,) * 7)

    threads = [threading.Thread(target=write, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert [p.name for p in tmp_path.iterdir()] == [f"{os.getpid()}.rec"]
    records = read_records(tmp_path)
    assert sorted(r.task_id for r in records) == [
        t * 1000 + n for t in range(8) for n in range(200)
    ]


def test_counters_are_exact_when_threads_bump_them_together(frequent_switches):
    box = CounterBox()
    statement = CounterBox.indexes("round_trips", "statements", "statements")
    commit = CounterBox.indexes("commits", "round_trips")

    def bump() -> None:
        for _ in range(5000):
            box.bump(statement)
            box.bump(commit)

    threads = [threading.Thread(target=bump) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert Counters(*box.snapshot()) == Counters(
        statements=80_000, commits=40_000, round_trips=80_000
    )
