"""Trace context: W3C traceparents, and the tag on every log line written during a task."""

from __future__ import annotations

import logging
import re

import pytest

from bridge.engine.tracing import (
    TaskLogFilter,
    TaskTrace,
    new_traceparent,
    traced,
    traceparent_or_new,
)

SENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_new_traceparent_is_a_valid_sampled_one():
    first, second = new_traceparent(), new_traceparent()
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", first)
    assert first != second
    assert traceparent_or_new(first) == first


@pytest.mark.parametrize(
    "sent",
    [
        None,
        "",
        "garbage",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # all-zero parent id
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # unknown version
        42,
    ],
)
def test_the_senders_traceparent_is_kept_only_when_valid(sent):
    assert traceparent_or_new(SENT) == SENT
    replaced = traceparent_or_new(sent)
    assert replaced != sent and traceparent_or_new(replaced) == replaced


def test_lines_logged_during_a_task_carry_its_id_class_owner_and_traceparent(caplog):
    caplog.handler.addFilter(TaskLogFilter())
    log = logging.getLogger("bridge.test")
    trace = TaskTrace(7, "PhabricatorTestWorker", "bridge:1:1700000000:host:1", SENT)
    with caplog.at_level(logging.INFO):
        log.info("before")
        with traced(trace):
            log.info("ran %s in %d ms", "it", 5)
        log.info("after")
    assert caplog.messages == [
        "before",
        "ran it in 5 ms [task=7 class=PhabricatorTestWorker owner=bridge:1:1700000000:host:1"
        f" traceparent={SENT}]",
        "after",
    ]
