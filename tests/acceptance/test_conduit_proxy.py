"""The Conduit proxy end to end: real ``celery worker`` and ``beat`` against a fake Phorge.

The fake Phorge is a real HTTP server on 127.0.0.1 (a random port) speaking Conduit's
wire format; it answers ``worker.execute`` by task class, as a script per class below
(``FakePhorge.answer_<class>``), and records every request. The bridge runs with
``BRIDGE_CONDUIT_URL`` pointing at it and a well-formed token, on MariaDB, with RabbitMQ
and then Redis as its broker.

One worker (both queues) and one beat per broker serve the whole module: every
scenario's tasks are queued before the worker starts, so their waits overlap, and each
test waits for its own tasks only. Follow-up tasks get classes the bridge is told not to
serve (``Unserved*``), so they stay in the active table exactly as they were enqueued.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from conduit_fakes import (
    TOKEN,
    FakeServer,
    Reply,
    Request,
    conduit_error,
    conduit_result,
    execute_answer,
)
from sqlalchemy import Engine, func, select, update

from bridge.queue.dialect import db_now
from bridge.queue.model import RESULT_FAILURE, RESULT_SUCCESS, YIELD_OWNER
from bridge.queue.schema import lisk_counter, metadata
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_archivetask as archive
from bridge.queue.schema import worker_taskdata as taskdata

READ_TIMEOUT = 1  # BRIDGE_CONDUIT_READ_TIMEOUT
SLOW_REPLY = READ_TIMEOUT + 2  # the fake's delay for ProxySlow
BACKOFF = 3600  # RETRY_BASE = RETRY_MAX, no jitter: native handlers' wait, never the proxy's
PHORGE_WAIT = 300  # Phorge's flat wait: how long a read timeout holds a task back (1 s here)
SHORT_RETRY_WAIT = 1
LONG_RETRY_WAIT = 1800
LONG_YIELD = 600
SHORT_YIELD = 1  # below Phorge's floor: the bridge yields for 5 s
MIN_YIELD = 5
STEAL_FOR = 2  # seconds the fake's "other daemon" holds a stolen lease
PARENT_PRIORITY = 1500
BIG = 7713765376809813936  # beyond 2**53: a float would change it
INLINE_DATA_MAX = 256
# As PHP's json_encode stores data: escaped slashes, \u escapes. Re-encoding it in Python
# would give other bytes, so only the stored string passes the request check.
RAW_SMALL = (
    '{"key":7713765376809813936,"uri":"https:\\/\\/hooks.example\\/x","n":[],"s":"caf\\u00e9"}'
)
RAW_LARGE = (  # longer than INLINE_DATA_MAX: the worker reads it from worker_taskdata
    '{"key":7713765376809813936,"pad":"' + "x" * 400 + '","uri":"https:\\/\\/h.example\\/y"}'
)
# Slack on a wait: whole seconds of the database clock, a poll, dispatch. Seen on 2 cores
# loaded by other tests and two busy loops: at most 0.99 s late (retry), 0.98 s (yield).
LATENESS = 4.0
WAIT = 30.0
OUTAGES_AFTER = 15  # seconds after the module's start
HTML_502 = (
    b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
    b"<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n"
    b"</body>\r\n</html>\r\n"
)
HTML_EXCEPTION = (
    b"<!DOCTYPE html><html><head><title>Unhandled Exception</title>"
    b"<style>body { color: red; }</style></head><body><h1>Unhandled Exception "
    b"(&quot;AphrontQueryException&quot;)</h1><p>#1045: Access denied</p></body></html>"
)


def execute_result(outcome: str, **fields: Any) -> Reply:
    """A ``worker.execute`` answer shaped as the extension's (every key present)."""
    return conduit_result(execute_answer(**{"result": outcome, "duration": 1234, **fields}))


@dataclass
class Call:
    time: float
    request: Request
    params: dict[str, Any]


