"""Issue 21's scenarios: their names (what ``--only`` selects) and the pure arithmetic of
their figures (spreads, urgent timings, the enqueue schedule)."""

from __future__ import annotations

import pytest
from benchkit import plan
from benchkit.plan import QUICK, Sizes
from benchkit.priority import (
    WATCH_INTERVAL,
    PriorityRun,
    Spread,
    Urgent,
    UrgentTask,
    sleep_before,
)  # fmt: skip
from benchkit.report import Result, priority_row
from benchkit.runner import Latency, Throughput
from benchkit.unserved import Drains, UnservedRun

ISSUE21 = [
    "taskmaster-priority-p1",
    "phd-priority-p1",
    "taskmaster-priority-1s-p1",
    "phd-priority-1s-p1",
    "bridge-default-priority-c2",
    "bridge-default-priority-c2-redis",
    "bridge-default-priority-c2-rabbitmq",
    "bridge-default-priority-1s-c2",
    "bridge-default-priority-1s-t8",
    "bridge-default-unserved-c2",
    "bridge-default-unserved-c2-redis",
    "bridge-default-unserved-c2-rabbitmq",
]


def names(scenarios: list[plan.Scenario]) -> list[str]:
    return [s.name for s in scenarios]


def test_issue21_scenarios_come_last_with_phd_and_every_broker():
    scenarios = plan.build(Sizes(), with_phd=True, only=[])
    assert names(scenarios)[-len(ISSUE21) :] == ISSUE21


def test_without_phd_or_redis_their_scenarios_are_left_out():
    found = names(plan.issue21(Sizes(), False, (plan.SQLITE, plan.RABBITMQ)))
    assert found == [n for n in ISSUE21 if not n.startswith("phd-") and "redis" not in n]


def test_the_existing_scenarios_are_unchanged_and_keep_their_broker():
    before = plan.build(Sizes(), with_phd=True, only=[])[: -len(ISSUE21)]
    assert not any("priority" in s.name or "unserved" in s.name for s in before)
    bridges = [s for s in before if s.kind == "bridge"]
    assert {(s.broker, s.beat_in_worker) for s in bridges} == {(plan.RABBITMQ, False)}


@pytest.mark.parametrize(
    ("globs", "expected"),
    [
        (["*-priority-p1"], ["taskmaster-priority-p1", "phd-priority-p1"]),
        (["bridge-default-priority-c2"], ["bridge-default-priority-c2"]),
        (["*priority-1s*"], [n for n in ISSUE21 if "priority-1s" in n]),
        (["*unserved-c2"], ["bridge-default-unserved-c2"]),
    ],
)
def test_only_picks_them_by_glob(globs, expected):
    assert names(plan.build(QUICK, with_phd=True, only=globs)) == expected


def test_the_readme_deployment_on_sqlite_unless_the_name_says_otherwise():
    by_name = {s.name: s for s in plan.build(Sizes(), with_phd=False, only=["bridge-*"])}
    assert by_name["bridge-default-priority-c2"].broker == plan.SQLITE
    assert by_name["bridge-default-priority-c2-redis"].broker == plan.REDIS
    assert by_name["bridge-default-priority-1s-t8"].pool == "threads"
    assert by_name["bridge-default-unserved-c2-rabbitmq"].beat_in_worker
    assert not by_name["bridge-default-noop-c2"].beat_in_worker


def test_the_backlogs_are_the_issues_sizes():
    by_name = {s.name: s for s in plan.issue21(Sizes(), True, (plan.SQLITE,))}
    assert by_name["bridge-default-priority-c2"].tasks == 3000
    assert by_name["bridge-default-priority-c2"].workload.data == {"duration": 0.05}
    assert by_name["phd-priority-1s-p1"].tasks == 200
    assert by_name["bridge-default-priority-1s-c2"].workload.data == {"duration": 1.0}
    assert Sizes().unserved == 300_000


def test_a_spread_is_the_nearest_rank_median_and_the_worst():
    assert Spread.of([0.3, 0.1, 0.2, 10.0]) == Spread(0.2, 10.0)
    assert Spread.of([0.5]) == Spread(0.5, 0.5)
    assert Spread.of([]) is None


def test_an_urgent_task_starts_its_duration_before_it_was_seen_archived():
    task = UrgentTask(enqueued=100.0, archived=110.5, duration_us=50_000)
    assert task.to_archive == pytest.approx(10.5)
    assert task.to_start == pytest.approx(10.45)


def test_urgent_tasks_are_due_after_the_head_start_one_every_interval():
    assert Urgent(count=3, every=0.5, head_start=2.0).due(100.0) == [102.0, 102.5, 103.0]


def test_the_watch_sleeps_its_interval_or_until_the_next_enqueue():
    assert sleep_before([], 5.0) == WATCH_INTERVAL
    assert sleep_before([5.004], 5.0) == pytest.approx(0.004)
    assert sleep_before([4.0], 5.0) == 0.0
    assert sleep_before([9.0], 5.0) == WATCH_INTERVAL


def test_the_report_row_shows_each_spread_of_the_urgent_tasks():
    scenario = plan.build(Sizes(), with_phd=False, only=["bridge-default-priority-c2"])[0]
    urgent = [UrgentTask(0.0, 10.0, 50_000), UrgentTask(1.0, 12.0, 50_000)]
    row = priority_row(Result(scenario, priority=PriorityRun(3000, 1.5, urgent, 600)))
    assert row[1:] == [
        "sqlite", '3000 x {"duration":0.05}', "1.50", "9.95", "10.95", "**10.00**",
        "**11.00**", "600",
    ]  # fmt: skip


def test_drains_together_are_all_their_tasks_over_all_their_seconds():
    def drain(tasks: int, seconds: float, db_cpu: float) -> Throughput:
        return Throughput(
            tasks, seconds, 0.1, Latency(None, None), None, {}, {}, None, db_cpu, None, 0, 0
        )

    alone = Drains([drain(3000, 1.0, 1.2), drain(3000, 2.0, 1.2)])
    behind = Drains([drain(3000, 6.0, 3.0)])
    assert alone.rate == 2000
    assert alone.per_task(lambda t: t.db_cpu) == pytest.approx(0.0004)
    assert UnservedRun(300_000, 5.0, alone, behind).ratio == 0.25
