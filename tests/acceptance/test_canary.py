"""The canary's python level end to end (issue 28): real workers and beats on
RabbitMQ and MariaDB, a native handler (``canary_handlers.py``) as the new side and the
PHP runner on the stand-in Phorge as the old side, the weights in the test database's
``config_entry`` (where ``bin/config set --database`` would put them).

(a) A healthy class at 20% runs natively exactly the ids the hash names (68 of 300),
    each task archived once, a success, labelled with who ran it.
(b) A handler failing 30% of its runs at 20%, fed a steady stream, is rolled back by the
    guard within its first 8 failures, where the stream would have failed 52 without a
    guard; two workers and two beats honour it within seconds, every failed run is
    retried on PHP and archived a success, and the rollback survives a restart.
(c) A ramp reaches 100% while its handler is healthy, and drops to 0% when it turns bad
    mid-ramp.

And a worker with no PHP path for a class it serves natively refuses a python weight below
100 at start; a worker that cannot read the weights runs no task on the native side; a
killed guard is alerted, and its rollback stays in sight.

Every wait is on a condition; none starts before the workers are ready.
"""

from __future__ import annotations

import re
import secrets
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import canary
import pytest
import requests
from bridge_harness import Bridge, wait_until, write_plugin
from canary import fails_on_purpose, new_side, read, roll_back, rolled_back, set_weights
from local_ports import free_port
from php_standin import STANDIN_ROOT, php_binary
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, make_url

from bridge.canary.guard import read_window
from bridge.canary.ledger import SETTLE
from bridge.queue.implementations import PYTHON
from bridge.queue.model import RESULT_SUCCESS, label_of
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_archivetask as archive

CLASS = "StandinSucceedWorker"  # a PHP class of the stand-in, with a native handler too
HEALTHY = "StandinCacheWorker"  # (c): a second one, whose handler stays healthy
HANDLERS = Path(__file__).with_name("canary_handlers.py")
HANDLER_HELPERS = (Path(canary.__file__),)  # the handler's fails_on_purpose
WAIT = 90.0
# A rollback reaches every process within BRIDGE_CANARY_REFRESH (0.25 s here); the
# trip's time is whole seconds of the database clock: the bound a native run may start
# after it (the target is 5 s).
HONOURED_WITHIN = 3
# (b): the failing handler fails FAIL_PERCENT of its tasks (canary.fails_on_purpose). Its
# tasks come FEED at a time every FEED_EVERY s (50 a second, about 10 of them native, 3
# of those failing) until the rollback, at most FEED_CAP of them: the native side would
# fail about 110 of those without a guard. The guard judges every 0.5 s here, and trips
# when Fisher's test finds the excess significant (p < 1e-6: about 8 failures in 27
# runs against an old side without one) on 3 evaluations in a row; it must trip within
# TRIPPED_WITHIN failures, and FELL_BACK_AT_MOST may fall back (the trip's and those the
# workers ran before they heard of it).
FAIL_PERCENT = 30
FEED, FEED_EVERY, FEED_CAP = 10, 0.2, 2000
TRIPPED_WITHIN, FELL_BACK_AT_MOST = 20, 26
# The guard's two tests of a base rate: 3% failing on both sides over 5,000 tasks, and
# an outage of a dependency both sides call.
ALIKE_TASKS, ALIKE_PERCENT, ALIKE_WAIT = 5000, 3, 900.0
TRIP = re.compile(r"new side success ([\d.]+)% over (\d+) runs")
WORKER_TABLES = ("worker_activetask", "worker_archivetask", "worker_taskdata", "lisk_counter")


def deployment(make_bridge: Any, database_url: str, broker_url: str) -> Bridge:
    php_binary()  # fails, never skips, without PHP
    bridge = make_bridge(
        database_url,
        broker_url,
        PHORGE_ROOT=str(STANDIN_ROOT),
        RUNNER_CLASSES="Standin*",
        CANARY_REFRESH="0.25",
        CANARY_GUARD_INTERVAL="0.5",
    )
    bridge.plugin_dir = write_plugin(
        bridge.directory / "canary-plugin",
        HANDLERS,
        "CanaryNative = canary_handlers:CanaryNative",
        extra=HANDLER_HELPERS,
    )
    return bridge


