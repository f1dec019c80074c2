"""Issue 19's PHP section: its scenario names, the CPU split by process role, the targets'
arithmetic (a miss must read "not met"), the ping figures and the report's tables."""

from __future__ import annotations

import json

import pytest
from benchkit import phorgedb, plan, procs, webtier
from benchkit.php import NOOP_CLASS, PHP_NOOP, PHP_SEARCH, SEARCH_CLASS, PhpSetup
from benchkit.phpconsumers import BEAT, PYTHON, RUNNER, bridge_roles
from benchkit.phpreport import Figure, Target, better, server_counts, steady_rate, targets
from benchkit.plan import QUICK, Sizes
from benchkit.procs import ProcStat
from benchkit.report import Context, Report, Result
from benchkit.runner import Latency, Throughput
from benchkit.webtier import PingRun

PHP = [
    "php-phd-noop-p1",
    "php-phd-noop-p2",
    "php-phd-search-p1",
    "php-phd-search-p2",
    "php-runner-noop",
    "php-runner-noop-t8",
    "php-runner-search",
    "php-conduit-noop",
    "php-conduit-search",
    "php-conduit-ping",
]


def names(scenarios: list[plan.Scenario]) -> list[str]:
    return [s.name for s in scenarios]


def test_the_php_section_runs_only_with_a_phorge_checkout():
    assert names(plan.build(Sizes(), with_phd=True, only=["php-*"])) == PHP
    assert names(plan.build(Sizes(), with_phd=False, only=["php-*"])) == []
    assert not any(n.startswith("php-") for n in names(plan.build(Sizes(), False, [])))


def test_the_php_section_keeps_every_scenario_when_quick_with_fewer_tasks():
    quick = {s.name: s for s in plan.build(QUICK, with_phd=True, only=["php-*"])}
    assert list(quick) == PHP
    assert quick["php-conduit-ping"].tasks < Sizes().php_ping == 5000


def test_its_deployments_are_the_readmes():
    by_name = {s.name: s for s in plan.build(Sizes(), with_phd=True, only=["php-*"])}
    runner, conduit = by_name["php-runner-noop"], by_name["php-conduit-noop"]
    assert (runner.pool, runner.concurrency, runner.beat_in_worker) == ("prefork", plan.CORES, True)
    assert (conduit.pool, conduit.concurrency) == ("threads", 8)
    assert by_name["php-runner-noop-t8"].pool == "threads"
    assert by_name["php-phd-search-p2"].concurrency == 2
    assert by_name["php-conduit-ping"].workload.measure == "ping"
    assert {s.workload.task_class for s in by_name.values()} == {NOOP_CLASS, SEARCH_CLASS}


def test_search_tasks_take_the_documents_in_turn():
    setup = PhpSetup(None, {}, 8799, "api-x", ["PHID-USER-a", "PHID-USER-b"])  # type: ignore[arg-type]
    search = setup.resolve(PHP_SEARCH)
    assert [json.loads(v)["documentPHID"] for v in search.variants] == [
        "PHID-USER-a",
        "PHID-USER-b",
    ]
    assert search.payload == search.variants
    assert json.loads(search.variants[0])["parameters"] == {"force": True}
    assert setup.resolve(PHP_NOOP) is PHP_NOOP
    assert PHP_NOOP.payload == "{}"


def stat(pid: int, ppid: int, session: int, name: str, cpu: float) -> ProcStat:
    return ProcStat(pid, ppid, session, name, cpu)


def test_a_family_is_the_session_and_the_descendants_that_left_it():
    table = {
        p.pid: p
        for p in [
            stat(10, 1, 10, "php", 1.0),  # bin/phd debug: the overseer
            stat(11, 10, 11, "php", 2.0),  # exec_daemon.php: posix_setsid()
            stat(12, 11, 11, "php", 0.5),  # a child of the daemon
            stat(20, 1, 20, "python3", 9.0),  # someone else's
        ]
    }
    assert [p.pid for p in procs.family(table, 10)] == [10, 11, 12]
    assert procs.family_cpu(10, table) == pytest.approx(3.5)


