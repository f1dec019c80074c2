"""``phorge-bridge doctor``: check every dependency the bridge has, and name each failure.

Each check is a small function ``check(doctor) -> Check`` in :data:`CHECKS`, run in
order; adding one is one line there. A check that needs an earlier one to have passed
calls ``doctor.require(name)``, which skips it (rather than failing it twice) when that
one did not pass. A check that raises fails with the exception's message.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, Literal, cast

from sqlalchemy import Engine, inspect

from bridge.assembly import build_registry
from bridge.canary.store import CanaryStore
from bridge.canary.weights import DEFAULT, OPTION, SCALE, Canary, percent
from bridge.cli.service_errors import driver_error, first_line
from bridge.cli.tasks import stamp
from bridge.config import ConfigError, Settings, load_settings
from bridge.errors import (
    ConduitAuthError,
    ConduitError,
    ConduitMethodNotFoundError,
    RunnerBootError,
    WritesRefused,
)
from bridge.handlers.api import TaskContext
from bridge.handlers.registry import Registry
from bridge.phorge import extension as phorge_extension
from bridge.phorge.extension import VERSION_METHOD, shipped_sha256, shipped_version
from bridge.queue import PhorgeQueue
from bridge.queue import statements as sql
from bridge.queue.beat_lock import beat_lock_holder
from bridge.queue.dialect import is_mysql
from bridge.queue.implementations import CELERY, LEVELS, NATIVE, PYTHON
from bridge.queue.schema import WORKER_TABLES, beside
from bridge.transports.conduit.client import ConduitClient
from bridge.transports.conduit.handler import ConduitProxyHandler
from bridge.transports.php_runner.process import RunnerCommand, RunnerProcess
from bridge.transports.task_run import execute_params

Status = Literal["ok", "warn", "fail", "skip"]

# Phorge's daemon console (PhabricatorDaemonLogQuery): a running daemon whose heartbeat
# (daemon_log.dateModified, every PhutilDaemonHandle::getHeartbeatEventFrequency() = 120 s)
# is older than 3 beats is "unknown", older than 30 beats "dead".
HEARTBEAT_SECONDS = 120
UNKNOWN_AFTER = 3 * HEARTBEAT_SECONDS
DEAD_AFTER = 30 * HEARTBEAT_SECONDS
RUNNING_STATUSES = ("run", "wait", "exiting")

# Host clock vs the database's: the bridge itself only uses the database's, but operator
# epochs (``delay --until``) and Phorge's PHP hosts use theirs.
SKEW_WARN = 2
SKEW_FAIL = 300

# How long doctor waits for the broker and for Conduit.
PROBE_TIMEOUT = 10.0


@dataclass(frozen=True)
class Check:
    """One check's verdict, as printed and as ``--json`` emits it."""

    name: str
    status: Status
    detail: str


class Skipped(Exception):
    """A check cannot run because one it depends on did not pass."""


@dataclass
class Doctor:
    """What the checks share: the settings, and the connections made from them."""

    settings: Settings | None = None
    results: dict[str, Check] = field(default_factory=dict)

    def require(self, name: str) -> None:
        earlier = self.results.get(name)
        if earlier is None or earlier.status not in ("ok", "warn"):
            raise Skipped(f"needs the {name} check to pass")

    @cached_property
    def queue(self) -> PhorgeQueue:
        self.require("settings")
        assert self.settings is not None
        return PhorgeQueue.from_url(self.settings.database_url, attempts=1)

    @cached_property
    def conduit(self) -> ConduitClient | None:
        """A client with short timeouts, or None when the proxy is not configured."""
        self.require("settings")
        assert self.settings is not None
        if self.settings.conduit is None:
            return None
        client = ConduitClient.from_settings(self.settings.conduit)
        client.read_timeout = min(client.read_timeout, PROBE_TIMEOUT)
        return client

    @cached_property
    def canary_store(self) -> CanaryStore:
        """Phorge's config table, where the canary's weights are (doctor says a
        missing table in its own words)."""
        assert self.settings is not None
        return CanaryStore.for_settings(self.queue.engine, self.settings, warn_missing=False)

    @property
    def token_setting(self) -> str:
        assert self.settings is not None and self.settings.conduit is not None
        return self.settings.conduit.token_setting

    def run(self, check: Callable[[Doctor], Check]) -> Check:
        name = check.__name__.removeprefix("check_").replace("_", " ")
        try:
            result = check(self)
        except Skipped as exc:
            result = Check(name, "skip", str(exc))
        except Exception as exc:
            result = Check(name, "fail", f"{type(exc).__name__}: {exc}")
        self.results[name] = result
        return result