def labels(rows: dict[int, Any]) -> dict[int, str | None]:
    return {task_id: label_of(row.leaseOwner) for task_id, row in rows.items()}


def native_runs(bridge: Bridge, task_class: str = CLASS) -> list[dict[str, Any]]:
    return [r for r in bridge.runs() if r["taskClass"] == task_class]


def scraped(ports: list[int], name: str, **labels: str) -> float:
    """The sum over the workers at ``ports`` of the samples ``name`` with ``labels``."""
    total = 0.0
    for port in ports:
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    total += sample.value
    return total


def assert_all_succeeded(bridge: Bridge, ids: list[int]) -> dict[int, Any]:
    """Every task archived once (its id is the archive's key), a success, no failure
    counted: the canary cost no task."""
    rows = bridge.wait_archived(ids, timeout=WAIT)
    assert {row.result for row in rows.values()} == {RESULT_SUCCESS}
    assert {row.failureCount for row in rows.values()} == {0}
    return rows


def test_a_class_at_20_percent_native_runs_a_fifth_natively_each_task_once(
    make_bridge, database_url, amqp_url
):
    bridge = deployment(make_bridge, database_url, amqp_url)
    set_weights(bridge.engine, {CLASS: {"python": 20}})
    worker = bridge.worker("worker", [bridge.default_queue, bridge.control_queue], concurrency=2)
    bridge.beat()
    bridge.wait_ready(worker)

    ids = bridge.enqueue(CLASS, {}, count=300)
    rows = assert_all_succeeded(bridge, ids)
    ran_by = labels(rows)
    natively = {task_id for task_id, label in ran_by.items() if label == "native"}
    # The ids are 1-300 every run, so the hash names the same 68 each time: the share is
    # exactly that set, not a count near a fifth.
    named = new_side(PYTHON, 20, ids)
    assert named and len(named) < len(ids), "both sides have tasks to run"
    assert natively == named, "the hash names the side, exactly"
    assert Counter(ran_by.values()) == {"native": len(natively), "runner": 300 - len(natively)}
    assert Counter(r["id"] for r in native_runs(bridge)) == Counter(natively), "each ran once"
    log = worker.log()
    some_native, some_php = min(natively), min(set(ids) - natively)
    assert f"{CLASS}#{some_native} [native]: success" in log
    assert f"{CLASS}#{some_php} [runner]: success" in log
    assert "canary rollback" not in log
    # Both sides side by side, as the guard and `phorge-bridge canary report` read them.
    window = read_window(bridge.engine, CLASS, PYTHON, 300, 5000)
    assert (window.new.runs, window.new.successes) == (len(natively), len(natively))
    assert (window.old.runs, window.old.successes) == (300 - len(natively),) * 2
    assert not rolled_back(bridge.engine, CLASS, PYTHON)


