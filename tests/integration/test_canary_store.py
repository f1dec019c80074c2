"""The canary's options in Phorge's config table on MariaDB (bridge/canary/store.py):
rows as PHP reads them, the table's location, state changes that two writers cannot
lose, and the guard's lock."""

from __future__ import annotations

import json
import logging
import re
import secrets
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlalchemy as sa

from bridge.canary.guard import Suspicions, guard_lock, guard_once
from bridge.canary.store import CanaryStore, CanaryView, config_database
from bridge.canary.weights import (
    CLOSED,
    NO_CANARY,
    OPTION,
    SCALE,
    STATE_OPTION,
    CanaryState,
    bucket,
)
from bridge.config import load_settings
from bridge.errors import ConfigError
from bridge.queue import make_engine
from bridge.queue.implementations import CELERY, PYTHON
from bridge.queue.schema import worker_archivetask as archive

PHID = re.compile(r"PHID-CONF-[a-z2-7]{20}")
REFERENCE = Path(__file__).parent.parent / "reference" / "phorge-config-schema.sql"
TIMEOUT = 10.0


def wait_until(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def rows(engine: sa.Engine, table: str = "config_entry") -> list[dict]:
    with engine.connect() as conn:
        found = conn.exec_driver_sql(f"SELECT * FROM {table} ORDER BY id").mappings().all()
    return [dict(row) for row in found]


def db_now(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.exec_driver_sql("SELECT UNIX_TIMESTAMP()").scalar_one())


@pytest.fixture
def store(mysql_engine) -> CanaryStore:
    return CanaryStore(make_engine(mysql_engine.url.render_as_string(hide_password=False)), None)


def test_no_rows_is_no_canary(store):
    assert store.read() == NO_CANARY


def test_rows_are_as_phorge_writes_them(store, mysql_engine):
    before = db_now(mysql_engine)
    weights = {"*": {"celery": 0}, "ManiphestTransactionMailWorker": {"celery": 5}}
    store.set_weights(weights)
    store.change_state(lambda s: s.with_rollback("FeedPublisherHTTPWorker", PYTHON, 7, "bad"))
    found = {row["configKey"]: row for row in rows(mysql_engine)}
    assert set(found) == {OPTION, STATE_OPTION}
    for row in found.values():
        assert PHID.fullmatch(row["phid"].decode())
        assert row["namespace"] == "default" and row["isDeleted"] == 0
        assert before <= row["dateCreated"] == row["dateModified"] <= db_now(mysql_engine)
    assert json.loads(found[OPTION]["value"]) == weights
    state = json.loads(found[STATE_OPTION]["value"])
    assert state["classes"] == {
        "FeedPublisherHTTPWorker": {
            "python": {"step": 0, "step_since": None, "rolled_back": {"at": 7, "reason": "bad"}}
        }
    }
    # PHP decodes both values (PhabricatorConfigEntry's SERIALIZATION_JSON).
    for row in found.values():
        decoded = subprocess.run(
            ["php", "-r", "echo json_encode(json_decode(stream_get_contents(STDIN), true));"],
            input=row["value"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert json.loads(decoded) == json.loads(row["value"])
    assert found[OPTION]["phid"] != found[STATE_OPTION]["phid"]


def test_round_trip(store):
    store.set_weights({"C": {"ramp": {"level": "python", "steps": [1, 50], "dwell": 30}}})
    written = store.change_state(lambda s: s.with_step("C", PYTHON, 100, 1, 50.0))
    canary = store.read()
    assert canary.state == written
    assert canary.weight("C", PYTHON) == 5000
    rolled = store.change_state(lambda s: s.with_rollback("C", PYTHON, 200, "why"))
    assert store.read().state == rolled and store.read().weight("C", PYTHON) == 0
    # A second write updates the row in place.
    store.set_weights({"C": {"python": 20}})
    assert store.read().weight("C", PYTHON) == 0  # still rolled back
    assert len(rows(store.engine)) == 2


def test_a_change_that_changes_nothing_writes_nothing(store, mysql_engine):
    assert store.change_state(lambda s: s) == CanaryState()
    assert rows(mysql_engine) == []


def test_bad_values_name_the_option(store, mysql_engine):
    with pytest.raises(ConfigError, match=r"phorge-bridge\.canary: C\.python"):
        store.set_weights({"C": {"python": 200}})
    assert rows(mysql_engine) == []
    # What `bin/config set --database` would accept (it is a "wild" option): refused on read.
    store._write(OPTION, lambda _old: '{"C": {"python": 200}}')
    with pytest.raises(ConfigError, match=r"phorge-bridge\.canary: C\.python"):
        store.read()
    store._write(OPTION, lambda _old: "{not json")
    with pytest.raises(ConfigError, match=r"phorge-bridge\.canary: not JSON"):
        store.read()
    store._write(OPTION, lambda _old: "[]")
    store._write(STATE_OPTION, lambda _old: '{"classes": {"C": {"python": {"step": "x"}}}}')
    with pytest.raises(ConfigError, match=r"phorge-bridge\.canary-state: not the bridge's state"):
        store.read()
    with pytest.raises(ConfigError, match="canary-state"):
        store.change_state(lambda s: s.with_rollback("C", PYTHON, 1, "no"))


def test_a_deleted_option_is_absent_and_comes_back_in_its_row(store, mysql_engine):
    store.set_weights({"C": {"celery": 5}})
    store.change_state(lambda s: s.with_rollback("C", CELERY, 1, "x"))
    # `bin/config delete --database`: isDeleted 1, the value null.
    with mysql_engine.begin() as conn:
        conn.exec_driver_sql("UPDATE config_entry SET isDeleted = 1, value = 'null'")
    assert store.read() == NO_CANARY
    (before,) = [r for r in rows(mysql_engine) if r["configKey"] == STATE_OPTION]
    store.change_state(lambda s: s.with_rollback("D", PYTHON, 2, "y"))
    (after,) = [r for r in rows(mysql_engine) if r["configKey"] == STATE_OPTION]
    assert (after["id"], after["phid"], after["isDeleted"]) == (before["id"], before["phid"], 0)
    state = store.read().state
    assert not state.of("C", CELERY).rolled_back and state.of("D", PYTHON).rolled_back


def lock_waits(engine: sa.Engine) -> int:
    """Statements of this test's database running a write's locking read or insert of
    config_entry: while A holds the lock, B's is waiting for it."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST"
                    " WHERE DB = DATABASE() AND (INFO LIKE '%config_entry%FOR UPDATE'"
                    " OR INFO LIKE 'INSERT INTO config_entry%')"
                )
            ).scalar_one()
        )


@pytest.mark.parametrize("first_row", [False, True], ids=["insert-race", "existing-row"])
def test_two_writers_lose_nothing(store, mysql_engine, first_row):
    if first_row:
        store.change_state(lambda s: s.with_rollback("Old", CELERY, 1, "before"))
    other = CanaryStore(make_engine(store.engine.url.render_as_string(hide_password=False)), None)
    a_inside, b_called = threading.Event(), threading.Event()

    def change_a(state: CanaryState) -> CanaryState:
        a_inside.set()
        # Hold the row (or the gap) until B has read it too, or waits for it.
        wait_until(lambda: b_called.is_set() or lock_waits(mysql_engine), "B to meet A's lock")
        return state.with_rollback("A", PYTHON, 10, "a")

    def change_b(state: CanaryState) -> CanaryState:
        b_called.set()
        return state.with_rollback("B", CELERY, 20, "b")

    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(store.change_state, change_a)
        wait_until(a_inside.is_set, "A inside its transaction")
        b = pool.submit(other.change_state, change_b)
        a.result(TIMEOUT), b.result(TIMEOUT)
    state = store.read().state
    assert state.of("A", PYTHON).rolled_back and state.of("B", CELERY).rolled_back
    assert sorted(e.task_class for e in state.history) == sorted(
        ["A", "B", *(["Old"] if first_row else [])]
    )
    assert [r["configKey"] for r in rows(mysql_engine)] == [STATE_OPTION]


def test_a_missing_table_is_no_canary_said_once(store, caplog):
    missing = CanaryStore(store.engine, f"bridge_nothing_{secrets.token_hex(4)}")
    caplog.set_level(logging.WARNING, logger="bridge.canary")
    assert missing.read() == NO_CANARY
    assert missing.read() == NO_CANARY
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"{missing.database}.config_entry does not exist" in line


@pytest.fixture
def namespace(mysql_server) -> Iterator[str]:
    """A Phorge-like ``{ns}_worker`` and ``{ns}_config`` (with Phorge's own DDL)."""
    ns = f"bcan{secrets.token_hex(4)}"
    lines = Path(REFERENCE).read_text().splitlines()
    ddl = "\n".join(line for line in lines if not line.startswith("--")).strip().rstrip(";")
    with mysql_server.connect() as conn:
        for suffix in ("worker", "config", "other"):
            conn.exec_driver_sql(f"CREATE DATABASE `{ns}_{suffix}`")
        conn.exec_driver_sql(f"USE `{ns}_config`")
        conn.exec_driver_sql(ddl)
        conn.exec_driver_sql(f"USE `{ns}_other`")
        conn.exec_driver_sql(ddl)
    try:
        yield ns
    finally:
        with mysql_server.connect() as conn:
            for suffix in ("worker", "config", "other"):
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{ns}_{suffix}`")


def test_the_config_table_is_beside_the_worker_database(mysql_server, namespace):
    url = mysql_server.url.set(database=f"{namespace}_worker")
    engine = make_engine(url.render_as_string(hide_password=False))
    settings = load_settings({})
    store = CanaryStore.for_settings(engine, settings)
    assert store.database == f"{namespace}_config"
    assert store.table_name == f"{namespace}_config.config_entry"
    store.set_weights({"C": {"celery": 50}})
    store.change_state(lambda s: s.with_rollback("C", CELERY, 1, "x"))
    assert store.read().weight("C", CELERY) == 0
    assert len(rows(engine, f"`{namespace}_config`.config_entry")) == 2
    # BRIDGE_CANARY_DATABASE names another.
    other = CanaryStore.for_settings(
        engine, load_settings({"BRIDGE_CANARY_DATABASE": f"{namespace}_other"})
    )
    assert other.read() == NO_CANARY
    other.set_weights({"C": {"python": 5}})
    assert other.read().weight("C", PYTHON) == 500
    assert store.read().weight("C", PYTHON) == 10_000
    engine.dispose()


def test_the_location_rule():
    mysql = sa.create_engine("mysql+mysqldb://u@h/phabricator_worker")
    assert config_database(mysql, None) == "phabricator_config"
    assert config_database(mysql, "elsewhere") == "elsewhere"
    assert config_database(sa.create_engine("mysql+mysqldb://u@h/bridge_t_1"), None) is None
    assert config_database(sa.create_engine("sqlite://"), "ignored") is None


def test_mysql_crc32_agrees_with_the_bucket(mysql_engine):
    with mysql_engine.connect() as conn:
        found = conn.execute(
            sa.text(
                "SELECT MOD(CRC32(CONCAT('celery:', n)), 10000), MOD(CRC32(CONCAT('python:', n)),"
                " 10000) FROM (SELECT seq AS n FROM seq_1_to_2000) ids ORDER BY n"
            )
        ).all()
    assert [tuple(row) for row in found] == [
        (bucket(CELERY, n), bucket(PYTHON, n)) for n in range(1, 2001)
    ]


def test_a_view_caches_and_keeps_the_last_good_value(store, caplog):
    store.set_weights({"C": {"python": 20}})
    view = CanaryView(store, refresh=3600)
    assert view.current().weight("C", PYTHON) == 2000
    store.set_weights({"C": {"python": 30}})
    assert view.current().weight("C", PYTHON) == 2000  # within refresh
    view.refresh = 0
    assert view.current().weight("C", PYTHON) == 3000
    store._write(OPTION, lambda _old: '{"C": {"python": 300}}')
    caplog.set_level(logging.WARNING, logger="bridge.canary")
    assert view.current().weight("C", PYTHON) == 3000
    assert view.current().weight("C", PYTHON) == 3000
    (line,) = [r for r in caplog.records]
    assert line.levelno == logging.ERROR and "phorge-bridge.canary: C.python" in line.getMessage()
    store.set_weights({"C": {"python": 40}})
    assert view.current().weight("C", PYTHON) == 4000
    # Refused values before any good read: no new side at all (the worker's start stops).
    store._write(OPTION, lambda _old: '{"C": {"python": 300}}')
    assert CanaryView(store, 1).current() == CLOSED


@pytest.fixture
def config_only_account(store, mysql_server) -> Iterator[tuple[str, CanaryStore]]:
    """An account granted the config table alone, and a store reading through it."""
    name = f"cfg_{secrets.token_hex(4)}"
    database = store.engine.url.database
    with mysql_server.begin() as conn:
        conn.exec_driver_sql(f"CREATE USER '{name}'@'127.0.0.1' IDENTIFIED BY 'rw'")
        conn.exec_driver_sql(f"GRANT SELECT ON `{database}`.config_entry TO '{name}'@'127.0.0.1'")
    url = store.engine.url.set(username=name, password="rw")
    yield name, CanaryStore(make_engine(url.render_as_string(hide_password=False)), None)
    with mysql_server.begin() as conn:
        conn.exec_driver_sql(f"DROP USER '{name}'@'127.0.0.1'")


def test_a_view_that_cannot_read_fails_closed(store, config_only_account, mysql_server, caplog):
    """A revoked grant: the shared classes go wholly to their old side, a rollback stays,
    the classes wholly moved stay moved; said once; the grant back, the weights are back."""
    name, reader = config_only_account
    store.set_weights({"Shared": {"celery": 20}, "Native": {"python": 50}, "Moved": {}})
    view = CanaryView(reader, refresh=0)
    good = view.current()
    assert (good.weight("Shared", CELERY), good.weight("Native", PYTHON)) == (2000, 5000)
    grant = f"SELECT ON `{store.engine.url.database}`.config_entry"
    with mysql_server.begin() as conn:
        conn.exec_driver_sql(f"REVOKE {grant} FROM '{name}'@'127.0.0.1'")
    caplog.set_level(logging.WARNING, logger="bridge.canary")
    for _ in range(3):
        closed = view.current()
        assert closed == good.closed()
        assert (closed.weight("Shared", CELERY), closed.weight("Native", PYTHON)) == (0, 0)
        assert closed.weight("Moved", CELERY) == closed.weight("Moved", PYTHON) == SCALE
    (line,) = caplog.records
    assert "no task of a shared class runs on the new side" in line.getMessage()
    assert "1142" in line.getMessage()  # MySQL's own words: SELECT command denied
    # A fresh process that cannot read at all runs no new side of any class.
    assert CanaryView(reader, refresh=0).current() == CLOSED
    with mysql_server.begin() as conn:
        conn.exec_driver_sql(f"GRANT {grant} TO '{name}'@'127.0.0.1'")
    assert view.current() == good


def archived(engine: sa.Engine, owner: str, first_id: int, count: int) -> None:
    now = db_now(engine)
    with engine.begin() as conn:
        conn.execute(
            sa.insert(archive),
            [
                {
                    "id": first_id + i,
                    "taskClass": "C",
                    "leaseOwner": owner,
                    "failureCount": 0,
                    "dataID": 1,
                    "result": 0,
                    "duration": 1000,
                    "dateCreated": now,
                    "dateModified": now,
                    "priority": 3000,
                }
                for i in range(count)
            ],
        )


def test_one_guard_at_a_time(store, mysql_engine):
    settings = load_settings({"BRIDGE_OWNER_PREFIX": f"g{secrets.token_hex(3)}"})
    store.set_weights({"C": {"python": 20}})
    archived(mysql_engine, "bridge:native:1:1:h:1", 1, 20)
    archived(mysql_engine, "bridge:runner-fallback:1:1:h:1", 100, 10)
    archived(mysql_engine, "bridge:runner:1:1:h:1", 200, 100)
    with guard_lock(store.engine, settings.owner_prefix) as now:
        assert now is not None
        with guard_lock(store.engine, settings.owner_prefix) as second:
            assert second is None
        # another guard holds it
        assert guard_once(store, store.engine, settings, Suspicions(1)) == []
    assert store.read().weight("C", PYTHON) == 2000
    assert guard_once(store, store.engine, settings, Suspicions(1)) == ["rollback C (python)"]
    assert store.read().weight("C", PYTHON) == 0