def check_settings(doctor: Doctor) -> Check:
    try:
        doctor.settings = load_settings()
    except ConfigError as exc:
        return Check("settings", "fail", f"configuration error: {exc}")
    return Check("settings", "ok", "every BRIDGE_* setting is valid")


def check_database(doctor: Doctor) -> Check:
    try:
        now = doctor.queue.server_time()
    except Exception as exc:
        return Check("database", "fail", f"unreachable: {exc}")
    return Check("database", "ok", f"reachable (server time {now})")


def check_database_writes(doctor: Doctor) -> Check:
    """A write that changes nothing: a read-only or full database refuses it too."""
    doctor.require("tables")
    try:
        doctor.queue.probe_writes()
    except WritesRefused as exc:
        return Check(
            "database writes",
            "fail",
            f"refused, the database is read-only or full (no task starts until it accepts "
            f"writes): {exc.__cause__ or exc}",
        )
    return Check("database writes", "ok", "accepted")


def _type_name(column_type: Any, dialect: Any) -> str:
    """A column type as the server would spell it, without charset and collation."""
    compiled = column_type.compile(dialect=dialect)
    compiled = re.sub(r"\s+(CHARACTER SET|COLLATE)\s+\S+", "", compiled, flags=re.I)
    # Integer display widths (MariaDB's INT(10)) are no part of the type.
    compiled = re.sub(
        r"\b(TINYINT|SMALLINT|MEDIUMINT|INTEGER|INT|BIGINT)\(\d+\)", r"\1", compiled, flags=re.I
    )
    return re.sub(r"\bINT\b", "INTEGER", compiled.upper())


def check_tables(doctor: Doctor) -> Check:
    """Phorge's four tables, column for column (name, type, nullability)."""
    doctor.require("database")
    engine = doctor.queue.engine
    inspector = inspect(engine)
    problems = []
    existing = set(inspector.get_table_names())
    for table in WORKER_TABLES:
        if table.name not in existing:
            problems.append(f"{table.name} is missing")
            continue
        found = {c["name"]: c for c in inspector.get_columns(table.name)}
        for column in table.columns:
            actual = found.get(column.name)
            if actual is None:
                problems.append(f"{table.name}.{column.name} is missing")
                continue
            want = _type_name(column.type.dialect_impl(engine.dialect), engine.dialect)
            have = _type_name(actual["type"], engine.dialect)
            if want != have:
                problems.append(f"{table.name}.{column.name} is {have}, expected {want}")
            if bool(actual["nullable"]) != bool(column.nullable) and not column.primary_key:
                null = "NULL" if column.nullable else "NOT NULL"
                problems.append(f"{table.name}.{column.name} should be {null}")
    if problems:
        return Check("tables", "fail", "; ".join(problems))
    return Check("tables", "ok", ", ".join(t.name for t in WORKER_TABLES))


def check_task_id_counter(doctor: Doctor) -> Check:
    """lisk_counter's worker_activetask row: PHP and the bridge draw task ids from it."""
    doctor.require("tables")
    with doctor.queue.engine.connect() as conn:
        value = conn.execute(sql.select_task_id_counter()).scalar()
        highest = conn.execute(sql.select_highest_task_id()).scalar()
    name = "task id counter"
    if value is None:
        if highest:
            return Check(
                name,
                "fail",
                f"lisk_counter has no worker_activetask row but task ids reach {highest}: "
                "the next task would reuse id 1",
            )
        return Check(name, "warn", "no worker_activetask row yet; the first enqueue makes it")
    if highest and value < highest:
        return Check(name, "fail", f"lisk_counter is at {value}, below the highest id {highest}")
    return Check(name, "ok", f"worker_activetask at {value}")


