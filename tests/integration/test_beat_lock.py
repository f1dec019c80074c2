"""The beat lock on MariaDB: one beat of several sends the polls, and another takes over
once the first one's connection ends (``bridge.queue.beat_lock``)."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, text

from bridge.queue import beat_lock
from bridge.queue.beat_lock import BeatLock, beat_lock_holder

pytestmark = pytest.mark.mariadb


@pytest.fixture(autouse=True)
def check_at_once(monkeypatch):
    monkeypatch.setattr(beat_lock, "CHECK_EVERY", 0.0)  # every held() asks the server


@pytest.fixture
def locks(mysql_engine: Engine):
    made: list[BeatLock] = []

    def make() -> BeatLock:
        made.append(BeatLock(mysql_engine, "bridge"))
        return made[-1]

    yield make
    for lock in made:
        lock.close()


def test_one_beat_holds_the_lock_and_a_second_stands_by(locks, mysql_engine, caplog):
    first, second = locks(), locks()
    assert beat_lock_holder(mysql_engine, "bridge") is None, "doctor: no beat"
    with caplog.at_level("INFO", logger=beat_lock.__name__):
        assert first.held() and first.held(), "the holder keeps it"
        assert not second.held()
    assert beat_lock_holder(mysql_engine, "bridge") is not None
    assert [r.getMessage().split(" (")[0].split(";")[0] for r in caplog.records] == [
        "beat: this beat sends the polls",
        "beat: standing by",
    ]
    first.close()
    assert second.held(), "the standby takes over once the holder's connection ends"
    assert not first.held()


def test_a_holder_whose_connection_is_killed_stands_by(locks, mysql_server: Engine, mysql_engine):
    first, second = locks(), locks()
    assert first.held()
    holder = beat_lock_holder(mysql_engine, "bridge")
    with mysql_server.connect() as root:
        root.execute(text(f"KILL CONNECTION {holder}"))
    assert second.held()
    assert not first.held(), "its lost connection lost the lock: it must not send too"


def test_the_holders_session_is_dropped_by_the_server_when_silent(locks, mysql_engine):
    first = locks()
    assert first.held()
    assert first._conn is not None
    timeout = first._conn.execute(text("SELECT @@session.wait_timeout")).scalar_one()
    assert timeout == beat_lock.IDLE_TIMEOUT


def test_sqlite_has_one_beat_which_always_sends(sqlite_engine):
    assert BeatLock(sqlite_engine, "bridge").held()
