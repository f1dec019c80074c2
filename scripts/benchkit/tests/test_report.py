"""The scenarios ``--only`` picks, and the report's arithmetic: rates, ratios, CPU a task."""

from __future__ import annotations

from benchkit import plan
from benchkit.records import Counters
from benchkit.report import Report, Result
from benchkit.runner import Throughput


def names(quick: bool, phd: bool, only: list[str]) -> list[str]:
    return [s.name for s in plan.build(quick, phd, only)]


def test_phd_and_the_php_section_run_only_with_a_phorge_checkout():
    assert not [n for n in names(False, False, []) if "phd" in n or n.startswith("php-")]
    assert names(False, True, ["php-*-noop*"]) == [
        "php-phd-noop-p1", "php-phd-noop-p2", "php-runner-noop", "php-conduit-noop",
    ]  # fmt: skip
    assert names(True, False, ["bridge-*", "ceiling-*"]) == [
        "ceiling-celery", "ceiling-sql", "bridge-default-noop-c2", "bridge-default-10ms-c4",
        "bridge-default-io50-t16", "bridge-tuned-noop-c4",
    ]  # fmt: skip


def throughput(tasks: int, seconds: float, **cpu: float) -> Throughput:
    server = {"Questions": 3 * tasks, "Com_commit": tasks, "Innodb_log_writes": tasks // 2}
    return Throughput(tasks, seconds, 0.5, cpu, 0.0, 2.0, 0.5, 0.1, db_cpu=0.3,
                      client=Counters(3 * tasks, tasks, tasks), server=server,
                      poll_cpu=0.1 * seconds)  # fmt: skip


def result(name: str, t: Throughput) -> Result:
    (scenario,) = plan.build(False, True, [name])
    return Result(scenario, t)


def test_the_report_divides_by_the_reference_phd_and_the_lower_ceiling():
    results = [
        result("ceiling-celery", Throughput(4000, 2.0, 0.1, {"workers": 2.0}, 0.0, 2.0, 0.9, 0.0)),
        result("ceiling-sql", throughput(4000, 4.0, workers=1.6)),  # 1,000/s: the lower
        result("taskmaster-noop-p1", throughput(3000, 12.0, workers=3.0)),  # 250/s
        result("phd-noop-p1", throughput(3000, 15.0, workers=6.0)),  # 200/s
        result("bridge-default-noop-c2", throughput(3000, 4.0, workers=2.4, beat=0.03)),  # 750/s
    ]
    text = Report(results, {"cores": "2"}, []).render()
    bridge = "| bridge default, prefork -c 2 | **750** | 3.00x / 3.75x / 0.75x | 3,000 | 0.50 |"
    cost = "3.00 / 1.00 / 1.00 | 3.00 / 1.00 / 0.50 | 0.80 (0.13) / 0.01 / 0.10 / 0.00 |"
    assert f"{bridge} {cost} 50% (10%) |" in text
    assert "| plain Celery, -c 4, acks late, prefetch 1 (ceiling) | **2,000** |" in text


def test_the_php_section_compares_with_the_faster_phd_per_task():
    results = [
        result("php-phd-noop-p1", throughput(3000, 15.0, workers=1.5)),  # 200/s
        result("php-phd-noop-p2", throughput(3000, 10.0, workers=1.5)),  # 300/s: the better
        result("php-runner-noop", throughput(3000, 2.5, workers=0.6, **{"runner PHP": 0.06})),
    ]
    text = Report(results, {}, []).render()
    # 4x the better phd's rate, at the same machine CPU a task (2.0 s for each run); from
    # the first starts (0.5 s after the COMMIT), 1,500/s against 316/s.
    assert "| phd debug taskmaster x1 | **200** | 0.67x / 1.00x / 0.66x | 0.50 / 207 |" in text
    runner = (
        f"| runner: bridge worker -B, prefork -c {plan.CORES} | **1,200** | 4.00x / 1.00x / 4.75x |"
    )
    assert f"{runner} 0.50 / 1,500 | n/a | 3.00 / 1.00 / 0.50 | 0.20 / n/a / 0.02 / n/a |" in text
