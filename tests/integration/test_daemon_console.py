"""Each worker and beat in Phorge's Daemons console (``bridge.runtime.daemon_console``),
on MariaDB with Phorge's own ``daemon_log`` DDL: listed, beating, exited, and an
account that may not write there said once, never stopping the process. What Phorge's
own PHP makes of the rows is in ``tests/phorge/test_canary_phorge.py``."""

from __future__ import annotations

import getpass
import json
import logging
import os
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from bridge_harness import wait_until

from bridge.config import load_settings
from bridge.runtime import daemon_console
from bridge.runtime.daemon_console import EXITED, RUNNING, WORKER, ConsoleEntry

DDL = (Path(__file__).parent.parent / "reference" / "phorge-daemon-log-schema.sql").read_text()
ARGV = ["worker", "--hostname", "celery@here", "--queues", "phorge,bridge.control"]


@pytest.fixture
def namespace(mysql_server: sa.Engine) -> Iterator[str]:
    """``{ns}_worker`` and ``{ns}_daemon`` holding Phorge's daemon log."""
    ns = f"bdcon{secrets.token_hex(4)}"
    with mysql_server.begin() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE `{ns}_worker`")
        conn.exec_driver_sql(f"CREATE DATABASE `{ns}_daemon`")
        conn.exec_driver_sql(f"USE `{ns}_daemon`")
        conn.exec_driver_sql(DDL.split("\n;")[0])
    yield ns
    with mysql_server.begin() as conn:
        for suffix in ("worker", "daemon"):
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{ns}_{suffix}`")


def url_of(server: sa.Engine, database: str, **account: str) -> str:
    return server.url.set(database=database, **account).render_as_string(hide_password=False)


def entry_for(url: str, **env: str) -> ConsoleEntry | None:
    return ConsoleEntry.for_settings(
        load_settings({"BRIDGE_DATABASE_URL": url, **env}), WORKER, ARGV
    )


def rows(server: sa.Engine, ns: str) -> list[dict]:
    with server.connect() as conn:
        return [
            dict(r._mapping)
            for r in conn.exec_driver_sql(
                f"SELECT *, UNIX_TIMESTAMP() - dateModified AS age FROM `{ns}_daemon`.daemon_log"
            )
        ]


def test_a_process_is_listed_as_phd_lists_a_daemon_beats_and_exits(
    mysql_server: sa.Engine, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = entry_for(url_of(mysql_server, f"{namespace}_worker"))
    assert entry is not None
    monkeypatch.setattr(daemon_console, "HEARTBEAT", 0.05)
    entry.start()
    try:
        (row,) = rows(mysql_server, namespace)
        assert row["daemon"] == WORKER and row["status"] == RUNNING
        assert (row["host"], row["pid"], row["runningAsUser"]) == (
            socket.gethostname(),
            os.getpid(),
            getpass.getuser(),
        )
        assert json.loads(row["argv"]) == json.loads(row["explicitArgv"]) == ARGV
        assert row["daemonID"] == entry.daemon_id and row["age"] <= 1
        # A heartbeat Phorge would call unknown (over 360 s old) is made fresh by the
        # entry's own thread.
        with mysql_server.begin() as conn:
            conn.exec_driver_sql(
                f"UPDATE `{namespace}_daemon`.daemon_log SET dateModified = dateModified - 400"
            )
        wait_until(lambda: rows(mysql_server, namespace)[0]["age"] <= 1, 10, "a heartbeat")
    finally:
        entry.stop()
    (row,) = rows(mysql_server, namespace)
    assert row["status"] == EXITED, "a clean stop shows as exited, as phd's daemons do"


@pytest.fixture
def worker_only(mysql_server: sa.Engine, namespace: str) -> Iterator[str]:
    """An account granted the worker database only, not the daemon log."""
    name = f"dcon_{secrets.token_hex(4)}"
    with mysql_server.begin() as conn:
        conn.exec_driver_sql(f"CREATE USER '{name}'@'127.0.0.1' IDENTIFIED BY 'rw'")
        conn.exec_driver_sql(f"GRANT ALL ON `{namespace}_worker`.* TO '{name}'@'127.0.0.1'")
    yield name
    with mysql_server.begin() as conn:
        conn.exec_driver_sql(f"DROP USER '{name}'@'127.0.0.1'")


def test_an_account_that_may_not_write_the_log_is_said_once_and_listed_once_granted(
    mysql_server: sa.Engine, namespace: str, worker_only: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = url_of(mysql_server, f"{namespace}_worker", username=worker_only, password="rw")
    entry = entry_for(url)
    assert entry is not None
    with caplog.at_level(logging.INFO, logger=daemon_console.__name__):
        entry.beat()
        entry.beat()
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert f"not listed in {namespace}_daemon.daemon_log" in warnings[0]
        assert "1142" in warnings[0] and "BRIDGE_DAEMON_CONSOLE=false" in warnings[0]
        assert rows(mysql_server, namespace) == []
        with mysql_server.begin() as conn:
            conn.exec_driver_sql(
                f"GRANT INSERT, UPDATE ON `{namespace}_daemon`.daemon_log"
                f" TO '{worker_only}'@'127.0.0.1'"
            )
        entry.beat()
    assert [r["status"] for r in rows(mysql_server, namespace)] == [RUNNING]
    assert caplog.records[-1].getMessage().endswith("this process is listed again")


def test_nothing_is_listed_when_off_or_with_no_daemon_database_beside(
    mysql_server: sa.Engine, namespace: str, mysql_engine: sa.Engine
) -> None:
    assert (
        entry_for(url_of(mysql_server, f"{namespace}_worker"), BRIDGE_DAEMON_CONSOLE="false")
        is None
    )
    assert entry_for(url_of(mysql_server, mysql_engine.url.database)) is None  # bridge_t_...
    assert entry_for("sqlite:///console.db") is None
    assert rows(mysql_server, namespace) == []