def coverage(registry: Registry, settings: Settings) -> str:
    """Who serves what, whatever the queue holds: an empty queue names no class, and an
    operator checking a new setup wants to see the runner and the proxy counted."""
    native = sorted(c for c in registry.native if registry.allowed(c))
    parts = [f"native handlers serve {', '.join(native)}" if native else "no native handler"]
    others = "every other class" if native else "every class"
    runner = settings.runner
    takes_all = runner is not None and "*" in runner.classes
    if runner is not None and runner.classes:
        globs = ",".join(runner.classes)
        which = others if takes_all else f"the classes matching {globs}"
        parts.append(f"the PHP runner serves {which} (BRIDGE_RUNNER_CLASSES={globs})")
    if settings.conduit is not None and not takes_all:
        parts.append(f"the Conduit proxy serves {others} (BRIDGE_CONDUIT_URL)")
    elif not takes_all:
        parts.append(f"{others} is left to PHP")
    if registry.include != ("*",) or registry.exclude:
        parts.append("BRIDGE_HANDLERS_INCLUDE and BRIDGE_HANDLERS_EXCLUDE narrow them all")
    return "; ".join(parts)


def check_served_classes(doctor: Doctor) -> Check:
    doctor.require("database")
    assert doctor.settings is not None
    classes = doctor.queue.task_classes()
    registry = build_registry(doctor.settings)
    if not classes:
        serves = coverage(registry, doctor.settings)
        return Check("served classes", "ok", f"none in the queue; {serves}")
    served = registry.runnable(classes)
    detail = f"{len(classes)} in the queue; served by the bridge: {', '.join(served) or 'none'}"
    left = sorted(set(classes) - set(served))
    if left:
        detail += f"; left to PHP (no handler, or excluded): {', '.join(left)}"
    return Check("served classes", "ok", detail)


def beat_state(engine: Engine, owner_prefix: str) -> Check:
    """Some beat holds the beat lock: without one no poll is sent and nothing is leased
    (doctor's check, and a line of ``stats``)."""
    if not is_mysql(engine):
        return Check("beat", "ok", "not checked: SQLite runs one beat, in this process's host")
    holder = beat_lock_holder(engine, owner_prefix)
    if holder is None:
        return Check(
            "beat",
            "fail",
            "no beat holds the beat lock, so no poll is sent: start `celery -A bridge beat` "
            "(or a worker with -B); a second one on another host stands by",
        )
    return Check("beat", "ok", f"a beat sends the polls (database connection {holder})")


def check_beat(doctor: Doctor) -> Check:
    doctor.require("database")
    assert doctor.settings is not None
    return beat_state(doctor.queue.engine, doctor.settings.owner_prefix)


def check_broker(doctor: Doctor) -> Check:
    doctor.require("settings")
    assert doctor.settings is not None
    from kombu import Connection

    with Connection(doctor.settings.broker_url, connect_timeout=PROBE_TIMEOUT) as connection:
        try:
            # kombu-stubs say ``timeout: int``; kombu takes any seconds (``time() + timeout``).
            connection.ensure_connection(max_retries=1, timeout=cast(int, PROBE_TIMEOUT))
        except Exception as exc:
            return Check("broker", "fail", f"{connection.as_uri()} unreachable: {exc}")
        return Check("broker", "ok", f"{connection.as_uri()} reachable")


def check_queue_consumers(doctor: Doctor) -> Check:
    """Queues with due rows and no live worker, from Celery's control API and the database."""
    doctor.require("broker")
    doctor.require("database")
    from bridge.celery import app
    from bridge.runtime.consumers import describe, survey

    assert doctor.settings is not None
    statuses = survey(app, doctor.queue.stats(), build_registry(doctor.settings), doctor.settings)
    detail = "; ".join(describe(s, doctor.settings.control_queue) for s in statuses)
    return Check("queue consumers", "fail" if any(s.stranded for s in statuses) else "ok", detail)


def check_conduit(doctor: Doctor) -> Check:
    client = doctor.conduit
    if client is None:
        assert doctor.settings is not None
        elsewhere = "run on the PHP runner" if doctor.settings.runner else "stay with PHP"
        return Check("conduit", "ok", f"not configured: classes without a handler {elsewhere}")
    try:
        host = client.call("conduit.ping")
    except ConduitAuthError:
        host = "?"  # Phorge answered; the token check says what it thinks of the token
    except ConduitError as exc:
        return Check("conduit", "fail", str(exc))
    return Check("conduit", "ok", f"{client.base_url} answers (host {host})")