def test_a_failing_native_handler_is_rolled_back_everywhere_and_no_task_fails(
    make_bridge, database_url, amqp_url, monkeypatch
):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    bridge = deployment(make_bridge, database_url, amqp_url)
    set_weights(bridge.engine, {CLASS: {"python": 20}})
    queues = [bridge.default_queue, bridge.control_queue]
    failing = {"CANARY_FAIL_CLASSES": CLASS, "CANARY_FAIL_PERCENT": str(FAIL_PERCENT)}
    ports = [free_port(), free_port()]
    workers = [
        bridge.worker(
            f"worker-{n}", queues, concurrency=2, env={**failing, "BRIDGE_METRICS_PORT": str(port)}
        )
        for n, port in zip((1, 2), ports, strict=True)
    ]
    bridge.beat("beat-1")
    bridge.beat("beat-2")
    bridge.wait_ready(*workers)

    # A steady stream, so that the guard's pace, not the workers', decides how many fail.
    first: list[int] = []

    def fed_until_rolled_back() -> bool:
        if rolled_back(bridge.engine, CLASS, PYTHON):
            return True
        if len(first) < FEED_CAP:
            first.extend(bridge.enqueue(CLASS, {}, count=FEED))
        return False

    wait_until(
        fed_until_rolled_back, WAIT, "the rollback", interval=FEED_EVERY, diagnose=bridge.diagnose
    )
    tripped_at = read(bridge.engine).state.of(CLASS, PYTHON).rolled_back_at
    assert tripped_at is not None
    [tripped] = [line for line in bridge.logs().splitlines() if "canary rollback:" in line]
    assert f"canary rollback: {CLASS} (python): new side success" in tripped
    assert "old side 100.0%" in tripped and "window 300 s (p = " in tripped
    # What the guard counted when it tripped, against what the stream would have failed.
    stream = range(first[0], first[0] + FEED_CAP)
    would_fail = {i for i in new_side(PYTHON, 20, stream) if fails_on_purpose(i, FAIL_PERCENT)}
    assert len(would_fail) >= 4 * TRIPPED_WITHIN, "the bound is well below the stream's"
    [(ratio, runs)] = TRIP.findall(tripped)
    failed = round(int(runs) * (100 - float(ratio)) / 100)
    assert 3 <= failed <= TRIPPED_WITHIN, f"tripped after {failed} of {len(would_fail)} failures"

    # Every worker honours it: each one runs, on PHP, tasks the hash gives the native side.
    natively = new_side(PYTHON, 20, range(1, 10_000))
    later: list[int] = []

    def each_worker_ran_the_native_share_on_php() -> bool:
        shared = [i for i in later if i in natively]
        if all(any(f"{CLASS}#{i} [runner]: success" in w.log() for i in shared) for w in workers):
            return True
        if bridge.count(active) < 20:
            later.extend(bridge.enqueue(CLASS, {}, count=50))
        return False

    bridge.wait_until(each_worker_ran_the_native_share_on_php, WAIT, "both workers to run PHP")
    ran_by = labels(assert_all_succeeded(bridge, first + later))
    fell_back = {i for i, label in ran_by.items() if label == "runner-fallback"}
    assert fell_back <= natively, "only the native side falls back"
    assert all(fails_on_purpose(i, FAIL_PERCENT) for i in fell_back), "and only its failures"
    assert failed <= len(fell_back) <= FELL_BACK_AT_MOST, (
        f"{len(fell_back)} fell back: the workers honoured the rollback late"
    )
    print(
        f"\n[canary] tripped after {failed} failure(s) in {runs} native runs "
        f"({len(would_fail)} without a guard); {len(fell_back)} fell back"
    )
    started = [r["time"] for r in native_runs(bridge)]
    assert max(started) <= tripped_at + HONOURED_WITHIN, "a native run after the rollback"
    warned = [line for line in bridge.logs().splitlines() if "WARNING" in line]
    fallbacks = [
        line for line in warned if "[native]: fallback: failing on purpose; runner takes it" in line
    ]
    assert len(fallbacks) == len(fell_back)
    # The metrics say it too: the rollback, and each run by who ran it.
    of_class = {"task_class": CLASS}
    native = {**of_class, "level": "python"}
    assert scraped(ports[:1], "phorge_bridge_canary_rolled_back", **native) == 1
    assert scraped(ports[:1], "phorge_bridge_canary_weight", **native) == 0
    expected = {
        ("native", "fallback"): len(fell_back),
        ("native", "success"): len(started) - len(fell_back),
        ("runner", "success"): len(ran_by) - len(started) + len(fell_back),
    }

    def counted() -> dict[tuple[str, str], float]:
        return {
            key: scraped(
                ports,
                "phorge_bridge_outcomes_total",
                **of_class,
                implementation=key[0],
                outcome=key[1],
            )
            for key in expected
        }

    # (A run is counted just after its outcome is written.)
    bridge.wait_until(lambda: counted() == expected, WAIT, f"the outcomes counted: {expected}")

    # Restarted, the workers keep the class at 0%: the rollback is in the database.
    for worker in workers:
        worker.signal(signal.SIGTERM)
    for worker in workers:
        worker.wait(timeout=WAIT)
    restarted = [bridge.worker(f"worker-{n}b", queues, concurrency=2, env=failing) for n in (1, 2)]
    bridge.wait_ready(*restarted)
    before = len(native_runs(bridge))
    again = bridge.enqueue(CLASS, {}, count=100)
    assert new_side(PYTHON, 20, again), "some of them are the native side's"
    assert set(labels(assert_all_succeeded(bridge, again)).values()) == {"runner"}
    assert len(native_runs(bridge)) == before
    assert rolled_back(bridge.engine, CLASS, PYTHON)