@dataclass
class FakePhorge:
    """The server's responder: one ``answer_<taskClass>`` script per class, every call kept."""

    engine: Engine | None = None  # the module's database, for stealing a lease
    delay_until: int = 0
    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def respond(self, request: Request) -> Reply:
        if request.path != "/api/worker.execute":  # the circuit breaker's probe
            return conduit_result({"userName": "bridge-bot", "roles": ["admin"]})
        params = request.params
        with self.lock:
            attempt = len(self.calls_of(params["taskID"]))
            self.calls.append(Call(time.time(), request, params))
        answer = getattr(self, f"answer_{params['taskClass']}", None)
        if answer is None:
            return execute_result("permanent-failure", message="no script for this class")
        return answer(params, attempt)

    def calls_of(self, task_id: int) -> list[Call]:
        return [c for c in list(self.calls) if c.params.get("taskID") == task_id]

    def classes(self) -> set[str]:
        return {c.params.get("taskClass") for c in list(self.calls)}

    def followups(self, task_class: str) -> list[dict[str, Any]]:
        return [
            {"taskClass": task_class, "data": {"n": 1, "big": BIG}, "options": []},
            {
                "taskClass": task_class,
                "data": {"n": 2},
                "options": {
                    "priority": 4000,
                    "objectPHID": "PHID-TASK-child",
                    "containerPHID": "PHID-PROJ-child",
                    "delayUntil": self.delay_until,
                },
            },
        ]

    # -- one script per task class -------------------------------------------------------

    def answer_ProxySuccess(self, params, attempt) -> Reply:
        return execute_result("success")

    def answer_ProxyEcho(self, params, attempt) -> Reply:
        if attempt == 0:
            return execute_result(
                "failure", retryWait=SHORT_RETRY_WAIT, message="Exception: try again"
            )
        return execute_result("success")

    def answer_ProxyPermanent(self, params, attempt) -> Reply:
        # Follow-ups in a failed run's answer must not be queued (Phorge never would).
        return execute_result(
            "permanent-failure",
            message="PhabricatorWorkerPermanentFailureException: the object is gone",
            followups=self.followups("UnservedChildOfPermanent"),
        )

    def answer_ProxyRetryLater(self, params, attempt) -> Reply:
        return execute_result(
            "failure", retryWait=LONG_RETRY_WAIT, message="Exception: mail server down"
        )

    def answer_ProxyYieldLong(self, params, attempt) -> Reply:
        return execute_result("yield", yieldDuration=LONG_YIELD)

    def answer_ProxyYieldShort(self, params, attempt) -> Reply:
        return execute_result("yield", yieldDuration=SHORT_YIELD)

    def answer_ProxyParent(self, params, attempt) -> Reply:
        return execute_result("success", followups=self.followups("UnservedChildOfParent"))

    def answer_ProxyStolen(self, params, attempt) -> Reply:
        if attempt == 0:
            # Another daemon takes the lease while PHP runs the worker; its success must
            # then write nothing, follow-ups included.
            self.steal(params["taskID"])
        return execute_result("success", followups=self.followups("UnservedChildOfStolen"))

    def answer_ProxyBadFollowup(self, params, attempt) -> Reply:
        # The extension passes through any int priority and any class name a PHP worker
        # queued: priority 0 gets the parent's, the overlong class is skipped.
        good, _ = self.followups("UnservedChildOfBad")
        bad_priority = {**good, "data": {"bad": "priority"}, "options": {"priority": 0}}
        bad_class = {**good, "taskClass": "UnservedChildOfBad" + "X" * 50}
        return execute_result("success", followups=[bad_priority, good, bad_class])

    # Outages answer the first call only: a task failing forever would keep tripping the
    # worker's circuit breaker and hold the module's other proxied tasks back.
    def answer_ProxyHtml502(self, params, attempt) -> Reply:
        if attempt:
            return execute_result("success")
        return Reply(502, HTML_502, {"Content-Type": "text/html"})

    def answer_ProxyHtml200(self, params, attempt) -> Reply:
        if attempt:
            return execute_result("success")
        return Reply(200, HTML_EXCEPTION, {"Content-Type": "text/html; charset=UTF-8"})

    def answer_ProxySlow(self, params, attempt) -> Reply:
        reply = execute_result("success")
        reply.delay = SLOW_REPLY
        return reply

    def answer_ProxyAuth(self, params, attempt) -> Reply:
        if attempt:
            return execute_result("success")
        # Phorge echoes the rejected token: the bridge must never log it.
        return conduit_error("ERR-INVALID-AUTH", f'API token "{TOKEN}" is not valid.')

    def steal(self, task_id: int) -> None:
        assert self.engine is not None
        with self.engine.begin() as conn:
            now = conn.execute(select(db_now())).scalar_one()
            conn.execute(
                update(active)
                .where(active.c.id == task_id)
                .values(leaseOwner=f"thief:1:{now}:fake-phorge:1", leaseExpires=now + STEAL_FOR)
            )