def check_conduit_token(doctor: Doctor) -> Check:
    doctor.require("conduit")
    client = doctor.conduit
    if client is None:
        raise Skipped("the Conduit proxy is not configured")
    setting = doctor.token_setting
    try:
        user = client.call("user.whoami")
    except ConduitAuthError as exc:
        return Check("conduit token", "fail", f"Phorge refuses the token in {setting}: {exc}")
    name = user.get("userName") if isinstance(user, dict) else None
    roles = user.get("roles") if isinstance(user, dict) else None
    if not isinstance(roles, list) or "admin" not in roles or "disabled" in roles:
        return Check(
            "conduit token",
            "fail",
            f"the token in {setting} belongs to {name!r}, which is not an active administrator "
            "(worker.execute answers administrators only)",
        )
    return Check("conduit token", "ok", f"{setting}: administrator {name!r}")


def check_conduit_breaker(doctor: Doctor) -> Check:
    """What the workers' circuit breakers conclude: they probe exactly as this does."""
    client = doctor.conduit
    if client is None:
        raise Skipped("the Conduit proxy is not configured")
    reason = ConduitProxyHandler(client).probe()
    if reason is None:
        return Check("conduit breaker", "ok", "closed: PHP-only tasks are leased")
    return Check(
        "conduit breaker",
        "fail",
        f"open: the bridge leases no PHP-only task until Conduit answers ({reason})",
    )


def check_extension(doctor: Doctor) -> Check:
    client = doctor.conduit
    if client is None:
        raise Skipped("the Conduit proxy is not configured")
    doctor.require("conduit token")
    install = "run `phorge-bridge phorge install-extension --phorge-root ...`"
    try:
        installed = client.call(VERSION_METHOD)
    except ConduitMethodNotFoundError:
        return Check(
            "extension",
            "fail",
            f"Phorge has no {VERSION_METHOD}: the extension is missing or older than "
            f"{shipped_version()}; {install}",
        )
    if not isinstance(installed, dict) or installed.get("sha256") != shipped_sha256():
        version = installed.get("version") if isinstance(installed, dict) else installed
        return Check(
            "extension",
            "fail",
            f"installed {version!r} differs from the {shipped_version()} this bridge ships; "
            f"{install}",
        )
    return Check("extension", "ok", f"version {shipped_version()}, current")


# How long doctor gives a PHP runner to boot and answer.
RUNNER_TIMEOUT = 30.0
RUNNER_OFF = "not applicable (the PHP runner is off: BRIDGE_PHORGE_ROOT is not set)"


# The task the runner is asked to describe: a whole spec, as a worker sends one (the PHP
# side refuses a spec missing a field).
PROBE_SPEC = execute_params(TaskContext(1, "PhabricatorWorker", [], 0, 0, raw_data="[]"))


def check_php_runner(doctor: Doctor) -> Check:
    """The PHP binary, its version, that the checkout bootstraps and that a runner answers:
    one runner started as a worker starts it, asked to describe a class."""
    doctor.require("settings")
    assert doctor.settings is not None
    runner = doctor.settings.runner
    if runner is None:
        return Check("php runner", "ok", RUNNER_OFF)
    command = RunnerCommand(runner.php, runner.phorge_root)
    started = time.monotonic()
    try:
        process = RunnerProcess(command)
        try:
            process.ready(RUNNER_TIMEOUT)
            booted = time.monotonic() - started
            answer = process.request({"op": "describe", "task": PROBE_SPEC}, RUNNER_TIMEOUT)
        finally:
            process.stop()
    except RunnerBootError as exc:
        return Check(
            "php runner",
            "fail",
            f"{command.phorge_root} does not boot with {command.php} (check BRIDGE_PHORGE_ROOT "
            f"and BRIDGE_RUNNER_PHP); its classes are held back: {exc}",
        )
    if answer.get("type") != "described":
        return Check("php runner", "fail", f"the runner answered {answer!r}")
    return Check(
        "php runner",
        "ok",
        f"PHP {process.php_version} ({command.php}) boots {command.phorge_root} in "
        f"{booted * 1000:.0f} ms and answers",
    )


