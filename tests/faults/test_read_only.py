"""A primary that refuses writes under load (a failover, ``SET GLOBAL read_only``), and
connections killed mid-transaction: no task runs twice, none is lost.

The bridge connects as the account docs/operating.md recommends (SELECT, INSERT,
UPDATE, DELETE), which ``read_only`` binds; the suite's own connection (SUPER) turns it
on and off and kills connections. Runs are counted from the handlers' own records.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

WINDOW = 20.0  # seconds the database refuses writes
DURATIONS = (0.005, 0.02, 0.05)  # seconds a task runs (the 5-50 ms)
RECOVERY = 5.0  # seconds after the window for the queue to move again


@pytest.fixture
def least_privileged(fault_mariadb, fault_database) -> Iterator[str]:
    """``fault_database``'s URL for a fresh account with SELECT, INSERT, UPDATE, DELETE."""
    name, url = f"rw_{secrets.token_hex(4)}", sa.engine.make_url(fault_database)
    admin = sa.create_engine(fault_mariadb.url)
    with admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE USER '{name}'@'127.0.0.1' IDENTIFIED BY 'rw'")
        conn.exec_driver_sql(
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON `{url.database}`.* TO '{name}'@'127.0.0.1'"
        )
    yield url.set(username=name, password="rw").render_as_string(hide_password=False)
    with admin.begin() as conn:
        conn.exec_driver_sql(f"DROP USER IF EXISTS '{name}'@'127.0.0.1'")
    admin.dispose()


def read_only(server_url: str, on: bool) -> None:
    admin = sa.create_engine(server_url)
    with admin.connect() as conn:
        conn.exec_driver_sql(f"SET GLOBAL read_only = {'ON' if on else 'OFF'}")
    admin.dispose()


def queue_mix(run, per_duration: int) -> None:
    for duration in DURATIONS:
        run.queue(per_duration, duration=duration)


@pytest.mark.parametrize(
    "lease", [60, 8], ids=["window-shorter-than-the-lease", "window-longer-than-the-lease"]
)
def test_a_read_only_window(
    lease, fault_mariadb, least_privileged, fault_redis, make_fault_bridge, fault_run
):
    bridge = make_fault_bridge(least_privileged, fault_redis.url, DISPATCH_LEASE=str(lease))
    run = fault_run(bridge)
    queue_mix(run, 200)
    bridge.serve()
    run.start()
    run.wait_fraction(0.2)
    read_only(fault_mariadb.url, True)
    try:
        window_start = time.time()
        time.sleep(WINDOW)  # the fault itself
    finally:
        read_only(fault_mariadb.url, False)
    window_end = time.time()
    run.over()
    run.check(recover_within=RECOVERY)

    rows = bridge.archived(run.ids)
    assert {r.failureCount for r in rows.values()} == {0}, "a failure was counted"
    starts: dict[int, list[dict]] = {}
    for record in bridge.fault_runs():
        starts.setdefault(record["id"], []).append(record)
    again = {task_id: runs for task_id, runs in starts.items() if len(runs) > 1}
    print(f"[fault] read-only {WINDOW:.0f} s, lease {lease} s: {len(again)} task(s) run again")
    if lease > WINDOW:
        assert not again, f"run twice: {sorted(again)}"
    for task_id, runs in again.items():
        # Only a run whose lease ran out inside the window is run again, under a new lease.
        first = min(runs, key=lambda r: r["time"])
        assert window_start - lease <= first["time"] <= window_end - lease, (task_id, runs)
        assert rows[task_id].leaseOwner != first["owner"], (task_id, runs)
    log = bridge.logs()
    assert "Traceback" not in log
    # One line each way per process (the worker's children and the one that polls).
    refused = log.count("the database refuses writes")
    assert 1 <= refused <= 3, refused
    assert log.count("the database accepts writes again") == refused


def test_connections_killed_mid_outcome(
    fault_mariadb, least_privileged, fault_redis, make_fault_bridge, fault_run
):
    """Every connection of the bridge's account killed every 50 ms for 5 s: some die
    in the middle of an outcome's transaction, some after its COMMIT."""
    bridge = make_fault_bridge(least_privileged, fault_redis.url)
    run = fault_run(bridge)
    queue_mix(run, 150)
    bridge.serve()
    run.start()
    run.wait_fraction(0.1)
    user = sa.engine.make_url(least_privileged).username
    admin = sa.create_engine(fault_mariadb.url)
    killed = 0
    stop = time.monotonic() + 5.0
    with admin.connect() as conn:
        while time.monotonic() < stop:
            ids = (
                conn.exec_driver_sql(
                    f"SELECT ID FROM information_schema.PROCESSLIST WHERE USER = '{user}'"
                )
                .scalars()
                .all()
            )
            for connection_id in ids:
                try:
                    conn.exec_driver_sql(f"KILL CONNECTION {connection_id}")
                    killed += 1
                except sa.exc.DBAPIError:
                    pass  # gone already
            time.sleep(0.05)
    admin.dispose()
    run.over()
    # Every task archived once with its result, nothing left leased, no lease run twice.
    run.check()
    print(f"[fault] {killed} connections killed")
    assert killed > 0