def test_a_ramp_reaches_100_when_healthy_and_drops_to_0_when_the_handler_turns_bad(
    make_bridge, database_url, amqp_url, tmp_path: Path
):
    bridge = deployment(make_bridge, database_url, amqp_url)
    set_weights(
        bridge.engine,
        {
            HEALTHY: {"ramp": {"level": "python", "steps": [10, 50, 100], "dwell": 1}},
            # Held longer, so that the guard has the time to judge the bad step.
            CLASS: {"ramp": {"level": "python", "steps": [10, 50, 100], "dwell": 4}},
        },
    )
    flag = tmp_path / "turn-bad"
    env = {"CANARY_FAIL_CLASSES": CLASS, "CANARY_FAIL_PERCENT": "50", "CANARY_FAIL_FLAG": str(flag)}
    worker = bridge.worker("worker", [bridge.default_queue, bridge.control_queue], env=env)
    bridge.beat()
    bridge.wait_ready(worker)

    queued: dict[str, list[int]] = {HEALTHY: [], CLASS: []}

    def feeding(condition: Any) -> Any:
        """``condition``, keeping a trickle of both classes queued meanwhile."""

        def check() -> bool:
            if condition():
                return True
            if bridge.count(active) < 40:
                for task_class, ids in queued.items():
                    ids += bridge.enqueue(task_class, {}, count=10)
            return False

        return check

    def step(task_class: str) -> int:
        return read(bridge.engine).state.of(task_class, PYTHON).step

    bridge.wait_until(feeding(lambda: step(CLASS) >= 1), WAIT, f"{CLASS}'s ramp at 50%")
    assert step(CLASS) == 1 and not rolled_back(bridge.engine, CLASS, PYTHON)
    flag.touch()  # the handler turns bad mid-ramp
    bridge.wait_until(
        feeding(lambda: rolled_back(bridge.engine, CLASS, PYTHON)), WAIT, "the bad ramp's rollback"
    )
    tripped_at = read(bridge.engine).state.of(CLASS, PYTHON).rolled_back_at
    assert tripped_at is not None and step(CLASS) == 1, "dropped from 50%, not past it"
    bridge.wait_until(feeding(lambda: step(HEALTHY) == 2), WAIT, f"{HEALTHY}'s ramp at 100%")
    assert not rolled_back(bridge.engine, HEALTHY, PYTHON)

    # From now on: the healthy class wholly native, the bad one wholly on PHP.
    def a_batch_runs_wholly_on(task_class: str, label: str) -> bool:
        ids = bridge.enqueue(task_class, {}, count=20)
        queued[task_class] += ids
        return set(labels(bridge.wait_archived(ids, timeout=WAIT)).values()) == {label}

    bridge.wait_until(lambda: a_batch_runs_wholly_on(HEALTHY, "native"), WAIT, "100% native")
    bridge.wait_until(lambda: a_batch_runs_wholly_on(CLASS, "runner"), WAIT, "0% native")

    for ids in queued.values():
        assert_all_succeeded(bridge, ids)
    late = [r for r in native_runs(bridge) if r["time"] > tripped_at + HONOURED_WITHIN]
    assert late == [], "a native run of the rolled-back class after its rollback"
    events = [(e.task_class, e.event) for e in read(bridge.engine).state.history]
    assert events.count((HEALTHY, "step")) == 2 and (CLASS, "rollback") in events


def guard_judged_since(ports: list[int], since: float) -> bool:
    """Whether the guard (on a worker at ``ports``) ended a judgement after ``since``."""
    return scraped(ports, "phorge_bridge_canary_guard_last_run_timestamp_seconds") > since


def watched_at_20_percent(make_bridge: Any, database_url: str, amqp_url: str) -> tuple[Bridge, int]:
    """A deployment with the class at 20% native, one worker (the guard's too) serving
    metrics, and beat; returns it and the worker's metrics port."""
    bridge = deployment(make_bridge, database_url, amqp_url)
    set_weights(bridge.engine, {CLASS: {"python": 20}})
    port = free_port()
    queues = [bridge.default_queue, bridge.control_queue]
    env = {"BRIDGE_METRICS_PORT": str(port)}
    worker = bridge.worker("worker", queues, concurrency=2, env=env)
    bridge.beat()
    bridge.wait_ready(worker)
    return bridge, port