def check_php_extension_files(doctor: Doctor) -> Check:
    """The task run installed in the checkout, the one worker.execute runs there (the
    runner always runs the copy this bridge ships)."""
    doctor.require("settings")
    assert doctor.settings is not None
    if doctor.settings.runner is None:
        return Check("php extension files", "ok", RUNNER_OFF)
    status = phorge_extension.check(doctor.settings.runner.phorge_root)
    if status:
        return Check("php extension files", "ok", status.describe())
    return Check(
        "php extension files",
        "warn",
        f"{status.describe()} (the runner is not affected; worker.execute on this "
        "checkout is): run `phorge-bridge phorge install-extension --phorge-root ...`",
    )


def _daemon_database(queue: PhorgeQueue) -> str | None:
    """The database of Phorge's daemon log, beside the worker one: ``{namespace}_daemon``."""
    url = queue.engine.url
    return None if url.get_backend_name() == "sqlite" else beside(url.database, "daemon")


# MySQL's refusals a GRANT cures: no access to the database (1044), to the table (1142).
ACCESS_DENIED = (1044, 1142)


def unreadable(engine: Engine, database: str, exc: Exception) -> str:
    """Why the daemon log could not be read, in one line: for a refusal, the grant to add
    (the one docs/operating.md recommends), to the account the server matched."""
    cause = driver_error(exc)
    if not cause.args or cause.args[0] not in ACCESS_DENIED:
        return f"Phorge's daemon log is not readable: {first_line(cause)}"
    with engine.connect() as conn:
        user, _, host = conn.execute(sql.current_account()).scalar_one().rpartition("@")
    return (
        "this account may not read Phorge's daemon log: "
        f"GRANT SELECT ON {database}.daemon_log TO '{user}'@'{host}'"
    )


@dataclass(frozen=True)
class Daemons:
    """Daemons of a class in Phorge's daemon log: those alive, those of them run outside
    phd's overseer (by the shipped systemd unit), and what was left out of the count."""

    live: int
    standalone: int
    ignored: str


# The argument the shipped unit starts PhorgeBridgeQueueDaemon with, outside phd's
# overseer (deploy/systemd/phorge-bridge-queue-daemon@.service).
STANDALONE = "--standalone"


def count_daemons(doctor: Doctor, name: str, daemon: str) -> Daemons | Check:
    """The live daemons of class like ``daemon`` in Phorge's daemon log and what is left
    out of the count (those it calls unknown or dead); else check ``name``'s verdict: not
    applicable without a daemon database beside the worker one, unknown when the log
    cannot be read."""
    database = _daemon_database(doctor.queue)
    if database is None:
        return Check(name, "ok", "not applicable (no Phorge daemon database beside this one)")
    query = sql.count_daemons(
        database, daemon, UNKNOWN_AFTER, DEAD_AFTER, RUNNING_STATUSES, STANDALONE
    )
    try:
        with doctor.queue.engine.connect() as conn:
            live, unknown, dead, standalone = (int(n) for n in conn.execute(query).one())
    except Exception as exc:
        return Check(name, "warn", f"unknown: {unreadable(doctor.queue.engine, database, exc)}")
    ignored = (
        f"; not counted, as Phorge's daemon console calls them: {unknown} unknown "
        f"(heartbeat over {UNKNOWN_AFTER} s old), {dead} dead (over {DEAD_AFTER} s)"
        if unknown or dead
        else ""
    )
    return Daemons(live, standalone, ignored)


def check_taskmasters(doctor: Doctor) -> Check:
    """PHP taskmasters with a live heartbeat, as Phorge's daemon console counts them."""
    doctor.require("database")
    name = "taskmasters"
    counted = count_daemons(doctor, name, "%TaskmasterDaemon")
    if isinstance(counted, Check):
        return counted
    if counted.live:
        return Check(
            name,
            "warn",
            f"{counted.live} running. They split the work with the bridge, and retry "
            "Python-only classes every 5 minutes forever: set phd.taskmasters to 0 and "
            "restart phd, running PhorgeBridgeQueueDaemon's unit for a canary "
            f"(docs/canary.md){counted.ignored}",
        )
    return Check(name, "ok", f"none running{counted.ignored}")


QUEUE_DAEMON = "PhorgeBridgeQueueDaemon"
UNIT = "phorge-bridge-queue-daemon"  # deploy/systemd/phorge-bridge-queue-daemon@.service


