"""Counting across a worker's processes: what forked children count reaches the exporter,
a dead child's live gauges do not, and the bridge's private directory goes at exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from prometheus_client.mmap_dict import MmapedDict, mmap_key

from bridge.metrics.exporter import ProcessesCollector

# A worker's life in small: metrics imported (prometheus_client in its single-process
# mode), the switch before the fork, a child that counts and exits, a scrape.
FORKING_WORKER = textwrap.dedent(
    """
    import os, sys
    from bridge import metrics
    from bridge.metrics import exporter
    from bridge.transports.conduit import metrics as conduit_metrics

    directory = exporter.count_across_processes()
    print(directory, flush=True)
    conduit_metrics.CONDUIT_BREAKER_OPEN.set(0)
    child = os.fork()
    if child == 0:
        metrics.outcome_counter("Worker", "success", "native").inc(3)
        conduit_metrics.CONDUIT_BREAKER_OPEN.set(1)
        metrics.LAST_POLL.set(1234)
        os._exit(0)
    os.waitpid(child, 0)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in exporter.ProcessesCollector(directory).collect()
        for s in family.samples
    }
    success = (("implementation", "native"), ("outcome", "success"), ("task_class", "Worker"))
    print(samples[("phorge_bridge_outcomes_total", success)])
    print(samples[("phorge_bridge_conduit_breaker_open", ())])
    print(samples[("phorge_bridge_last_poll_timestamp_seconds", ())])
    """
)


def run_worker(tmp_path: Path, **environ: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(TMPDIR=str(tmp_path), **environ)
    done = subprocess.run(
        [sys.executable, "-c", FORKING_WORKER], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", "the switch warns nothing (prometheus_client's clear() would)"
    return done.stdout.split()


def test_a_forked_childs_counts_reach_the_exporter_and_the_private_directory_goes(tmp_path):
    directory, successes, breaker, last_poll = run_worker(tmp_path)
    assert Path(directory).parent == tmp_path
    assert (float(successes), float(last_poll)) == (3, 1234)
    assert float(breaker) == 0  # the dead child's 1 is forgotten, the live parent's 0 shown
    assert not Path(directory).exists()


def test_a_directory_the_operator_names_is_used_and_kept(tmp_path):
    named = tmp_path / "worker-1"
    named.mkdir()
    directory, successes, *_ = run_worker(tmp_path, PROMETHEUS_MULTIPROC_DIR=str(named))
    assert (directory, float(successes)) == (str(named), 3)
    assert any(named.glob("counter_*.db"))


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def write_gauge(directory: Path, pid: int, value: float) -> None:
    gauge = MmapedDict(str(directory / f"gauge_livemax_{pid}.db"))
    key = mmap_key(
        "phorge_bridge_conduit_breaker_open", "phorge_bridge_conduit_breaker_open", (), (), ""
    )
    gauge.write_value(key, value, 0.0)
    gauge.close()


def test_live_gauges_of_dead_processes_are_forgotten_at_the_scrape(tmp_path):
    dead = dead_pid()
    write_gauge(tmp_path, dead, 1)
    write_gauge(tmp_path, os.getpid(), 0)
    [family] = ProcessesCollector(str(tmp_path)).collect()
    assert [s.value for s in family.samples] == [0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"gauge_livemax_{os.getpid()}.db"]


def test_a_file_a_process_is_still_making_costs_the_scrape_nothing(tmp_path):
    """prometheus_client creates a process's file, then sizes it: a scrape between the
    two read 0 bytes and failed whole (a 500: every worker figure lost)."""
    write_gauge(tmp_path, os.getpid(), 0)
    (tmp_path / f"counter_{os.getpid()}.db").touch()  # a child beginning to count
    [family] = ProcessesCollector(str(tmp_path)).collect()
    assert [s.value for s in family.samples] == [0]
