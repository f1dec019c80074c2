"""The canary's gauges, read at each scrape from Phorge's config table and
archive, on SQLite and MariaDB: the weights in force and the rollbacks of every named
class, and both sides' runs, success ratio, run time and fallbacks over the guard's
window for the shared and the rolled-back ones, phd's runs included. Without a canary
they are absent and no archive row is read; the shipped rules and dashboard ask only
for gauges the collector serves."""

from __future__ import annotations

import itertools
import json
import logging
import re
import time
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.samples import Sample
from prometheus_tools import RULES, panel_queries

from bridge.canary.store import CanaryStore, encode, new_phid
from bridge.canary.weights import OPTION
from bridge.metrics import GUARD_JUDGED
from bridge.metrics.canary import NAMES, CanaryCollector
from bridge.queue.model import RESULT_FAILURE, RESULT_SUCCESS
from bridge.queue.schema import config_entry
from bridge.queue.schema import worker_archivetask as archive

MAIL, FEED = "ManiphestTransactionMailWorker", "FeedPublisherHTTPWorker"
SEARCH, HERALD = "PhabricatorSearchWorker", "HeraldWebhookWorker"
COMMITS = "PhabricatorRepositoryCommitParserWorker"
WINDOW = 300

WEIGHTS = {
    "*": {"celery": 0},
    SEARCH: {"celery": 100},  # moved wholly: a weight, no sides to compare
    MAIL: {"celery": 5},
    FEED: {"celery": 100, "python": 20},
    HERALD: {"celery": 100, "python": 50},  # rolled back below
    COMMITS: {"ramp": {"level": "celery", "steps": [1, 5, 25, 50, 100], "dwell": 600}},
}

Archive = Callable[..., None]


@pytest.fixture
def store(engine: sa.Engine) -> CanaryStore:
    return CanaryStore(engine, None)


@pytest.fixture
def archived(engine: sa.Engine) -> Archive:
    """Archive rows of a class as the given owner left them."""
    ids = itertools.count(1)

    def add(
        task_class: str,
        owner: str | None,
        count: int = 1,
        *,
        result: int = RESULT_SUCCESS,
        failures: int = 0,
        seconds: float = 0.01,
        ago: int = 0,
    ) -> None:
        when = int(time.time()) - ago
        rows = [
            {
                "id": next(ids),
                "taskClass": task_class,
                "leaseOwner": owner,
                "failureCount": failures,
                "dataID": 0,
                "result": result,
                "duration": round(seconds * 1_000_000),
                "dateCreated": when - 10,
                "dateModified": when,
                "priority": 4000,
                "archivedEpoch": when,
            }
            for _ in range(count)
        ]
        with engine.begin() as conn:
            conn.execute(sa.insert(archive), rows)

    return add


def collector_of(store: CanaryStore) -> CanaryCollector:
    return CanaryCollector(store, store.engine, WINDOW, 500)