def phd_share(canary: Canary) -> list[str]:
    """What the weights leave to phd at the celery level, as an operator reads it."""
    share = [
        f"{name} {percent(SCALE - weight):g}%"
        for name in canary.named
        if (weight := canary.weight(name, CELERY)) < SCALE
    ]
    if canary.configured(DEFAULT).celery < SCALE:
        share.append("every class not named")
    return share


def weights_after_the_canary_check(doctor: Doctor, name: str) -> Canary | Check:
    """The weights for check ``name``, which needs the canary check; its verdict when
    the canary is off."""
    doctor.require("canary")
    assert doctor.settings is not None
    if not doctor.settings.canary:
        return Check(name, "ok", "not applicable (BRIDGE_CANARY=false)")
    return doctor.canary_store.read()


def check_old_side(doctor: Doctor) -> Check:
    """A share the weights give phd has a live PhorgeBridgeQueueDaemon to run it, one at
    least under the shipped systemd unit: nothing else runs that share, and ``bin/phd
    start``, ``restart`` or a reboot starts no daemon outside phd's fixed set (``restart``
    stops one that ``bin/phd launch`` started), so without this check its tasks would wait
    unseen."""
    name = "old side"
    canary = weights_after_the_canary_check(doctor, name)
    if isinstance(canary, Check):
        return canary
    share = phd_share(canary)
    if not share:
        return Check(name, "ok", f"the weights leave phd nothing: no {QUEUE_DAEMON} needed")
    counted = count_daemons(doctor, name, QUEUE_DAEMON)
    if isinstance(counted, Check):
        return counted
    running = f"{counted.live} {QUEUE_DAEMON} running for phd's share: {', '.join(share)}"
    if counted.standalone:
        return Check(
            name, "ok", f"{running} ({counted.standalone} under its unit){counted.ignored}"
        )
    unit = f"systemctl enable --now {UNIT}@1 (docs/canary.md)"
    if counted.live:
        return Check(
            name,
            "warn",
            f"{running}, none under its systemd unit: bin/phd restart stops them and "
            f"starts none. Run it under the unit instead: {unit}{counted.ignored}",
        )
    return Check(
        name,
        "fail",
        f"no {QUEUE_DAEMON} is running, and the weights give phd {', '.join(share)}: those "
        f"tasks wait. Start its systemd unit (bin/phd start and restart do not start it): "
        f"{unit}{counted.ignored}",
    )


def check_canary(doctor: Doctor) -> Check:
    """The canary's weights (Phorge's option phorge-bridge.canary): which classes
    are shared, and those the guard or an operator rolled back."""
    doctor.require("database")
    assert doctor.settings is not None
    if not doctor.settings.canary:
        return Check("canary", "ok", "off (BRIDGE_CANARY=false): every class wholly on the bridge")
    engine = doctor.queue.engine
    store = doctor.canary_store
    try:
        values = store.read_values()
    except Exception as exc:
        cause = driver_error(exc)
        if not cause.args or cause.args[0] not in ACCESS_DENIED:
            problem = first_line(cause)
        else:
            with engine.connect() as conn:
                user, _, host = conn.execute(sql.current_account()).scalar_one().rpartition("@")
            problem = (
                "this account may not use Phorge's config table: GRANT SELECT, INSERT, UPDATE "
                f"ON {store.table_name} TO '{user}'@'{host}'"
            )
        return Check(
            "canary",
            "fail",
            "weights unknown, so the bridge runs no class that may be shared (none before "
            f"a first good read; BRIDGE_CANARY=false if no class ever is): {problem}",
        )
    if values is None:
        return Check(
            "canary",
            "ok",
            f"no weights: {store.table_name} does not exist, so every class runs wholly on "
            "the bridge (BRIDGE_CANARY_DATABASE names the database of Phorge's config table)",
        )
    try:
        canary = store.read()
    except ConfigError as exc:
        return Check(
            "canary",
            "fail",
            f"{exc} (in {store.table_name}): fix it with "
            f"./bin/config set --database {OPTION} '<json>'",
        )
    now = doctor.queue.server_time()
    rolled_back = [
        f"{name} ({level}) rolled back since {stamp(state.rolled_back_at, now)}: "
        f"{state.reason}; once fixed, run `phorge-bridge canary promote {name} --level {level}`"
        for name in canary.named
        for level in LEVELS
        if (state := canary.state.of(name, level)).rolled_back
    ]
    shared = {(name, level) for name, level, _ in canary.partial()}
    weights = []
    for name in canary.named:
        below = [
            f"{level} {percent(canary.weight(name, level)):g}%"
            + (" (shared)" if (name, level) in shared else "")
            for level in LEVELS
            if canary.weight(name, level) < SCALE
        ]
        weights.append(f"{name} {', '.join(below) or '100%'}")
    others = ", ".join(f"{lv} {percent(canary.configured(DEFAULT).at(lv)):g}%" for lv in LEVELS)
    named = f"weights: {'; '.join(weights)}" if weights else f"no class is named in {OPTION}"
    detail = f"{named}; every other class: {others}"
    if rolled_back:
        return Check("canary", "warn", f"{'; '.join(rolled_back)}. {detail}")
    return Check("canary", "ok", detail)