def test_a_bridge_workers_cpu_is_split_into_python_beat_and_the_runners_php():
    table = {
        p.pid: p
        for p in [
            stat(100, 1, 100, "python3", 1.0),  # celery worker -B
            stat(101, 100, 100, "python3", 0.1),  # the embedded beat (marked)
            stat(102, 100, 100, "python3", 2.0),  # a pool child
            stat(103, 102, 100, "php", 0.7),  # its PHP runner
        ]
    }
    roles = bridge_roles(table, 100, beat_pids={101})
    assert roles == {PYTHON: pytest.approx(3.0), BEAT: 0.1, RUNNER: 0.7}
    assert bridge_roles(table, 100, beat_pids={100})[BEAT] == 0.0  # never the main process


def test_a_target_says_met_not_met_or_not_measured():
    assert Target("x", 2.5, 2.0, at_least=True).verdict == "met"
    assert Target("x", 1.9, 2.0, at_least=True).verdict == "**not met**"
    assert Target("x", 0.9, 1.0, at_least=False).verdict == "met"
    assert Target("x", 3.1, 3.0, at_least=False).verdict == "**not met**"
    assert Target("x", None, 3.0, at_least=False).verdict == "not measured"
    assert Target("x", 2.5, 2.0, at_least=True, steady=1.8).steady_verdict == "1.80x: **not met**"
    assert Target("x", 2.5, 2.0, at_least=True).steady_verdict == "-"


def test_the_better_phd_is_the_faster_one():
    assert better(Figure(100, 0.002), Figure(150, 0.003)) == Figure(150, 0.003)
    assert better(Figure(None, None), Figure(90, 0.001)) == Figure(90, 0.001)
    assert better(Figure(None, None)) == Figure(None, None)
    slow_start = Figure(100, 0.002, steady=300)
    assert better(slow_start, Figure(150, 0.003, steady=200), steady=True) == slow_start


def test_the_targets_compare_with_the_runs_the_issue_names():
    figures = {
        "php-phd-noop-p1": Figure(200, 0.0030, steady=400),
        "php-phd-noop-p2": Figure(250, 0.0032, steady=350),  # the better phd for no-op
        "php-phd-search-p1": Figure(100, 0.006, steady=110),  # the better phd for search
        "php-phd-search-p2": Figure(90, 0.008, steady=100),
        "php-runner-noop": Figure(600, 0.0016, steady=700),
        "php-runner-search": Figure(140, 0.005, steady=165),
        "php-conduit-noop": Figure(180, 0.0100, steady=200),
    }
    found = targets(figures, ping_ratio=2.5)
    assert [round(t.value or 0, 3) for t in found] == [2.4, 0.5, 1.4, 0.9, 3.333, 2.5]
    assert [t.met for t in found] == [True, True, False, False, False, False]
    # From the first starts, against the phd run fastest from its own first start.
    assert [t.steady for t in found] == [1.75, None, 1.5, 0.5, None, None]
    assert "phd 250/s" in found[0].detail
    assert targets({}, None)[0].verdict == "not measured"


def test_ping_ratio_is_p95_during_over_p95_idle():
    run = PingRun(idle=[0.010] * 19 + [0.020], during=[0.030] * 19 + [0.050])
    assert run.idle_p is not None and run.idle_p.p95 == 0.010
    assert run.ratio == pytest.approx(3.0)
    assert PingRun([], [0.1]).ratio is None


def throughput(tasks: int, seconds: float, cpu: dict[str, float], machine: float) -> Throughput:
    return Throughput(
        tasks, seconds, 0.1, Latency(None, None), None, {}, cpu, None, 0.5, 0.1, 0.5, 0.05,
        machine_cpu=machine, bench_cpu=0.1, mean_duration=0.003,
    )  # fmt: skip