def registry_of(collector: CanaryCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


@pytest.fixture
def statements(engine: sa.Engine) -> Iterator[list[str]]:
    """Every statement the engine runs from now on."""
    seen: list[str] = []

    def record(_conn, _cursor, statement, *_args) -> None:
        seen.append(statement)

    sa.event.listen(engine, "before_cursor_execute", record)
    yield seen
    sa.event.remove(engine, "before_cursor_execute", record)


def test_each_named_class_shows_its_weight_and_both_sides_of_the_window(store, archived):
    store.set_weights(WEIGHTS)
    now = int(time.time())
    store.change_state(
        lambda s: s.with_step(COMMITS, "celery", now, 2, 25.0).with_rollback(
            HERALD, "python", now, "new side success 70.0% over 20 runs"
        )
    )
    # The mail class at 5% to the bridge: phd's runs are the old side, the bridge's the
    # new one, and a fallback (phd-fallback) is a new-side failure and an old-side run.
    archived(MAIL, "phd:1:1700000000:host:2", 6, seconds=0.02)
    archived(MAIL, "7:1700000000:host:3", failures=1, seconds=0.05)  # Phorge's own: old
    archived(MAIL, "phd-fallback:1:1700000000:host:2", seconds=0.03)
    archived(MAIL, "bridge:runner:1:1700000000:host:1", 3, seconds=0.01)
    archived(MAIL, "bridge:runner:1:1700000000:host:1", 5, ago=WINDOW + 60)  # before it
    # The feed class at 20% native: the native handler new, Conduit (PHP) old.
    archived(FEED, "bridge:native:1:1700000000:host:1", 2, seconds=0.004)
    archived(FEED, "bridge:conduit:1:1700000000:host:1", seconds=0.3)
    archived(FEED, "bridge:conduit:1:1700000000:host:1", result=RESULT_FAILURE, seconds=1)
    archived(SEARCH, "bridge:runner:1:1700000000:host:1", 4)  # not shared: no sides
    registry = registry_of(collector_of(store))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    weights = {
        (c, level): value("phorge_bridge_canary_weight", task_class=c, level=level)
        for c in (SEARCH, MAIL, FEED, HERALD, COMMITS)
        for level in ("celery", "python")
    }
    assert weights == {
        (SEARCH, "celery"): 100,
        (SEARCH, "python"): 100,
        (MAIL, "celery"): 5,
        (MAIL, "python"): 100,
        (FEED, "celery"): 100,
        (FEED, "python"): 20,
        (HERALD, "celery"): 100,
        (HERALD, "python"): 0,  # rolled back
        (COMMITS, "celery"): 25,  # the ramp's third step
        (COMMITS, "python"): 100,
    }
    assert value("phorge_bridge_canary_weight", task_class="*", level="celery") is None
    rolled_back = {
        (s.labels["task_class"], s.labels["level"]): s.value
        for s in samples(registry, "phorge_bridge_canary_rolled_back")
    }
    assert rolled_back == {key: float(key == (HERALD, "python")) for key in weights}

    def side(task_class: str, level: str, name: str) -> dict[str, float | None]:
        return {
            s: value(f"phorge_bridge_canary_{name}", task_class=task_class, level=level, side=s)
            for s in ("new", "old")
        }

    def quantiles(task_class: str, level: str, side: str) -> tuple[float | None, ...]:
        return tuple(
            value(
                "phorge_bridge_canary_duration_seconds",
                task_class=task_class,
                level=level,
                side=side,
                quantile=q,
            )
            for q in ("0.5", "0.99")
        )

    assert side(MAIL, "celery", "runs") == {"new": 4, "old": 9}
    assert side(MAIL, "celery", "success_ratio") == {"new": 3 / 4, "old": 8 / 9}
    assert quantiles(MAIL, "celery", "new") == (0.01, 0.01)
    assert quantiles(MAIL, "celery", "old") == (0.02, 0.05)
    assert value("phorge_bridge_canary_fallbacks", task_class=MAIL, level="celery") == 1
    assert side(FEED, "python", "runs") == {"new": 2, "old": 2}
    assert side(FEED, "python", "success_ratio") == {"new": 1.0, "old": 0.5}
    assert quantiles(FEED, "python", "new") == (0.004, 0.004)
    assert quantiles(FEED, "python", "old") == (0.3, 0.3)  # successful runs' time only
    assert value("phorge_bridge_canary_fallbacks", task_class=FEED, level="python") == 0
    # Rolled back, and a ramp without runs yet: runs at zero, no ratio, no run time.
    for task_class, level in ((HERALD, "python"), (COMMITS, "celery")):
        assert side(task_class, level, "runs") == {"new": 0, "old": 0}
        assert side(task_class, level, "success_ratio") == {"new": None, "old": None}
        assert quantiles(task_class, level, "new") == quantiles(task_class, level, "old")
        assert quantiles(task_class, level, "new") == (None, None)
        assert value("phorge_bridge_canary_fallbacks", task_class=task_class, level=level) == 0
    # Only the shared and the rolled-back levels have sides.
    compared = {
        (s.labels["task_class"], s.labels["level"])
        for s in samples(registry, "phorge_bridge_canary_runs")
    }
    assert compared == {(MAIL, "celery"), (FEED, "python"), (HERALD, "python"), (COMMITS, "celery")}
    # What the exporter serves, in the text format Prometheus scrapes.
    served = generate_latest(registry).decode()
    assert (
        f'phorge_bridge_canary_duration_seconds{{level="celery",quantile="0.99",side="old",'
        f'task_class="{MAIL}"}} 0.05' in served
    )


def samples(registry: CollectorRegistry, name: str) -> list[Sample]:
    return [s for family in registry.collect() for s in family.samples if s.name == name]


@pytest.mark.parametrize("weights", [None, {}, {"*": {"celery": 0}}, {"*": {"celery": 100}}])
def test_without_a_named_class_there_is_no_gauge_and_no_archive_read(
    store, archived, statements, weights
):
    if weights is not None:
        store.set_weights(weights)
    archived(MAIL, "phd:1:1700000000:host:2", 3)
    statements.clear()
    assert list(collector_of(store).collect()) == []
    assert statements and not [s for s in statements if archive.name in s]


def test_a_class_named_at_full_weight_reads_no_archive_row(store, archived, statements):
    store.set_weights({SEARCH: {"celery": 100}, MAIL: {"celery": 0}})
    archived(MAIL, "phd:1:1700000000:host:2", 3)
    statements.clear()
    registry = registry_of(collector_of(store))
    weight = {"task_class": MAIL, "level": "celery"}
    assert registry.get_sample_value("phorge_bridge_canary_weight", weight) == 0
    assert samples(registry, "phorge_bridge_canary_runs") == []
    assert not [s for s in statements if archive.name in s]


def test_refused_weights_cost_only_the_canary_gauges_said_once(engine, store, caplog):
    with engine.begin() as conn:
        conn.execute(
            sa.insert(config_entry).values(
                phid=new_phid(),
                namespace="default",
                configKey=OPTION,
                value=encode({MAIL: {"celery": 300}}),
                isDeleted=0,
                dateCreated=0,
                dateModified=0,
            )
        )
    collector = collector_of(store)
    with caplog.at_level(logging.WARNING, "bridge.metrics.canary"):
        assert list(collector.collect()) == []
        assert list(collector.collect()) == []
    [line] = [r.getMessage() for r in caplog.records if r.name == "bridge.metrics.canary"]
    assert OPTION in line and MAIL in line
    store.set_weights({MAIL: {"celery": 30}})  # fixed
    registry = registry_of(collector)
    weight = {"task_class": MAIL, "level": "celery"}
    assert registry.get_sample_value("phorge_bridge_canary_weight", weight) == 30


def test_a_rollback_is_served_while_the_weights_are_refused(engine, store, caplog):
    store.set_weights({MAIL: {"celery": 30}})
    store.change_state(lambda state: state.with_rollback(MAIL, "celery", 1, "worse"))
    store._write(OPTION, lambda _old: encode({MAIL: {"celery": 300}}))
    collector = collector_of(store)
    rolled = {"task_class": MAIL, "level": "celery"}
    with caplog.at_level(logging.WARNING, "bridge.metrics.canary"):
        families = list(collector.collect())
        registry = registry_of(collector)
    assert [family.name for family in families] == ["phorge_bridge_canary_rolled_back"]
    assert registry.get_sample_value("phorge_bridge_canary_rolled_back", rolled) == 1
    [line] = [r.getMessage() for r in caplog.records if r.name == "bridge.metrics.canary"]
    assert OPTION in line and MAIL in line


def test_an_unreadable_config_table_costs_only_the_canary_gauges(store, monkeypatch, caplog):
    denied = sa.exc.OperationalError("SELECT", {}, Exception("SELECT command denied"))

    def read() -> None:
        raise denied

    monkeypatch.setattr(store, "read_values", read)
    with caplog.at_level(logging.WARNING, "bridge.metrics.canary"):
        assert list(collector_of(store).collect()) == []
    [line] = [r.getMessage() for r in caplog.records if r.name == "bridge.metrics.canary"]
    assert "config_entry" in line and "SELECT command denied" in line


def test_the_rules_and_the_dashboard_ask_only_for_gauges_the_collector_serves(sqlite_engine):
    texts = [RULES.read_text(), *(expr for _, expr in panel_queries())]
    used = {name for text in texts for name in re.findall(r"phorge_bridge_canary_\w+", text)}
    assert used == {*NAMES, GUARD_JUDGED._name}
    store = CanaryStore(sqlite_engine, None)
    store.set_weights({MAIL: {"celery": 5}})
    assert [family.name for family in collector_of(store).collect()] == list(NAMES)


def test_the_dashboard_shows_the_bridges_runs_by_implementation():
    queries = json.dumps(panel_queries())
    assert "sum by (implementation, outcome) (rate(phorge_bridge_outcomes_total" in queries
    assert "sum by (le, implementation) (rate(phorge_bridge_task_duration_seconds_bucket" in queries
