"""A backlog through real workers: batches of tasks a message, each task run once, its
own line in the log, and slow tasks spread over the processes rather than run in a row."""

from __future__ import annotations

import re
from collections import Counter

from bridge.queue.model import RESULT_SUCCESS

BACKLOG = 300  # a first poll of the fixtures' max in flight, 200: 6 tasks a message
SLOW_TASKS, SLOW_SECONDS = 64, 0.6  # 2 a message; each longer than a poll interval


def test_a_backlog_runs_in_batches_each_task_once_with_its_own_log_line(
    make_bridge, database_url, broker_url
):
    bridge = make_bridge(database_url, broker_url)
    ids = bridge.enqueue("RecordedA", count=BACKLOG)
    worker = bridge.worker("worker", [bridge.default_queue, bridge.control_queue], concurrency=2)
    bridge.beat()
    bridge.wait_ready(worker)

    archived = bridge.wait_archived(ids, timeout=90)
    assert {row.result for row in archived.values()} == {RESULT_SUCCESS}
    assert Counter(r["id"] for r in bridge.runs()) == Counter(ids), "a task ran twice"
    log = worker.log()
    batched = re.findall(r"bridge\.execute_batch\[[-0-9a-f]+\] succeeded in .*'(\d+) task", log)
    assert max(map(int, batched)) >= 200 // 32
    for task_id in ids:
        assert f"RecordedA#{task_id} [native]: success [task={task_id} " in log


def test_slow_tasks_of_a_batch_are_sent_on_to_other_processes(make_bridge, database_url, amqp_url):
    # Paced, a message carries at most a poll interval of work: one slow task. Without
    # the pace (or before the archive shows the tasks are slow) batches carry several.
    bridge = make_bridge(database_url, amqp_url, DISPATCH_AHEAD="off")
    ids = bridge.enqueue("RecordedA", {"duration": SLOW_SECONDS}, count=SLOW_TASKS)
    worker = bridge.worker("worker", [bridge.default_queue, bridge.control_queue], concurrency=4)
    bridge.beat()
    bridge.wait_ready(worker)

    archived = bridge.wait_archived(ids, timeout=90)
    assert {row.result for row in archived.values()} == {RESULT_SUCCESS}
    runs = bridge.runs()
    assert Counter(r["id"] for r in runs) == Counter(ids), "a task ran twice"
    # Each batch ran its first task, then sent the second on as a message of its own,
    # which its result names, and which ran that task.
    sent_on_line = (
        r"'1 task\(s\): 1 success \(#\d+\); 1 sent on: bridge\.execute\[([-0-9a-f]+)\] \(#(\d+)\)'"
    )

    def each_sent_on_message_ran_its_task() -> bool:
        # Celery logs a message's end after its outcome is archived: wait for the lines.
        log = worker.log()
        sent_on = re.findall(sent_on_line, log)
        return len(sent_on) == SLOW_TASKS // 2 and all(
            re.search(
                rf"bridge\.execute\[{message_id}\] succeeded in \S+ "
                rf"'RecordedA#{task_id} \[native\]: ",
                log,
            )
            for message_id, task_id in sent_on
        )

    bridge.wait_until(each_sent_on_message_ran_its_task, 30, "each sent-on message's line")