def check_canary_reach(doctor: Doctor) -> Check:
    """Each class the weights name for the bridge has a live worker that runs it, and each
    class shared at the python level one that runs it natively with a PHP path beside (a
    rollback's old side): else its share waits for nobody, from what the workers announce."""
    doctor.require("broker")
    from bridge.celery import app
    from bridge.runtime.announce import announcements
    from bridge.runtime.consumers import INSPECT_TIMEOUT

    name = "canary reach"
    weights = weights_after_the_canary_check(doctor, name)
    if isinstance(weights, Check):
        return weights
    assert doctor.settings is not None
    named = [c for c in weights.named if weights.weight(c, CELERY) > 0]
    if not named:
        return Check(name, "ok", "the weights name no class for the bridge")
    nodes = announcements(app, INSPECT_TIMEOUT)
    if nodes is None:
        return Check(name, "ok", "not applicable (this broker carries no worker announcements)")
    problems = []
    for task_class in named:
        queue = doctor.settings.router.queue_for(task_class)
        live = [a for a in nodes.values() if a.runs(task_class, queue)]
        if not live:
            share = f"{percent(weights.weight(task_class, CELERY)):g}%"
            problems.append(
                f"{task_class} ({share} for the bridge): no live worker runs it on {queue}"
            )
        elif weights.level_of(task_class) == PYTHON and not any(
            a.coverage.transport_for(task_class) == NATIVE
            and a.coverage.php_transport_for(task_class)
            for a in live
        ):
            problems.append(
                f"{task_class} (shared at the python level): no live worker on {queue} runs "
                "it natively with a PHP path for the old side"
            )
    if problems:
        return Check(name, "fail", f"{'; '.join(problems)}: those tasks wait")
    return Check(
        name, "ok", f"{len(named)} class(es) named for the bridge, each run by a live worker"
    )


def check_clock_skew(doctor: Doctor) -> Check:
    doctor.require("database")
    before = time.time()
    server = doctor.queue.server_time()
    after = time.time()
    # The server's clock has whole seconds: allow the round trip and one second.
    host = (before + after) / 2
    skew = server - host
    slack = (after - before) / 2 + 1
    excess = max(abs(skew) - slack, 0)
    detail = f"database clock {skew:+.1f} s from this host's"
    if excess > SKEW_FAIL:
        return Check("clock skew", "fail", f"{detail}: fix NTP on one of them")
    if excess > SKEW_WARN:
        return Check("clock skew", "warn", f"{detail}: epochs typed here are off by as much")
    return Check("clock skew", "ok", detail)


CHECKS: list[Callable[[Doctor], Check]] = [
    check_settings,
    check_database,
    check_tables,
    check_database_writes,
    check_task_id_counter,
    check_served_classes,
    check_beat,
    check_broker,
    check_queue_consumers,
    check_conduit,
    check_conduit_token,
    check_conduit_breaker,
    check_extension,
    check_php_runner,
    check_php_extension_files,
    check_taskmasters,
    check_canary,
    check_old_side,
    check_canary_reach,
    check_clock_skew,
]


def diagnose() -> list[Check]:
    """Run every check in order."""
    doctor = Doctor()
    return [doctor.run(check) for check in CHECKS]


def render(results: list[Check], as_json: bool) -> str:
    if as_json:
        return json.dumps(
            {
                "ok": not any(r.status == "fail" for r in results),
                "checks": [asdict(r) for r in results],
            }
        )
    return "\n".join(f"{r.status:<4}  {r.name}: {r.detail}" for r in results)