def test_the_report_prints_the_section_with_every_target_and_the_pings():
    scenarios = {s.name: s for s in plan.build(Sizes(), with_phd=True, only=["php-*"])}
    results = [
        Result(scenarios["php-phd-noop-p1"], throughput(3000, 15.0, {"phd PHP": 3.0}, 6.0)),
        Result(
            scenarios["php-runner-noop"],
            throughput(3000, 5.0, {PYTHON: 1.5, BEAT: 0.03, RUNNER: 0.3}, 4.5),
        ),
        Result(
            scenarios["php-conduit-ping"],
            throughput(5000, 10.0, {PYTHON: 3.0, BEAT: 0.05, "web-tier PHP": 6.0}, 12.0),
            ping=PingRun([0.01] * 20, [0.03] * 20),
            web_requests=1000,
        ),
    ]
    text = Report(results, Context({}, {})).render()
    section = text[text.index("## PHP-only classes") :]
    assert "| work | phd x1 | runner | Conduit, the ping run's drain |" in section
    assert "| no-op PHP class: tasks/s | **200** | **600** | **500** |" in section
    assert "| no-op PHP class: CPU ms/task, runner PHP | 0.00 | 0.10 | - |" not in section
    assert "| no-op PHP class: CPU ms/task, runner PHP | - | 0.10 | - |" in section
    assert "| no-op PHP class: web requests a task | - | - | 0.200 |" in section
    assert "| no-op PHP class: tasks/s vs the better phd | 1.00x | 3.00x | 2.50x |" in section
    runner_target = (
        "runner no-op >= 2x the better of phd x1/x2 (tasks/s) | 3.00x | met | 3.04x: met"
    )
    assert runner_target in section
    assert "| Conduit no-op >= 1x phd x1 (tasks/s) | n/a | not measured |" in section
    assert "<= 2x idle | 3.00x | **not met** |" in section
    assert "| during the drain (5,000 no-op tasks through Conduit at 500/s) | 20 |" in section


class FakeCursor:
    """Just enough of a MySQLdb cursor for ``phorgedb.enqueue``."""

    def __init__(self) -> None:
        self.many: list[tuple[str, list[tuple[object, ...]]]] = []

    def execute(self, sql: str, args: object = None) -> None:
        self.last = sql

    def executemany(self, sql: str, rows: list[tuple[object, ...]]) -> None:
        self.many.append((sql, rows))

    def fetchone(self) -> tuple[int]:
        return (12,)  # LAST_INSERT_ID(): ids 10..12

    def fetchall(self) -> list[tuple[int]]:
        return [(7,), (6,), (5,)]


def test_enqueue_writes_the_class_and_gives_the_tasks_the_data_in_turn():
    cursor = FakeCursor()

    class Conn:
        def cursor(self) -> FakeCursor:
            return cursor

    batch = phorgedb.enqueue(Conn(), 3, ("a", "b"), task_class=SEARCH_CLASS)  # type: ignore[arg-type]
    (_, data), (_, rows) = cursor.many
    assert data == [("a",), ("b",), ("a",)]
    assert [(row[0], row[1], row[2]) for row in rows] == [
        (10, SEARCH_CLASS, 5),
        (11, SEARCH_CLASS, 6),
        (12, SEARCH_CLASS, 7),
    ]
    assert (batch.first, batch.last) == (10, 12)


def test_the_web_tiers_requests_are_its_accepted_connections(tmp_path):
    log = tmp_path / "php-server.log"
    log.write_text(
        "[1] [Tue Dec  1 15:05:43 2026] PHP 8.2.36 Development Server started\n"
        "[2] [Tue Dec  1 15:05:47 2026] 127.0.0.1:48398 Accepted\n"
        "[2] [Tue Dec  1 15:05:47 2026] 127.0.0.1:48398 Closing\n"
        "[3] [Tue Dec  1 15:05:47 2026] 127.0.0.1:48408 Accepted\n"
    )
    proc = procs.Proc("php -S", None, log)  # type: ignore[arg-type]
    assert webtier.accepted(proc) == 2


def test_the_steady_rate_leaves_out_the_wait_before_the_first_start():
    t = throughput(3000, 6.0, {}, 1.0)  # first start 0.1 s
    assert steady_rate(t) == pytest.approx(3000 / 5.9)
    t.server.update(Questions=9000, Com_commit=3000, Innodb_log_writes=1500)
    assert server_counts(t) == "3.00 / 1.00 / 0.50"