def first_runs_left(bridge: Bridge) -> int:
    """Rows never run, or run only by the new side (a fallback waits with a failure time
    and no count): those still to have the old side's first run."""
    return bridge.count(active, active.c.failureCount == 0)


def test_both_sides_failing_alike_over_5000_tasks_are_not_rolled_back(
    make_bridge, database_url, amqp_url, monkeypatch
):
    """A dependency both sides call fails 3% of the calls (``flake``), the native side
    at 20%, 5,000 tasks fed as a stream: the guard judges the whole time, has the sample
    to trip on (some 1,000 native runs, some 30 of them failed) and does not."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    bridge, port = watched_at_20_percent(make_bridge, database_url, amqp_url)

    ids: list[int] = []

    def every_first_run_done() -> bool:
        if len(ids) < ALIKE_TASKS:
            if bridge.count(active, active.c.leaseOwner.is_(None)) < 200:
                ids.extend(bridge.enqueue(CLASS, {"flake": ALIKE_PERCENT}, count=100))
            return False
        return first_runs_left(bridge) == 0

    bridge.wait_until(every_first_run_done, ALIKE_WAIT, f"{ALIKE_TASKS} tasks' first runs")
    done = time.time()
    bridge.wait_until(lambda: guard_judged_since([port], done), WAIT, "a judgement after")
    assert not rolled_back(bridge.engine, CLASS, PYTHON)
    assert "canary rollback" not in bridge.logs()
    window = read_window(bridge.engine, CLASS, PYTHON, 3600, 10_000)
    new, old = window.new, window.old
    print(
        f"\n[canary] alike: new side {new.failures} failed of {new.runs}, "
        f"old side {old.failures} of {old.runs}; no rollback"
    )
    assert new.runs >= 800 and new.failures >= 10, "the guard had a sample to judge"
    assert old.runs >= 3 * new.runs and old.failures >= 3 * new.failures // 2


def test_an_outage_both_sides_share_for_30_s_is_not_rolled_back(
    make_bridge, database_url, amqp_url, monkeypatch, tmp_path: Path
):
    """Every call to the shared dependency fails for 30 s (the file ``outage`` names
    exists), under a steady stream at 20% native: the native side's runs fall back and
    fail again on PHP (their failed owner says ``runner-fallback``: a failure of each
    side), PHP's own fail, and the guard, which counts each failure when it happens,
    sees both sides fail alike and does not roll back."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    bridge, port = watched_at_20_percent(make_bridge, database_url, amqp_url)
    outage = tmp_path / "dependency-down"
    ids: list[int] = []

    def streaming(condition: Any) -> Any:
        def check() -> bool:
            if condition():
                return True
            if bridge.count(active, active.c.leaseOwner.is_(None)) < 50:
                ids.extend(bridge.enqueue(CLASS, {"outage": str(outage)}, count=FEED))
            return False

        return check

    def archived() -> int:
        return bridge.count(archive, archive.c.taskClass == CLASS)

    bridge.wait_until(streaming(lambda: archived() >= 300), WAIT, "300 healthy runs")
    outage.touch()
    down_at = bridge.now()
    bridge.wait_until(streaming(lambda: bridge.now() >= down_at + 30), WAIT, "30 s of outage")
    outage.unlink()
    up_at, healthy = bridge.now(), archived()
    bridge.wait_until(
        streaming(lambda: archived() >= healthy + 300), WAIT, "300 healthy runs again"
    )
    settled = time.time() + SETTLE
    bridge.wait_until(lambda: guard_judged_since([port], settled), WAIT, "a judgement after")
    assert not rolled_back(bridge.engine, CLASS, PYTHON)
    assert "canary rollback" not in bridge.logs()
    window = read_window(bridge.engine, CLASS, PYTHON, bridge.now() - down_at + 60, 10_000)
    new, old = window.new, window.old
    print(
        f"\n[canary] outage {up_at - down_at} s: new side {new.fallbacks} fell back of "
        f"{new.runs}, old side {old.temporary_failures} failed of {old.runs}; no rollback"
    )
    assert new.fallbacks >= 20 and old.temporary_failures >= 4 * 20, "the guard saw it"