class Sampler:
    """Watches, in single-statement snapshots, whether a parent is archived and how many of
    its follow-ups exist, from before the worker starts until the module ends."""

    def __init__(self, engine: Engine, parents: dict[int, str]) -> None:
        def count(table, *where):
            return select(func.count()).select_from(table).where(*where).scalar_subquery()

        self.parents = parents
        columns = []
        for parent_id, child_class in parents.items():
            columns.append(count(archive, archive.c.id == parent_id))
            columns.append(count(active, active.c.taskClass == child_class))
        self.query = select(*columns)
        self.engine = engine
        self.samples: list[tuple[float, dict[int, tuple[int, int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def _run(self) -> None:
        with self.engine.connect() as conn:
            while not self._stop.wait(0.02):
                row = conn.execute(self.query).one()
                conn.rollback()  # end the read view: the next sample sees new commits
                states = {
                    parent: (row[2 * n], row[2 * n + 1]) for n, parent in enumerate(self.parents)
                }
                self.samples.append((time.time(), states))

    def of(self, parent_id: int) -> list[tuple[float, tuple[int, int]]]:
        return [(t, states[parent_id]) for t, states in list(self.samples)]

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


@dataclass
class Scenario:
    bridge: Any  # bridge_harness.Bridge
    fake: FakePhorge
    ids: dict[str, int] = field(default_factory=dict)
    counter_before: int = 0
    sampler: Sampler | None = None

    def add(self, name: str, task_class: str, data: Any = None, **options: Any) -> int:
        [self.ids[name]] = self.bridge.enqueue(task_class, data, **options)
        return self.ids[name]

    def row(self, name: str):
        return self.bridge.active_rows([self.ids[name]]).get(self.ids[name])

    def wait_row(self, name: str, condition: Callable[[Any], bool], what: str):
        """Wait until the named task's active row meets ``condition``; return the row."""

        def check():
            row = self.row(name)
            return row if row is not None and condition(row) else None

        return self.bridge.wait_until(check, WAIT, f"{name}: {what}")

    def now(self) -> int:
        return self.bridge.queue.server_time()

    def counter(self) -> int:
        with self.bridge.engine.connect() as conn:
            return conn.execute(select(lisk_counter.c.counterValue)).scalar_one()

    def children(self, task_class: str) -> list[Any]:
        query = (
            select(active, taskdata.c.data.label("rawData"))
            .select_from(active.join(taskdata, taskdata.c.id == active.c.dataID))
            .where(active.c.taskClass == task_class)
            .order_by(active.c.id)
        )
        with self.bridge.engine.connect() as conn:
            return list(conn.execute(query))

    def stored_data(self, task_id: int) -> str:
        table = archive if self.bridge.archived([task_id]) else active
        query = select(taskdata.c.data).join(table, table.c.dataID == taskdata.c.id)
        with self.bridge.engine.connect() as conn:
            return conn.execute(query.where(table.c.id == task_id)).scalar_one()


@pytest.fixture(scope="module", params=["rabbitmq", "redis"])
def proxy(request, make_module_bridge, module_database_url) -> Iterator[Scenario]:
    broker_url = request.getfixturevalue("amqp_url" if request.param == "rabbitmq" else "redis_url")
    fake = FakePhorge()
    with FakeServer(fake.respond) as server:
        bridge = make_module_bridge(
            module_database_url,
            broker_url,
            CONDUIT_URL=server.url,
            CONDUIT_TOKEN=TOKEN,
            CONDUIT_READ_TIMEOUT=str(READ_TIMEOUT),
            # Each task's HTTP answer is scripted on its own here; batched requests are
            # test_conduit_batches.py's.
            CONDUIT_BATCH="1",
            POLL_INTERVAL="0.2",
            RETRY_BASE=str(BACKOFF),
            RETRY_MAX=str(BACKOFF),
            RETRY_JITTER="0",
            HANDLERS_EXCLUDE="Unserved*",
            INLINE_DATA_MAX=str(INLINE_DATA_MAX),
        )
        fake.engine = bridge.engine
        with bridge.engine.begin() as conn:  # the previous broker's run used this database
            conn.exec_driver_sql("SET SESSION lock_wait_timeout = 10")
            for table in metadata.sorted_tables:
                conn.exec_driver_sql(f"TRUNCATE TABLE `{table.name}`")
        s = Scenario(bridge, fake)
        fake.delay_until = s.now() + 3600

        s.add("echo-inline", "ProxyEcho", priority=1200, object_phid="PHID-TASK-echo")
        bridge.corrupt_data(s.ids["echo-inline"], RAW_SMALL)  # stored as PHP would store it
        s.add("echo-stored", "ProxyEcho", container_phid="PHID-REPO-echo")
        bridge.corrupt_data(s.ids["echo-stored"], RAW_LARGE)
        for n in range(3):
            s.add(f"success-{n}", "ProxySuccess", {"n": n})
        s.add("permanent", "ProxyPermanent", {})
        s.add("retry-later", "ProxyRetryLater", {})
        s.add("yield-long", "ProxyYieldLong", {})
        s.add("yield-short", "ProxyYieldShort", {})
        s.add("parent", "ProxyParent", {"big": BIG}, priority=PARENT_PRIORITY)
        s.add("stolen", "ProxyStolen", {}, priority=PARENT_PRIORITY)
        s.add("bad-followup", "ProxyBadFollowup", {})
        # Each outage trips the worker's circuit breaker, which holds proxied work back for
        # a moment: they come after the scenarios whose timing is measured.
        outages_from = s.now() + OUTAGES_AFTER
        s.add("html-502", "ProxyHtml502", {}, delay_until=outages_from)
        s.add("html-200", "ProxyHtml200", {}, delay_until=outages_from)
        s.add("slow", "ProxySlow", {})
        s.add("auth", "ProxyAuth", {}, delay_until=outages_from)
        for n in range(2):
            s.add(f"native-{n}", "PhabricatorTestWorker", {})
        s.add("native-plugin", "RecordedA", {})
        s.counter_before = s.counter()

        parents = {
            s.ids["parent"]: "UnservedChildOfParent",
            s.ids["stolen"]: "UnservedChildOfStolen",
            s.ids["permanent"]: "UnservedChildOfPermanent",
        }
        with Sampler(bridge.engine, parents) as s.sampler:
            worker = bridge.worker(
                "worker", [bridge.default_queue, bridge.control_queue], concurrency=2
            )
            bridge.beat()
            bridge.wait_ready(worker)
            yield s
            bridge.stop()  # before the fake Phorge goes away


def logs_of(s: Scenario) -> str:
    return s.bridge.logs()


# -- the request ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "raw", "priority", "object_phid", "container_phid"),
    [
        pytest.param("echo-inline", RAW_SMALL, 1200, "PHID-TASK-echo", None, id="inline"),
        pytest.param("echo-stored", RAW_LARGE, 2000, None, "PHID-REPO-echo", id="stored"),
    ],
)
def test_the_request_carries_the_task_its_raw_data_and_the_token(
    proxy, name, raw, priority, object_phid, container_phid
):
    task_id = proxy.ids[name]
    [row] = proxy.bridge.wait_archived([task_id], timeout=WAIT).values()
    # The first answer was a failure with retryWait 1 s, the second a success.
    assert (row.result, row.failureCount) == (RESULT_SUCCESS, 1)
    assert proxy.stored_data(task_id) == raw

    calls = proxy.fake.calls_of(task_id)
    assert len(calls) == 2
    for failure_count, call in enumerate(calls):
        request = call.request
        assert (request.method, request.path) == ("POST", "/api/worker.execute")
        assert request.headers["content-type"] == "application/x-www-form-urlencoded"
        form = request.form
        assert form.keys() == {"params", "output", "__conduit__"}
        assert form["output"] == ["json"]
        params = dict(call.params)
        assert params.pop("__conduit__") == {"token": TOKEN}
        # The execution's trace context, as a parameter and as a header.
        traceparent = params.pop("traceparent")
        assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", traceparent)
        assert request.headers["traceparent"] == traceparent
        assert params == {
            "taskID": task_id,
            "taskClass": "ProxyEcho",
            "data": raw,  # the stored bytes, not a re-encoding
            "failureCount": failure_count,
            "priority": priority,
            "objectPHID": object_phid,
            "containerPHID": container_phid,
        }
        assert json.loads(params["data"])["key"] == BIG
    # retryWait was honoured: the retry came at least its 1 s later.
    gap = calls[1].time - calls[0].time
    assert SHORT_RETRY_WAIT <= gap <= SHORT_RETRY_WAIT + LATENESS, f"retried after {gap:.2f} s"


# -- each result, its queue outcome --------------------------------------------------------


def test_success_archives_with_result_0(proxy):
    ids = [proxy.ids[f"success-{n}"] for n in range(3)]
    archived = proxy.bridge.wait_archived(ids, timeout=WAIT)
    assert {(row.result, row.failureCount) for row in archived.values()} == {(RESULT_SUCCESS, 0)}
    assert [len(proxy.fake.calls_of(task_id)) for task_id in ids] == [1, 1, 1]


def test_permanent_failure_archives_with_result_1_and_queues_nothing(proxy):
    task_id = proxy.ids["permanent"]
    [row] = proxy.bridge.wait_archived([task_id], timeout=WAIT).values()
    assert (row.result, row.failureCount) == (RESULT_FAILURE, 0)
    assert len(proxy.fake.calls_of(task_id)) == 1
    assert (
        f"task {task_id} failed permanently: "
        "PhabricatorWorkerPermanentFailureException: the object is gone"
    ) in logs_of(proxy)
    assert proxy.children("UnservedChildOfPermanent") == []


def test_failure_counts_one_and_waits_the_retry_wait_by_the_database_clock(proxy):
    row = proxy.wait_row("retry-later", lambda r: r.failureCount == 1, "a counted failure")
    now = proxy.now()
    assert row.leaseOwner.startswith("bridge:")  # the failed run's owner stays, as in Phorge
    assert row.leaseExpires == row.failureTime + LONG_RETRY_WAIT
    assert now - WAIT <= row.failureTime <= now
    assert proxy.bridge.archived([row.id]) == {}
    assert len(proxy.fake.calls_of(row.id)) == 1


@pytest.mark.parametrize(
    ("name", "seconds"), [("yield-long", LONG_YIELD), ("yield-short", MIN_YIELD)]
)
def test_yield_hands_the_task_back_for_its_duration_but_at_least_5s(proxy, name, seconds):
    row = proxy.wait_row(name, lambda r: r.leaseOwner == YIELD_OWNER, "a yield")
    now = proxy.now()
    # The yield's UPDATE set both from one reading of the database clock.
    assert row.leaseExpires == row.dateModified + seconds
    assert now - WAIT <= row.dateModified <= now
    assert (row.failureCount, row.failureTime) == (0, None)
    assert proxy.bridge.archived([row.id]) == {}


def test_a_short_yield_comes_back_after_5s(proxy):
    task_id = proxy.ids["yield-short"]
    calls = proxy.bridge.wait_until(
        lambda: proxy.fake.calls_of(task_id)[:2] if len(proxy.fake.calls_of(task_id)) > 1 else [],
        WAIT,
        "the yielded task's second run",
    )
    gap = calls[1].time - calls[0].time
    assert MIN_YIELD <= gap <= MIN_YIELD + LATENESS, f"came back after {gap:.2f} s"
    assert [c.params["failureCount"] for c in calls] == [0, 0]


# -- follow-ups ----------------------------------------------------------------------------


def wait_for_sample(proxy, parent_id: int, state: tuple[int, int]) -> None:
    proxy.bridge.wait_until(
        lambda: (samples := proxy.sampler.of(parent_id)) and samples[-1][1] == state,
        WAIT,
        f"a snapshot of parent {parent_id} in state {state}",
    )


def assert_enqueued_with_the_archive(proxy, parent_id: int) -> list[tuple[float, tuple]]:
    """Every snapshot saw the parent active with no follow-up, or archived with both."""
    samples = proxy.sampler.of(parent_id)
    assert {state for _, state in samples} == {(0, 0), (1, 2)}, "follow-ups not atomic"
    return samples


def test_followups_are_enqueued_once_atomically_with_the_archive(proxy):
    bridge = proxy.bridge
    parent_id = proxy.ids["parent"]
    [parent] = bridge.wait_archived([parent_id], timeout=WAIT).values()
    assert (parent.result, parent.priority) == (RESULT_SUCCESS, PARENT_PRIORITY)
    wait_for_sample(proxy, parent_id, (1, 2))
    assert_enqueued_with_the_archive(proxy, parent_id)

    first, second = proxy.children("UnservedChildOfParent")
    # Ids come from lisk_counter, after every id taken before the worker started, in
    # one batch (consecutive), and the counter stands at or past them.
    assert first.id > proxy.counter_before
    assert second.id == first.id + 1
    assert proxy.counter() >= second.id
    assert json.loads(first.rawData) == {"n": 1, "big": BIG}
    assert first.rawData == '{"n":1,"big":7713765376809813936}'
    # No options: the parent's priority, no PHIDs, due at once.
    assert (first.priority, first.objectPHID, first.containerPHID) == (PARENT_PRIORITY, None, None)
    assert (first.leaseOwner, first.leaseExpires, first.failureCount) == (None, None, 0)
    # Options given: they win.
    assert json.loads(second.rawData) == {"n": 2}
    assert (second.priority, second.objectPHID, second.containerPHID) == (
        4000,
        "PHID-TASK-child",
        "PHID-PROJ-child",
    )
    assert (second.leaseOwner, second.leaseExpires) == (None, proxy.fake.delay_until)


def test_a_success_after_the_lease_was_taken_away_enqueues_nothing(proxy):
    bridge = proxy.bridge
    task_id = proxy.ids["stolen"]
    [row] = bridge.wait_archived([task_id], timeout=WAIT).values()
    assert row.result == RESULT_SUCCESS
    assert row.leaseOwner.startswith("bridge:")  # archived under the bridge's second lease
    lost, won = proxy.fake.calls_of(task_id)
    assert won.time - lost.time >= STEAL_FOR
    assert f"ProxyStolen#{task_id} [conduit]: lease-lost" in logs_of(proxy)

    wait_for_sample(proxy, task_id, (1, 2))
    samples = assert_enqueued_with_the_archive(proxy, task_id)
    # Between the lost run's answer and the second run, nothing was queued.
    between = [state for t, state in samples if lost.time + 0.5 < t < won.time]
    assert between and set(between) == {(0, 0)}
    # Two answers each carried two follow-ups: the queue holds them once.
    assert [json.loads(c.rawData)["n"] for c in proxy.children("UnservedChildOfStolen")] == [1, 2]


def test_a_followup_the_queue_refuses_is_skipped_and_the_parent_still_archived(proxy):
    bridge = proxy.bridge
    task_id = proxy.ids["bad-followup"]
    bridge.wait_until(
        lambda: bridge.archived([task_id]) or "raised unexpected: ValueError" in logs_of(proxy),
        WAIT,
        "the parent's archive (or the worker's error)",
    )
    [row] = bridge.archived([task_id]).values()
    assert row.result == RESULT_SUCCESS
    # Priority 0 falls back to the parent's (PHP would write 0; the queue refuses it).
    children = proxy.children("UnservedChildOfBad")
    assert [json.loads(c.rawData) for c in children] == [{"bad": "priority"}, {"n": 1, "big": BIG}]
    assert children[0].priority == 2000
    assert len(proxy.fake.calls_of(task_id)) == 1


# -- Conduit problems are not the task's failures -----------------------------------------


def assert_retried_without_a_failure(proxy, name: str):
    """The task met a Conduit outage, was handed back (no failure counted), and its second
    call, once the circuit breaker's probe found the fake healthy, succeeded."""
    task_id = proxy.ids[name]
    [row] = proxy.bridge.wait_archived([task_id], timeout=WAIT).values()
    assert (row.result, row.failureCount) == (RESULT_SUCCESS, 0)
    assert len(proxy.fake.calls_of(task_id)) == 2
    return row


@pytest.mark.parametrize(
    ("name", "logged"),
    [
        pytest.param(
            "html-502",
            "HTTP 502 from {url}/api/worker.execute: 502 Bad Gateway 502 Bad Gateway",
            id="502",
        ),
        pytest.param("html-200", "is not a Conduit JSON response: Unhandled Exception", id="200"),
    ],
)
def test_an_html_error_page_holds_the_task_back_without_a_failure(proxy, name, logged):
    row = assert_retried_without_a_failure(proxy, name)
    url = proxy.bridge.settings["BRIDGE_CONDUIT_URL"]
    proxy.bridge.wait_until(lambda: logged.format(url=url) in logs_of(proxy), WAIT, logged)
    assert f"#{row.id} [conduit]: handed-back: Conduit unavailable" in logs_of(proxy)
    assert "Conduit is unavailable; PHP-only tasks are held back" in logs_of(proxy)
    assert "color: red" not in logs_of(proxy)  # the excerpt is text, not markup


def test_an_answer_slower_than_the_read_timeout_yields_for_phorges_wait(proxy):
    # PHP may still be running it: no second run within Phorge's wait.
    # A row leased in the second it was queued also expires dateModified + 300 (the
    # dispatch lease's default): only the yield's owner tells the two apart.
    row = proxy.wait_row(
        "slow",
        lambda r: (
            r.leaseOwner == YIELD_OWNER and r.leaseExpires == (r.dateModified or 0) + PHORGE_WAIT
        ),
        "a long yield",
    )
    assert row.leaseOwner == YIELD_OWNER
    assert (row.failureCount, row.failureTime) == (0, None)
    assert len(proxy.fake.calls_of(row.id)) == 1
    assert f"timed out waiting for {proxy.bridge.settings['BRIDGE_CONDUIT_URL']}" in (
        logs_of(proxy)
    )
    assert f"(after {READ_TIMEOUT}s) (the work may still be running in PHP)" in logs_of(proxy)


def test_an_authentication_error_is_loud_and_counts_no_failure(proxy):
    assert_retried_without_a_failure(proxy, "auth")
    message = (
        "PHORGE REFUSED THE BRIDGE'S CONDUIT TOKEN (ERR-INVALID-AUTH): no PHP task can run "
        "until an operator fixes BRIDGE_CONDUIT_TOKEN"
    )
    proxy.bridge.wait_until(lambda: message in logs_of(proxy), WAIT, "the refusal's log line")
    logs = logs_of(proxy)
    assert TOKEN not in logs
    assert "[token redacted]" in logs


def test_the_worker_keeps_serving_after_conduit_problems(proxy):
    for name in ("html-502", "html-200", "auth"):
        assert_retried_without_a_failure(proxy, name)
    proxy.wait_row("slow", lambda r: r.leaseOwner == YIELD_OWNER, "a yield")
    slow_call = proxy.fake.calls_of(proxy.ids["slow"])[0]
    fresh = proxy.bridge.enqueue("ProxySuccess", {"fresh": True}, count=3)
    archived = proxy.bridge.wait_archived(fresh, timeout=WAIT)
    assert {row.result for row in archived.values()} == {RESULT_SUCCESS}
    for task_id in fresh:
        [call] = proxy.fake.calls_of(task_id)
        assert call.time > slow_call.time + READ_TIMEOUT
    assert all(p.running() for p in proxy.bridge.processes)


# -- native handlers stay native -----------------------------------------------------------


def test_classes_with_a_native_handler_are_not_sent_to_phorge(proxy):
    bridge = proxy.bridge
    names = ["native-0", "native-1", "native-plugin"]
    ids = [proxy.ids[name] for name in names]
    archived = bridge.wait_archived(ids, timeout=WAIT)
    assert {row.result for row in archived.values()} == {RESULT_SUCCESS}
    assert [proxy.fake.calls_of(task_id) for task_id in ids] == [[], [], []]
    sent = proxy.fake.classes()
    assert not sent & {"PhabricatorTestWorker", "RecordedA"}
    assert {"ProxySuccess", "ProxyEcho", "ProxyParent"} <= sent
    assert len(bridge.runs_of(proxy.ids["native-plugin"])) == 1  # the plugin handler ran it
    # Follow-up classes the bridge does not serve were never sent either.
    assert not any(name.startswith("Unserved") for name in sent)


def test_every_request_used_phorges_form_and_the_token(proxy):
    """All of the module's calls so far (one task's request is checked field by field above)."""
    calls = proxy.bridge.wait_until(
        lambda: list(proxy.fake.calls) if len(proxy.fake.calls) >= 15 else [],
        WAIT,
        "the scenarios' calls",
    )
    for call in calls:
        assert call.request.path == "/api/worker.execute"
        assert call.request.form["output"] == ["json"]
        assert call.params["__conduit__"] == {"token": TOKEN}
