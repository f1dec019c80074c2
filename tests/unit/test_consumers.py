"""Queues left without a consumer: the judgement, its cache and its log, and liveness age."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from bridge.config import load_settings
from bridge.handlers.registry import Coverage
from bridge.queue.model import QueueStats
from bridge.runtime.announce import Announcement
from bridge.runtime.consumers import (
    ConsumersCollector,
    ConsumerWatch,
    QueueConsumers,
    Survey,
    describe,
    due_by_queue,
    judge,
)
from bridge.runtime.liveness import staleness

SETTINGS = load_settings(
    {"BRIDGE_ROUTES": "Search*=search", "BRIDGE_CONTROL_QUEUE": "ctl", "BRIDGE_DEFAULT_QUEUE": "d"}
)


def test_due_rows_count_for_their_queue_and_the_control_queue_only_when_served():
    stats = QueueStats(
        server_time=0,
        by_class={
            "SearchWorker": {"queued": 2, "lease-expired": 1, "leased": 5},
            "MailWorker": {"queued": 4, "delayed": 3},
            "PhpOnlyWorker": {"queued": 9},  # not served: PHP's business
        },
    )
    due = due_by_queue(stats, ["SearchWorker", "MailWorker"], SETTINGS)
    assert due == {"ctl": 7, "search": 3, "d": 4}


def test_a_queue_is_stranded_when_it_has_due_rows_and_no_consumer():
    statuses = judge({"ctl": 3, "search": 3, "d": 0}, {"ctl": ["w1@h"], "other": ["w2@h"]})
    assert [(s.queue, s.stranded) for s in statuses] == [
        ("ctl", False),
        ("search", True),
        ("d", False),
    ]
    assert describe(statuses[1]) == "search: 3 due, consumed by NO LIVE WORKER"
    unknown = judge({"d": 5}, None)  # a broker without a control API
    assert not unknown[0].stranded and "unknown" in describe(unknown[0])


def test_the_watch_asks_at_most_every_interval_and_logs_each_change_once(caplog):
    answers = [
        Survey([QueueConsumers("search", 3, ())]),
        Survey([QueueConsumers("search", 2, ())]),
        Survey([QueueConsumers("search", 1, ())]),
        Survey([QueueConsumers("search", 2, ("w@h",))]),
    ]
    calls = []

    def survey(known) -> Survey:
        calls.append(1)
        return answers[len(calls) - 1]

    watch = ConsumerWatch(survey, every=0, log_changes=True)
    caplog.set_level(logging.WARNING)
    for _ in answers:
        watch.current()
    assert [r.getMessage() for r in caplog.records] == [
        "queue search has 2 due task(s) and no live worker consuming it",
        "queue search is consumed again (w@h)",
    ]
    cached = ConsumerWatch(survey, every=3600)
    calls.clear()
    cached.current(), cached.current()
    assert len(calls) == 1


def test_a_queue_whose_worker_is_still_starting_is_not_called_stranded(caplog):
    """Rows due when a fleet starts: the first poll's check finds no consumer yet, the
    next one finds the worker that was starting; nothing is logged."""
    answers = iter(
        [
            Survey([QueueConsumers("search", 14, ())]),
            Survey([QueueConsumers("search", 0, ("w@h",))]),
        ]
    )
    watch = ConsumerWatch(lambda known: next(answers), every=0, log_changes=True)
    caplog.set_level(logging.WARNING)
    watch.current(), watch.current()
    assert caplog.records == []


def test_a_class_runs_elsewhere_where_another_worker_consumes_its_queue_and_serves_it():
    runner = Coverage(runner=("Phabricator*",))
    nodes = {
        "me@h": Announcement("me@h", ("bridge.control",), Coverage()),
        "php@h": Announcement("php@h", ("php",), runner),
        "broken@h": Announcement("broken@h", ("php",), runner, down=("runner",)),
    }
    watch = ConsumerWatch(lambda known: Survey([], nodes))
    watch.current()
    assert watch.runs_elsewhere("PhabricatorSearchWorker", "php", node="me@h")
    assert not watch.runs_elsewhere("PhabricatorSearchWorker", "mail", node="me@h")
    assert not watch.runs_elsewhere("HarbormasterBuildWorker", "php", node="me@h"), "not served"
    # Seen from the PHP worker itself: only the broken one is left, and its runner is down.
    assert not watch.runs_elsewhere("PhabricatorSearchWorker", "php", node="php@h")


def test_a_coverage_names_the_php_path_beside_a_native_handler():
    """The old side of the python level: what would run a natively served class in PHP."""
    coverage = Coverage(native=("A", "B1"), runner=("B*",), exclude=("C*",))
    assert [coverage.transport_for(c) for c in ("A", "B1", "B2", "C1")] == [
        "native",
        "native",
        "runner",
        None,
    ]
    assert [coverage.php_transport_for(c) for c in ("A", "B1", "C1")] == [None, "runner", None]
    assert Coverage(native=("A",), conduit=True).php_transport_for("A") == "conduit"


def test_an_announcement_is_read_back_as_sent():
    coverage = Coverage(native=("A",), runner=("B*",), conduit=True, exclude=("C",))
    reply = {"queues": ["php"], "coverage": coverage.as_dict(), "down": ["conduit"]}
    assert Announcement.from_reply("w@h", reply) == Announcement(
        "w@h", ("php",), coverage, ("conduit",)
    )
    with pytest.raises(ValueError):
        Announcement.from_reply("w@h", {"error": "No such command"})
    with pytest.raises(ValueError):
        Announcement.from_reply("w@h", {"queues": [], "down": [], "coverage": {"native": []}})


def test_a_poll_does_not_wait_for_the_control_api_and_a_failed_ask_is_logged(caplog):
    """The poller's refresh runs on a thread: the caller returns while workers answer."""
    release, asked = threading.Event(), threading.Event()

    def slow_survey(known) -> Survey:
        asked.set()
        assert release.wait(10)
        return Survey([QueueConsumers("search", 3, ())])

    watch = ConsumerWatch(slow_survey, every=0, log_changes=True)
    caplog.set_level(logging.WARNING)
    watch.refresh_soon()
    assert asked.wait(10)
    watch.refresh_soon()  # one refresh at a time: this one is dropped, not queued
    assert watch.last == Survey()  # the caller did not wait for the answer
    release.set()
    for thread in [t for t in threading.enumerate() if t.name == "consumer-watch"]:
        thread.join(10)
    assert watch.last == Survey([QueueConsumers("search", 3, ())])

    def broken(known) -> Survey:
        raise ConnectionError("broker down")

    failing = ConsumerWatch(broken, every=0)
    failing.refresh_soon()
    for thread in [t for t in threading.enumerate() if t.name == "consumer-watch"]:
        thread.join(10)
    assert "could not check the queues' consumers: broker down" in caplog.text


