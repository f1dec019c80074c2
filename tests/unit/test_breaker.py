"""A transport's availability (Conduit's circuit breaker), on a fake clock, and the proxy
and client around it."""

from __future__ import annotations

import logging
from itertools import pairwise

import pytest
from conduit_fakes import TOKEN, FakeServer, Reply, conduit_error, conduit_result, execute_answer

from bridge.errors import ConduitTransportError
from bridge.handlers.api import HandBack, TaskContext
from bridge.handlers.availability import Availability
from bridge.transports.conduit.client import ConduitClient
from bridge.transports.conduit.handler import ConduitProxyHandler


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_once_backs_off_from_1_to_60_s_and_closes_on_the_first_success(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, answers, probes = Clock(), ["down"], []

    def probe() -> str | None:
        probes.append(clock.now)
        return answers[-1]

    breaker = Availability(probe, clock=clock)
    changes: list[bool] = []
    breaker.listeners.append(changes.append)
    breaker.failure("refused")
    breaker.failure("refused again")  # already open: no second line
    while clock.now < 100 + 600:
        assert not breaker.allow()
        clock.now += 0.25
    waits = [b - a for a, b in pairwise([100.0, *probes])]
    # Each wait is a quarter of the outage so far, between 1 s and 60 s.
    assert waits[:4] == [1, 1, 1, 1] and max(waits) == waits[-1] == 60
    for start, wait in zip(probes, waits[1:], strict=False):
        assert wait - 0.25 <= min(max((start - 100) / 4, 1), 60) <= wait
    answers.append(None)
    clock.now += 60
    assert breaker.allow() and not breaker.is_down
    assert changes == [True, False]
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 2 and "unavailable" in lines[0] and "available again" in lines[1]


def test_verify_probes_a_closed_breaker_only_when_its_evidence_is_stale() -> None:
    clock, probes = Clock(), []
    breaker = Availability(lambda: probes.append(clock.now) or "down", clock=clock)
    breaker.success()
    assert breaker.verify() and probes == []  # fresh evidence
    clock.now += 6
    assert not breaker.verify() and breaker.is_down and probes == [106.0]


def task() -> TaskContext:
    return TaskContext(7, "PhabricatorSearchWorker", {}, 0, 2000, None, None, raw_data="{}")


def test_the_proxy_holds_tasks_back_without_calling_while_open() -> None:
    down = {"on": True}

    def respond(request) -> Reply:
        if down["on"]:
            return Reply(502, b"<html>Bad Gateway</html>")
        if request.path == "/api/user.whoami":
            return conduit_result({"userName": "bot"})
        return conduit_result(execute_answer(result="success"))

    with FakeServer(respond) as server:
        proxy = ConduitProxyHandler(ConduitClient(server.url, TOKEN))
        with pytest.raises(HandBack):
            proxy.run(task())
        assert proxy.availability.is_down
        with pytest.raises(HandBack, match="held back"):
            proxy.run(task())  # before the first probe is due: no request at all
        assert len(server.requests) == 1
        down["on"] = False
        proxy.availability._next_probe = 0  # the probe is due
        proxy.run(task())
        assert [r.path for r in server.requests[1:]] == ["/api/user.whoami", "/api/worker.execute"]


def test_the_probe_sees_a_revoked_token() -> None:
    with FakeServer(lambda r: conduit_error("ERR-INVALID-AUTH", f"token {TOKEN} bad")) as server:
        reason = ConduitProxyHandler(ConduitClient(server.url, TOKEN)).probe()
    assert reason is not None and "BRIDGE_CONDUIT_TOKEN" in reason and TOKEN not in reason


def test_a_token_straddling_the_excerpts_cut_leaks_nothing() -> None:
    body = b"x" * 230 + b" " + TOKEN.encode() + b" trailing"
    with (
        FakeServer(lambda r: Reply(502, body)) as server,
        pytest.raises(ConduitTransportError) as info,
    ):
        ConduitClient(server.url, TOKEN).call("worker.execute", {})
    assert TOKEN[:8] not in str(info.value)