def test_a_native_handler_that_forgets_a_followup_is_rolled_back(
    make_bridge, database_url, amqp_url
):
    """Each task's PHP queues one follow-up; the native handler, at 20%, forgets it and
    succeeds. Its outcomes are as good as PHP's; its effects are not: the guard compares
    the follow-ups each side's successes queued and rolls the class back, and no task
    fails on the way."""
    bridge = deployment(make_bridge, database_url, amqp_url)
    set_weights(bridge.engine, {CLASS: {"python": 20}})
    queues = [bridge.default_queue, bridge.control_queue]
    worker = bridge.worker("worker", queues, concurrency=2, env={"CANARY_FORGET_FOLLOWUPS": "1"})
    bridge.beat()
    bridge.wait_ready(worker)
    data = {"followups": [{"class": HEALTHY, "data": {}}]}
    fed: list[int] = []

    def fed_until_rolled_back() -> bool:
        if rolled_back(bridge.engine, CLASS, PYTHON):
            return True
        if len(fed) < FEED_CAP:
            fed.extend(bridge.enqueue(CLASS, data, count=FEED))
        return False

    bridge.wait_until(fed_until_rolled_back, WAIT, "the rollback", interval=FEED_EVERY)
    [tripped] = [line for line in bridge.logs().splitlines() if "canary rollback:" in line]
    assert "new side success 100.0%" in tripped and "old side 100.0%" in tripped
    assert "new side queued 0.00 follow-ups per success against the old side's 1.00" in tripped
    rows = assert_all_succeeded(bridge, fed)
    natively = [i for i, label in labels(rows).items() if label == "native"]
    print(f"\n[canary] forgotten follow-ups: rolled back after {len(natively)} native runs")
    # Judged once 10 labelled successes a side differ at p < 1e-6 (about 16 native runs),
    # then on 3 evaluations in a row, a second apart, while 10 native runs a second come:
    # about 50, and more on a loaded machine; a guard that never tripped would let all
    # FEED_CAP tasks run, 400 of them natively.
    assert 10 <= len(natively) <= 150


def test_a_native_weight_the_worker_cannot_honour_stops_it_at_start(
    make_bridge, database_url, amqp_url
):
    """No PHP path for the class here (no runner, no Conduit): the old side's share would
    have nowhere to run, so the worker refuses to start, naming the option and the class."""
    bridge = make_bridge(database_url, amqp_url)
    bridge.plugin_dir = write_plugin(
        bridge.directory / "canary-plugin",
        HANDLERS,
        "CanaryNative = canary_handlers:CanaryNative",
        extra=HANDLER_HELPERS,
    )
    set_weights(bridge.engine, {CLASS: {"python": 20}})
    worker = bridge.worker("worker", [bridge.default_queue, bridge.control_queue])
    assert worker.wait(timeout=WAIT) == 1
    [line] = [line for line in worker.log().splitlines() if line.startswith("Error: ")]
    assert line.startswith(f"Error: configuration error: phorge-bridge.canary: {CLASS}: ")
    assert "needs a PHP path" in line


@pytest.fixture
def worker_tables_account(database_url: str, mysql_server: Engine) -> Iterator[str]:
    """A database URL on an account granted Phorge's worker tables and not the config
    table beside them: a worker whose grant on ``config_entry`` was revoked."""
    name = f"nocfg_{secrets.token_hex(4)}"
    url = make_url(database_url)
    with mysql_server.begin() as conn:
        conn.exec_driver_sql(f"CREATE USER '{name}'@'127.0.0.1' IDENTIFIED BY 'rw'")
        for table in WORKER_TABLES:
            conn.exec_driver_sql(
                f"GRANT SELECT, INSERT, UPDATE, DELETE ON `{url.database}`.{table} "
                f"TO '{name}'@'127.0.0.1'"
            )
    yield url.set(username=name, password="rw").render_as_string(hide_password=False)
    with mysql_server.begin() as conn:
        conn.exec_driver_sql(f"DROP USER '{name}'@'127.0.0.1'")


