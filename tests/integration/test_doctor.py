"""``phorge-bridge doctor`` on MariaDB and RabbitMQ, with a local Conduit, breaking one
dependency at a time: every failure is named and makes the exit status 1."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from conduit_fakes import TOKEN, FakeServer, Reply, conduit_error, conduit_result
from local_ports import closed_port

from bridge.canary.store import CanaryStore
from bridge.cli.doctor import CHECKS
from bridge.cli.main import main
from bridge.phorge.extension import shipped_sha256, shipped_version
from bridge.queue import PhorgeQueue
from bridge.queue.beat_lock import BeatLock
from bridge.queue.schema import metadata

DAEMON_LOG_DDL = (
    Path(__file__).parent.parent / "reference" / "phorge-daemon-log-schema.sql"
).read_text()
WHOAMI_ADMIN = {"userName": "bridge-bot", "roles": ["verified", "approved", "activated", "admin"]}


@pytest.fixture
def phorge(mysql_server: sa.Engine) -> Iterator[sa.Engine]:
    """A Phorge-like namespace: ``{ns}_worker`` with the queue tables, ``{ns}_daemon`` with
    the daemon log (doctor finds it beside the worker database)."""
    namespace = f"bdoc{secrets.token_hex(4)}"
    with mysql_server.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE `{namespace}_worker`")
        conn.exec_driver_sql(f"CREATE DATABASE `{namespace}_daemon`")
        conn.exec_driver_sql(f"USE `{namespace}_daemon`")
        conn.exec_driver_sql(DAEMON_LOG_DDL.split("\n;")[0])
    engine = sa.create_engine(mysql_server.url.set(database=f"{namespace}_worker"))
    metadata.create_all(engine)
    try:
        yield engine
    finally:
        engine.dispose()
        with mysql_server.connect() as conn:
            for suffix in ("worker", "daemon"):
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{namespace}_{suffix}`")


def daemons(engine: sa.Engine, *rows: tuple[str, str, int], argv: tuple[str, ...] = ()) -> None:
    """Daemon log rows (class, status, heartbeat age in seconds), each started with
    ``argv`` (phd's overseer writes its daemons' arguments as a JSON list)."""
    daemon_log = f"`{engine.url.database.removesuffix('_worker')}_daemon`.daemon_log"
    with engine.begin() as conn:
        for daemon, status, age in rows:
            conn.execute(
                sa.text(
                    f"INSERT INTO {daemon_log} (daemon, host, pid, argv, explicitArgv,"
                    " dateCreated, dateModified, status, daemonID) VALUES (:daemon, 'here', 1,"
                    " :argv, :argv, UNIX_TIMESTAMP() - :age, UNIX_TIMESTAMP() - :age, :status,"
                    " :id)"
                ),
                {
                    "daemon": daemon,
                    "status": status,
                    "age": age,
                    "argv": json.dumps(list(argv)),
                    "id": secrets.token_hex(8),
                },
            )


def healthy_conduit(request) -> Reply:
    method = request.path.removeprefix("/api/")
    answers = {
        "conduit.ping": "phorge.example",
        "user.whoami": WHOAMI_ADMIN,
        "worker.version": {"version": shipped_version(), "sha256": shipped_sha256()},
    }
    return conduit_result(answers[method])


@pytest.fixture
def doctor(phorge, amqp_url, monkeypatch) -> Callable[..., tuple[int, dict[str, dict]]]:
    """Run ``doctor --json`` with the test services; returns (exit code, checks by name)."""
    for name in os.environ:
        if name.startswith("BRIDGE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("BRIDGE_DATABASE_URL", phorge.url.render_as_string(hide_password=False))
    monkeypatch.setenv("BRIDGE_BROKER_URL", amqp_url)

    def run(**env: str) -> tuple[int, dict[str, dict]]:
        for name, value in env.items():
            monkeypatch.setenv(f"BRIDGE_{name}", value)
        result = CliRunner().invoke(main, ["doctor", "--json"], catch_exceptions=False)
        report = json.loads(result.output)
        assert report["ok"] is (result.exit_code == 0)
        return result.exit_code, {c["name"]: c for c in report["checks"]}

    return run


@pytest.fixture
def beat(phorge) -> Iterator[BeatLock]:
    """A running beat, as far as the database can tell: the holder of the beat lock."""
    lock = BeatLock(phorge, "bridge")
    assert lock.held()
    yield lock
    lock.close()


def test_a_healthy_setup_passes(phorge, doctor, beat):
    with phorge.begin() as conn:
        conn.exec_driver_sql("INSERT INTO lisk_counter VALUES ('worker_activetask', 7)")
    with FakeServer(healthy_conduit) as conduit:
        code, checks = doctor(CONDUIT_URL=conduit.url, CONDUIT_TOKEN=TOKEN)
    assert code == 0, checks
    assert {c["status"] for c in checks.values()} == {"ok"}
    assert checks.keys() >= {
        "settings",
        "database",
        "tables",
        "task id counter",
        "served classes",
        "beat",
        "broker",
        "conduit",
        "conduit token",
        "extension",
        "taskmasters",
        "clock skew",
    }
    assert "administrator 'bridge-bot'" in checks["conduit token"]["detail"]
    assert checks["extension"]["detail"] == f"version {shipped_version()}, current"


def test_no_beat_fails_naming_it_and_a_beat_passes(phorge, doctor):
    code, checks = doctor()
    assert code == 1
    assert checks["beat"]["status"] == "fail"
    assert "no beat holds the beat lock" in checks["beat"]["detail"]
    lock = BeatLock(phorge, "bridge")
    try:
        assert lock.held()
        _, checks = doctor()
        assert checks["beat"]["status"] == "ok", checks["beat"]
    finally:
        lock.close()


def test_served_classes_and_those_left_to_php_are_named(phorge, doctor):
    queue = PhorgeQueue(phorge)
    queue.enqueue("PhabricatorTestWorker", {})
    queue.enqueue("PhabricatorSearchWorker", {})
    _, checks = doctor()
    assert checks["served classes"]["detail"] == (
        "2 in the queue; served by the bridge: PhabricatorTestWorker; "
        "left to PHP (no handler, or excluded): PhabricatorSearchWorker"
    )
    # The control queue carries polls: its count is every queue's, no task of its own.
    assert checks["queue consumers"]["detail"].startswith(
        "bridge.control: polls (needed while any task is due), consumed by "
    )
    assert "; phorge: 1 due, consumed by " in checks["queue consumers"]["detail"]


@pytest.mark.parametrize(
    ("env", "served"),
    [
        ({}, "native handlers serve PhabricatorTestWorker; every other class is left to PHP"),
        (
            {"PHORGE_ROOT": "/srv/phorge"},
            "native handlers serve PhabricatorTestWorker; "
            "the PHP runner serves every other class (BRIDGE_RUNNER_CLASSES=*)",
        ),
        (
            {
                "PHORGE_ROOT": "/srv/phorge",
                "RUNNER_CLASSES": "*Search*",
                "CONDUIT_URL": f"http://127.0.0.1:{closed_port()}",
                "CONDUIT_TOKEN": TOKEN,
            },
            "native handlers serve FeedPublisherHTTPWorker, PhabricatorTestWorker; "
            "the PHP runner serves the classes matching *Search* (BRIDGE_RUNNER_CLASSES="
            "*Search*); the Conduit proxy serves every other class (BRIDGE_CONDUIT_URL)",
        ),
    ],
    ids=["php", "runner", "runner-and-proxy"],
)
def test_an_empty_queue_names_what_the_bridge_would_serve(doctor, env, served):
    _, checks = doctor(**env)
    assert checks["served classes"]["detail"] == f"none in the queue; {served}"


def test_taskmasters_count_only_with_a_live_heartbeat_as_phorges_console(phorge, doctor):
    daemons(
        phorge,
        ("PhabricatorTaskmasterDaemon", "run", 60),  # alive
        ("PhabricatorTaskmasterDaemon", "wait", 300),  # alive (under 3 heartbeats)
        ("PhabricatorTaskmasterDaemon", "exiting", 1000),  # unknown, per Phorge
        ("PhabricatorTaskmasterDaemon", "run", 3 * 3600),  # dead, per Phorge
        ("PhabricatorTaskmasterDaemon", "exit", 10),
        ("PhabricatorTriggerDaemon", "run", 10),
        ("PhorgeBridgeQueueDaemon", "run", 10),  # the shipped one honours the weights
    )
    _, checks = doctor()
    assert checks["taskmasters"]["status"] == "warn"
    assert checks["taskmasters"]["detail"].startswith("2 running.")
    assert checks["taskmasters"]["detail"].endswith(
        "not counted, as Phorge's daemon console calls them: 1 unknown "
        "(heartbeat over 360 s old), 1 dead (over 3600 s)"
    )


@pytest.fixture
def worker_only_account(phorge, doctor, mysql_server, monkeypatch) -> Iterator[str]:
    """BRIDGE_DATABASE_URL on an account granted the worker database only: the account
    docs/operating.md, "Before the cutover", recommends, less the daemon_log grant."""
    name = f"doc_{secrets.token_hex(4)}"
    with mysql_server.begin() as conn:
        conn.exec_driver_sql(f"CREATE USER '{name}'@'127.0.0.1' IDENTIFIED BY 'rw'")
        conn.exec_driver_sql(
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON `{phorge.url.database}`.* "
            f"TO '{name}'@'127.0.0.1'"
        )
    url = phorge.url.set(username=name, password="rw")
    monkeypatch.setenv("BRIDGE_DATABASE_URL", url.render_as_string(hide_password=False))
    yield name
    with mysql_server.begin() as conn:
        conn.exec_driver_sql(f"DROP USER '{name}'@'127.0.0.1'")


def test_an_unreadable_daemon_log_is_one_line_naming_the_grant_to_add(
    phorge, doctor, worker_only_account, mysql_server
):
    lines = CliRunner().invoke(main, ["doctor"], catch_exceptions=False).output.splitlines()
    assert len(lines) == len(CHECKS), lines
    daemon = f"{phorge.url.database.removesuffix('_worker')}_daemon"
    grant = f"GRANT SELECT ON {daemon}.daemon_log TO '{worker_only_account}'@'127.0.0.1'"
    assert (
        f"warn  taskmasters: unknown: this account may not read Phorge's daemon log: {grant}"
        in lines
    )
    with mysql_server.begin() as conn:
        conn.exec_driver_sql(grant)  # the line is the fix: once run, the check passes
    _, checks = doctor()
    assert (checks["taskmasters"]["status"], checks["taskmasters"]["detail"]) == (
        "ok",
        "none running",
    )


def test_stale_taskmaster_rows_alone_are_not_running(phorge, doctor):
    daemons(phorge, ("PhabricatorTaskmasterDaemon", "run", 5 * 3600))
    _, checks = doctor()
    assert checks["taskmasters"]["status"] == "ok"
    assert checks["taskmasters"]["detail"].startswith("none running; not counted")


@pytest.mark.parametrize("token_setting", ["CONDUIT_TOKEN", "CONDUIT_TOKEN_FILE"])
def test_a_refused_token_fails_naming_the_setting_in_use(doctor, tmp_path, token_setting):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    value = str(token_file) if token_setting == "CONDUIT_TOKEN_FILE" else TOKEN
    refuse = conduit_error("ERR-INVALID-AUTH", "API token is invalid.")
    with FakeServer(lambda request: refuse) as conduit:
        code, checks = doctor(CONDUIT_URL=conduit.url, **{token_setting: value})
    assert code == 1
    assert checks["conduit"]["status"] == "ok"
    token = checks["conduit token"]
    assert token["status"] == "fail"
    assert f"the token in BRIDGE_{token_setting}:" in token["detail"]
    assert "ERR-INVALID-AUTH" in token["detail"]
    assert checks["extension"]["status"] == "skip"


def test_a_token_of_a_non_administrator_fails(doctor):
    def answer(request) -> Reply:
        if request.path.endswith("user.whoami"):
            return conduit_result({"userName": "alice", "roles": ["verified", "activated"]})
        return healthy_conduit(request)

    with FakeServer(answer) as conduit:
        code, checks = doctor(CONDUIT_URL=conduit.url, CONDUIT_TOKEN=TOKEN)
    assert code == 1
    assert "'alice', which is not an active administrator" in checks["conduit token"]["detail"]


@pytest.mark.parametrize("installed", ["missing", "outdated"])
def test_a_missing_or_outdated_extension_fails(doctor, installed):
    def answer(request) -> Reply:
        if not request.path.endswith("worker.version"):
            return healthy_conduit(request)
        if installed == "missing":
            return conduit_error("ERR-CONDUIT-CALL", 'API Method "worker.version" does not exist.')
        return conduit_result({"version": "0.0.9", "sha256": "0" * 64})

    with FakeServer(answer) as conduit:
        code, checks = doctor(CONDUIT_URL=conduit.url, CONDUIT_TOKEN=TOKEN)
    assert code == 1
    extension = checks["extension"]
    assert extension["status"] == "fail"
    assert "install-extension" in extension["detail"]
    assert ("'0.0.9'" in extension["detail"]) is (installed == "outdated")


def test_unreachable_conduit_and_broker_fail(doctor):
    port = closed_port()
    code, checks = doctor(
        CONDUIT_URL=f"http://127.0.0.1:{port}",
        CONDUIT_TOKEN=TOKEN,
        BROKER_URL=f"amqp://guest:guest@127.0.0.1:{port}//",
    )
    assert code == 1
    assert checks["broker"]["status"] == "fail"
    assert f"127.0.0.1:{port}" in checks["broker"]["detail"]
    assert checks["conduit"]["status"] == "fail"
    assert "unreachable" in checks["conduit"]["detail"]
    assert checks["conduit token"]["status"] == "skip"


def test_an_altered_column_and_a_missing_counter_row_fail(phorge, doctor):
    PhorgeQueue(phorge).enqueue("PhabricatorTestWorker", {})
    with phorge.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE worker_activetask MODIFY priority VARCHAR(10) NOT NULL")
        conn.exec_driver_sql("ALTER TABLE worker_archivetask DROP COLUMN archivedEpoch")
        conn.exec_driver_sql("DELETE FROM lisk_counter")
    code, checks = doctor()
    assert code == 1
    tables = checks["tables"]["detail"]
    assert "worker_activetask.priority is VARCHAR(10), expected INTEGER UNSIGNED" in tables
    assert "worker_archivetask.archivedEpoch is missing" in tables
    assert checks["task id counter"]["status"] == "skip"

    with phorge.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE worker_activetask MODIFY priority INT UNSIGNED NOT NULL")
        conn.exec_driver_sql("ALTER TABLE worker_archivetask ADD archivedEpoch INT UNSIGNED")
    code, checks = doctor()
    assert code == 1
    assert checks["tables"]["status"] == "ok", checks["tables"]
    assert "the next task would reuse id 1" in checks["task id counter"]["detail"]


def test_an_unreachable_database_fails_and_skips_what_needs_it(doctor):
    code, checks = doctor(
        DATABASE_URL=f"mysql+mysqldb://bridge:bridge@127.0.0.1:{closed_port()}/x_worker"
    )
    assert code == 1
    assert checks["database"]["status"] == "fail"
    assert all(
        checks[name]["status"] == "skip"
        for name in ("tables", "task id counter", "served classes", "taskmasters", "clock skew")
    )
    assert checks["broker"]["status"] == "ok"


def test_the_text_report_has_one_line_per_check(doctor, monkeypatch):
    doctor()  # sets the environment
    result = CliRunner().invoke(main, ["doctor"], catch_exceptions=False)
    lines = result.output.splitlines()
    assert lines[0] == "ok    settings: every BRIDGE_* setting is valid"
    assert any(line.startswith("ok    broker: amqp://") for line in lines)


def test_a_share_for_phd_needs_a_live_queue_daemon_under_its_unit(phorge, doctor):
    """The shipped daemon alone runs phd's share, and nothing but its systemd unit starts
    it again after `bin/phd restart` or a reboot: its absence fails doctor, one run by
    `bin/phd launch` alone warns, one of the unit's passes it."""
    store = CanaryStore(phorge, phorge.url.database)
    mail = "ManiphestTransactionMailWorker"
    store.set_weights(
        {"*": {"celery": 0}, "PhabricatorSearchWorker": {"celery": 100}, mail: {"celery": 25}}
    )
    share = f"{mail} 75%, every class not named"
    unit = "systemctl enable --now phorge-bridge-queue-daemon@1 (docs/canary.md)"
    _, checks = doctor(CANARY_DATABASE=phorge.url.database)
    assert (checks["old side"]["status"], checks["old side"]["detail"]) == (
        "fail",
        f"no PhorgeBridgeQueueDaemon is running, and the weights give phd {share}: those "
        "tasks wait. Start its systemd unit (bin/phd start and restart do not start it): "
        f"{unit}",
    )
    daemons(
        phorge, ("PhorgeBridgeQueueDaemon", "run", 4000), ("PhabricatorTaskmasterDaemon", "run", 5)
    )
    _, checks = doctor()
    assert checks["old side"]["status"] == "fail", "a dead one, or Phorge's own, is not it"
    daemons(phorge, ("PhorgeBridgeQueueDaemon", "wait", 5))
    ignored = (
        "; not counted, as Phorge's daemon console calls them: 0 unknown (heartbeat over "
        "360 s old), 1 dead (over 3600 s)"
    )
    _, checks = doctor()
    assert (checks["old side"]["status"], checks["old side"]["detail"]) == (
        "warn",
        f"1 PhorgeBridgeQueueDaemon running for phd's share: {share}, none under its systemd "
        f"unit: bin/phd restart stops them and starts none. Run it under the unit instead: "
        f"{unit}{ignored}",
    )
    daemons(phorge, ("PhorgeBridgeQueueDaemon", "run", 5), argv=("--standalone",))
    _, checks = doctor()
    assert (checks["old side"]["status"], checks["old side"]["detail"]) == (
        "ok",
        f"2 PhorgeBridgeQueueDaemon running for phd's share: {share} (1 under its unit){ignored}",
    )
    store.set_weights({"*": {"celery": 100}, mail: {"python": 50}})
    _, checks = doctor()
    assert checks["old side"]["detail"] == (
        "the weights leave phd nothing: no PhorgeBridgeQueueDaemon needed"
    )