def test_the_gauges_say_which_queue_has_no_consumer():
    watch = ConsumerWatch(
        lambda known: Survey(judge({"ctl": 1, "search": 1}, {"ctl": ["a@h", "b@h"]}))
    )
    families = {f.name: f for f in ConsumersCollector(watch).collect()}
    values = {(name, s.labels["queue"]): s.value for name, f in families.items() for s in f.samples}
    assert values == {
        ("phorge_bridge_queue_consumers", "ctl"): 2,
        ("phorge_bridge_queue_consumers", "search"): 0,
        ("phorge_bridge_queue_without_consumer", "ctl"): 0,
        ("phorge_bridge_queue_without_consumer", "search"): 1,
    }


def test_staleness_of_the_liveness_file(tmp_path):
    path = tmp_path / "alive"
    assert "does not exist" in staleness(path, 30)
    path.touch()
    assert staleness(path, 30) is None
    old = time.time() - 60
    os.utime(path, (old, old))
    assert "not consuming" in staleness(path, 30)


def test_the_watch_remembers_what_the_workers_it_saw_serve():
    """A queue whose workers all left still counts its due rows (it can scale from zero,
    and is reported stranded), but nothing is leased for the gone workers."""
    php = Announcement("php@h", ("php",), Coverage(runner=("Phabricator*",)))
    answers = iter([Survey([], {"php@h": php}), Survey([], {})])
    known_at_each: list[set[Coverage]] = []

    def survey(known) -> Survey:
        known_at_each.append(set(known))
        return next(answers)

    watch = ConsumerWatch(survey, every=0)
    watch.current(), watch.current()
    assert known_at_each == [set(), {php.coverage}]
    assert watch.served("PhabricatorSearchWorker") and not watch.served("Other")
    assert not watch.runs_elsewhere("PhabricatorSearchWorker", "php", node="me@h")