def test_a_worker_that_cannot_read_the_weights_runs_no_new_side_task(
    make_bridge, database_url, amqp_url, worker_tables_account
):
    """Half the class is the native side's. Of two workers on its queue, one cannot read
    the weights: it never knew them, so it runs none of its tasks and hands them back
    (no failure counted), saying why once, and stands by on the queue until it is due to
    read them again, so as not to take the messages the other needs; the other, a lone
    process, runs them all, each side its share."""
    bridge = deployment(make_bridge, database_url, amqp_url)
    set_weights(bridge.engine, {CLASS: {"python": 50}})
    bridge.settings["BRIDGE_CANARY_REFRESH"] = "5"  # its standby: until it reads again
    blind = bridge.worker(
        "blind", [bridge.default_queue], env={"BRIDGE_DATABASE_URL": worker_tables_account}
    )
    bridge.settings["BRIDGE_CANARY_REFRESH"] = "0.25"
    # Two processes, so that polls never keep the healthy worker from every task.
    worker = bridge.worker("worker", [bridge.default_queue, bridge.control_queue], concurrency=2)
    bridge.beat()
    bridge.wait_ready(blind)
    bridge.wait_ready(worker)

    ids = bridge.enqueue(CLASS, {}, count=100)
    started = time.monotonic()
    rows = assert_all_succeeded(bridge, ids)
    natively = new_side(PYTHON, 50, ids)
    assert natively and {i for i, label in labels(rows).items() if label == "native"} == natively
    log = blind.log()
    assert "[native]: success" not in log and "[runner]: success" not in log
    assert f"{CLASS}#" in log and "handed-back: canary: phd's share" in log, "it had tasks"
    stood_by = log.count(f"queue {bridge.default_queue}: this worker can run none of its tasks")
    handed_back = log.count("handed-back: canary: phd's share")
    # A standby of 5 s a time: the messages it holds when it stops are all it takes then
    # (without the standby, each task it hands back comes again at once: hundreds).
    standbys = 1 + (time.monotonic() - started) / 5
    print(f"\n[canary] blind: {stood_by} standbys, {handed_back} hand-backs, {standbys:.1f}")
    assert 1 <= stood_by <= standbys
    assert handed_back <= 10 * standbys, f"{handed_back} hand-backs in {stood_by} standbys"
    said = [line for line in log.splitlines() if "cannot read the weights" in line]
    assert len(said) == 1 and "never read: no task runs here until they are read" in said[0]
    assert "1142" in said[0]  # MariaDB's refusal, as it gave it


def test_a_killed_guard_is_alerted_and_its_rollback_stays_in_sight(
    make_bridge, database_url, amqp_url, start_prometheus
):
    """A real Prometheus with the shipped rules scrapes two workers; the guard runs on
    the control one. Killed, its judgements stop: PhorgeBridgeCanaryGuardStopped goes
    pending while a class is shared, and the other worker still serves the rollback
    (the state row's), so PhorgeBridgeCanaryRolledBack does not resolve."""
    ports = [free_port(), free_port()]
    bridge = deployment(make_bridge, database_url, amqp_url)
    set_weights(bridge.engine, {CLASS: {"python": 20}, HEALTHY: {"python": 50}})
    roll_back(bridge.engine, CLASS, PYTHON)
    bridge.settings["BRIDGE_METRICS_PORT"] = str(ports[0])
    control = bridge.worker("control", [bridge.control_queue])
    bridge.settings["BRIDGE_METRICS_PORT"] = str(ports[1])
    worker = bridge.worker("worker", [bridge.default_queue])
    prometheus = start_prometheus([f"127.0.0.1:{port}" for port in ports])
    bridge.beat()
    bridge.wait_ready(control, worker)
    bridge.wait_until(prometheus.ready, WAIT, "Prometheus to be ready")

    def alert(state: str) -> bool:
        query = f'ALERTS{{alertname="PhorgeBridgeCanaryGuardStopped", alertstate="{state}"}}'
        return bool(prometheus.query(query))

    judged = "phorge_bridge_canary_guard_last_run_timestamp_seconds"
    bridge.wait_until(lambda: prometheus.query(f"time() - {judged} < 10"), WAIT, "judgements")
    bridge.wait_until(lambda: not alert("pending"), WAIT, "no alert while the guard judges")
    assert not alert("firing")

    control.kill()
    bridge.wait_until(lambda: alert("pending"), WAIT, "the alert on a guard gone")
    rolled = "max by (task_class, level) (phorge_bridge_canary_rolled_back) == 1"
    assert [r["metric"] for r in prometheus.query(rolled)] == [
        {"task_class": CLASS, "level": PYTHON}
    ]
    assert scraped(ports[1:], "phorge_bridge_canary_rolled_back", task_class=CLASS) == 1


def test_doctor_fails_a_share_that_no_live_worker_runs(make_bridge, database_url, amqp_url):
    """From what the live workers announce: a class the weights share with the bridge
    that none of them runs fails doctor; once the weights name only what they run, it
    passes."""
    bridge = deployment(make_bridge, database_url, amqp_url)
    nobody = "NobodyRunsThisWorker"  # no native handler, outside the runner's Standin*
    set_weights(bridge.engine, {CLASS: {"python": 20}, nobody: {"celery": 50}})
    worker = bridge.worker("worker", [bridge.default_queue, bridge.control_queue])
    bridge.wait_ready(worker)

    assert bridge.doctor()["canary reach"] == {
        "name": "canary reach",
        "status": "fail",
        "detail": f"{nobody} (50% for the bridge): no live worker runs it on "
        f"{bridge.default_queue}: those tasks wait",
    }
    set_weights(bridge.engine, {CLASS: {"python": 20}})
    assert (
        bridge.doctor()["canary reach"]["detail"]
        == "1 class(es) named for the bridge, each run by a live worker"
    )


def test_a_new_version_of_the_native_handler_is_judged_afresh(make_bridge, database_url, amqp_url):
    """The version the live workers announce for the class's native handler (its
    distribution's) is recorded as the new side's; a worker deployed with the handler's
    next version, beside the old one and then alone, starts a fresh judgement, in the
    history and in the report."""
    bridge = deployment(make_bridge, database_url, amqp_url)
    set_weights(bridge.engine, {CLASS: {"python": 20}})
    queues = [bridge.default_queue, bridge.control_queue]
    old = bridge.worker("worker-1", queues)
    bridge.beat("beat-1")
    bridge.wait_ready(old)

    def version() -> str | None:
        return read(bridge.engine).state.of(CLASS, PYTHON).version

    first, second = "canary_handlers 0", "canary_handlers 1"
    wait_until(lambda: version() == first, WAIT, "the first version", diagnose=bridge.diagnose)
    assert read(bridge.engine).state.history == (), "a first sight judges nothing afresh"
    deployed = write_plugin(
        bridge.directory / "canary-plugin-1",
        HANDLERS,
        "CanaryNative = canary_handlers:CanaryNative",
        extra=HANDLER_HELPERS,
        version="1",
    )
    path = bridge.environ("worker-2")["PYTHONPATH"].replace(str(bridge.plugin_dir), str(deployed))
    new = bridge.worker("worker-2", queues, env={"PYTHONPATH": path})
    bridge.wait_ready(new)
    both = f"{first}, {second}"
    wait_until(lambda: version() == both, WAIT, "both versions", diagnose=bridge.diagnose)
    old.signal(signal.SIGTERM)
    old.wait(WAIT)
    wait_until(lambda: version() == second, WAIT, "the new version alone", diagnose=bridge.diagnose)
    state = read(bridge.engine).state
    # Each change the guard saw (a worker slow to answer one survey is one more).
    changes = [(event.event, event.reason) for event in state.history]
    assert {event for event, _ in changes} == {"version"}
    assert changes[0][1].startswith(f"{first} -> ")
    assert changes[-1] == ("version", f"{both} -> {second}")
    assert state.judged_since(CLASS, PYTHON) == state.history[-1].at
    report = bridge.cli("canary", "report", CLASS)
    assert report.returncode == 0, report.stderr
    assert f"new side's version: {second}, judged afresh since" in report.stdout
    assert f"{both} -> {second}" in report.stdout
