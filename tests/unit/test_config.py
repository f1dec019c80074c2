"""``load_settings``: every ``BRIDGE_*`` setting, its default, what it accepts and what it refuses.

The Conduit settings' own checks live beside the client, in ``test_conduit_client.py``.
"""

from __future__ import annotations

import operator
from pathlib import Path

import pytest

from bridge.config import SETTINGS, ConfigError, MaxInflight, explain, load_settings
from bridge.errors import BridgeError
from bridge.queue.model import new_owner

CONDUIT_SETTINGS = {s.name for s in SETTINGS if s.name.startswith("BRIDGE_CONDUIT_")}


def test_defaults():
    settings = load_settings({})
    assert settings.database_url == "sqlite:///phorge-bridge.db"
    assert settings.broker_url == "sqla+sqlite:///phorge-bridge-broker.db"
    assert settings.poll_interval == 0.25
    assert (settings.router.rules, settings.router.default_queue) == ((), "phorge")
    assert settings.control_queue == "bridge.control"
    assert settings.max_inflight == MaxInflight(500, {})
    assert (settings.dispatch_lease, settings.default_lease) == (300, 7200)
    assert (settings.retry_base, settings.retry_max, settings.retry_jitter) == (15, 3600, 0.2)
    assert settings.report_attempts == 5
    assert (settings.handlers_include, settings.handlers_exclude) == (("*",), ())
    assert settings.owner_prefix == "bridge"
    assert settings.inline_data_max == 8192
    assert settings.task_events is False  # Flower turns events on when it connects
    assert (settings.metrics_port, settings.metrics_address) == (None, "127.0.0.1")
    assert settings.conduit is None
    assert settings.runner is None


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_the_documented_default_is_the_default(setting):
    assert load_settings({setting.name: setting.default}) == load_settings({})


def test_an_empty_value_means_the_default():
    blanks = {s.name: "" for s in SETTINGS if s.name not in CONDUIT_SETTINGS}
    assert load_settings(blanks) == load_settings({})


# (variable, value, how to read it back from Settings, expected)
ACCEPTED = [
    ("BRIDGE_DATABASE_URL", "mysql+mysqldb://u:p@db/phabricator_worker", "database_url", None),
    ("BRIDGE_DATABASE_URL", "mariadb://u:p@db:3306/phabricator_worker", "database_url", None),
    ("BRIDGE_DATABASE_URL", "sqlite:////var/lib/bridge/phorge.db", "database_url", None),
    ("BRIDGE_BROKER_URL", "amqp://guest:guest@rabbit:5672//", "broker_url", None),
    ("BRIDGE_BROKER_URL", "rediss://redis:6380/3", "broker_url", None),
    ("BRIDGE_POLL_INTERVAL", "2.5", "poll_interval", 2.5),
    (
        "BRIDGE_ROUTES",
        "PhabricatorSearchWorker=search, *Mail*=mail,",
        "router.rules",
        (("PhabricatorSearchWorker", "search"), ("*Mail*", "mail")),
    ),
    ("BRIDGE_DEFAULT_QUEUE", "phorge.default", "router.default_queue", "phorge.default"),
    ("BRIDGE_CONTROL_QUEUE", "bridge:poll", "control_queue", "bridge:poll"),
    ("BRIDGE_MAX_INFLIGHT", "20", "max_inflight", MaxInflight(20, {})),
    (
        "BRIDGE_MAX_INFLIGHT",
        "20, phorge=5",
        "max_inflight",
        MaxInflight(20, {"phorge": 5}),
    ),
    ("BRIDGE_MAX_INFLIGHT", "phorge=5", "max_inflight", MaxInflight(500, {"phorge": 5})),
    ("BRIDGE_DISPATCH_LEASE", "60", "dispatch_lease", 60),
    ("BRIDGE_DISPATCH_AHEAD", "0.5", "dispatch_ahead", 0.5),
    ("BRIDGE_DEFAULT_LEASE", "600", "default_lease", 600),
    ("BRIDGE_RETRY_BASE", "1", "retry_base", 1),
    ("BRIDGE_RETRY_MAX", "60", "retry_max", 60),
    ("BRIDGE_RETRY_JITTER", "0", "retry_jitter", 0.0),
    ("BRIDGE_RETRY_JITTER", "1", "retry_jitter", 1.0),
    ("BRIDGE_REPORT_ATTEMPTS", "1", "report_attempts", 1),
    ("BRIDGE_HANDLERS_INCLUDE", "Phabricator*, Herald*", "handlers_include", None),
    ("BRIDGE_HANDLERS_EXCLUDE", "*Repository*", "handlers_exclude", ("*Repository*",)),
    ("BRIDGE_OWNER_PREFIX", "bridge-eu-1", "owner_prefix", "bridge-eu-1"),
    ("BRIDGE_INLINE_DATA_MAX", "1", "inline_data_max", 1),
    ("BRIDGE_BATCH_MAX", "1", "batch_max", 1),
    ("BRIDGE_TASK_EVENTS", "false", "task_events", False),
    ("BRIDGE_TASK_EVENTS", "OFF", "task_events", False),
    ("BRIDGE_TASK_EVENTS", "0", "task_events", False),
    ("BRIDGE_TASK_EVENTS", "Yes", "task_events", True),
    ("BRIDGE_METRICS_PORT", "9808", "metrics_port", range(9808, 9809)),
    ("BRIDGE_METRICS_PORT", "65535", "metrics_port", range(65535, 65536)),
    ("BRIDGE_METRICS_PORT", "9100-9103", "metrics_port", range(9100, 9104)),
    ("BRIDGE_METRICS_ADDRESS", "0.0.0.0", "metrics_address", "0.0.0.0"),
    ("BRIDGE_PHORGE_ROOT", "/srv/phorge", "runner.phorge_root", Path("/srv/phorge")),
    ("BRIDGE_RUNNER_CLASSES", "*Search*, *Mail*", "runner_classes", ("*Search*", "*Mail*")),
    ("BRIDGE_RUNNER_PHP", "/usr/bin/php8.2", "runner_php", None),
    ("BRIDGE_RUNNER_MAX_TASKS", "1", "runner_max_tasks", 1),
    ("BRIDGE_RUNNER_MAX_AGE", "60", "runner_max_age", 60.0),
    ("BRIDGE_RUNNER_MAX_RSS", "128", "runner_max_rss", 128 * 1024 * 1024),
    ("BRIDGE_RUNNER_RELOAD_STAMP", "/srv/deployed", "runner_reload_stamp", None),
    ("BRIDGE_CANARY_DATABASE", "phabricator_config", "canary_database", "phabricator_config"),
    ("BRIDGE_CANARY", "false", "canary", False),
    ("BRIDGE_DAEMON_CONSOLE", "false", "daemon_console", False),
    ("BRIDGE_CANARY_REFRESH", "0.5", "canary_refresh", 0.5),
    ("BRIDGE_CANARY_GUARD_INTERVAL", "2", "canary_guard_interval", 2.0),
    ("BRIDGE_CANARY_WINDOW", "600", "canary_window", 600),
    ("BRIDGE_CANARY_WINDOW_RUNS", "100", "canary_window_runs", 100),
    ("BRIDGE_CANARY_MIN_RUNS", "20", "canary_min_runs", 20),
    ("BRIDGE_CANARY_MIN_FAILURES", "5", "canary_min_failures", 5),
    ("BRIDGE_CANARY_MAX_DROP", "0.05", "canary_max_drop", 0.05),
    ("BRIDGE_CANARY_SIGNIFICANCE", "0.001", "canary_significance", 0.001),
    ("BRIDGE_CANARY_FAILURE_LIMIT", "5", "canary_failure_limit", 5),
    ("BRIDGE_CANARY_HISTORY", "3600", "canary_history", 3600),
    ("BRIDGE_CANARY_MAX_SLOWDOWN", "1", "canary_max_slowdown", 1.0),
    ("BRIDGE_CANARY_SLOWDOWN_FLOOR", "0.5", "canary_slowdown_floor", 0.5),
    ("BRIDGE_CANARY_MAX_FOLLOWUP_CHANGE", "0.2", "canary_max_followup_change", 0.2),
    ("BRIDGE_CANARY_MAX_YIELDING", "86400", "canary_max_yielding", 86400),
]
EXPECTED_GLOBS = {"BRIDGE_HANDLERS_INCLUDE": ("Phabricator*", "Herald*")}


def _case_id(env: dict[str, str]) -> str:
    return ",".join(f"{name.removeprefix('BRIDGE_')}={value[:24]}" for name, value in env.items())


@pytest.mark.parametrize(
    ("name", "value", "attribute", "expected"),
    ACCEPTED,
    ids=[_case_id({name: value}) for name, value, *_ in ACCEPTED],
)
def test_a_valid_value_is_read(name, value, attribute, expected):
    settings = load_settings({name: value})
    if expected is None:
        expected = EXPECTED_GLOBS.get(name, value)
    assert operator.attrgetter(attribute)(settings) == expected


# (environment, the setting the error must name, a word of its explanation)
REFUSED = [
    ({"BRIDGE_POLL_INTERVALL": "1"}, "BRIDGE_POLL_INTERVALL", "unknown"),
    ({"BRIDGE_MAX_INFLIGHT": "mail=5"}, "BRIDGE_MAX_INFLIGHT", "no route"),
    ({"BRIDGE_DATABASE": "mysql://db"}, "BRIDGE_DATABASE", "unknown"),
    ({"BRIDGE_DATABASE_URL": "postgresql://db/phorge"}, "BRIDGE_DATABASE_URL", "mysql"),
    ({"BRIDGE_DATABASE_URL": "mysql+pymysql://db/phorge"}, "BRIDGE_DATABASE_URL", "accepted"),
    ({"BRIDGE_DATABASE_URL": "phorge.db"}, "BRIDGE_DATABASE_URL", "sqlite"),
    ({"BRIDGE_BROKER_URL": "kafka://k:9092"}, "BRIDGE_BROKER_URL", "amqp"),
    ({"BRIDGE_BROKER_URL": "rabbit:5672"}, "BRIDGE_BROKER_URL", "redis"),
    ({"BRIDGE_POLL_INTERVAL": "0"}, "BRIDGE_POLL_INTERVAL", "positive"),
    ({"BRIDGE_POLL_INTERVAL": "-1"}, "BRIDGE_POLL_INTERVAL", "positive"),
    ({"BRIDGE_POLL_INTERVAL": "soon"}, "BRIDGE_POLL_INTERVAL", "positive"),
    ({"BRIDGE_POLL_INTERVAL": "nan"}, "BRIDGE_POLL_INTERVAL", "positive"),
    ({"BRIDGE_POLL_INTERVAL": "inf"}, "BRIDGE_POLL_INTERVAL", "positive"),
    ({"BRIDGE_ROUTES": "PhabricatorSearchWorker"}, "BRIDGE_ROUTES", "glob=queue"),
    ({"BRIDGE_ROUTES": "=search"}, "BRIDGE_ROUTES", "glob=queue"),
    ({"BRIDGE_ROUTES": "*Search*="}, "BRIDGE_ROUTES", "glob=queue"),
    ({"BRIDGE_ROUTES": "*Mail*=mail queue"}, "BRIDGE_ROUTES", "glob=queue"),
    ({"BRIDGE_ROUTES": "*Mail*=mail,Herald*"}, "BRIDGE_ROUTES", "glob=queue"),
    ({"BRIDGE_ROUTES": "*Mail*=bridge.control"}, "BRIDGE_ROUTES", "control queue"),
    ({"BRIDGE_DEFAULT_QUEUE": "phorge tasks"}, "BRIDGE_DEFAULT_QUEUE", "queue name"),
    ({"BRIDGE_CONTROL_QUEUE": "phorge"}, "BRIDGE_CONTROL_QUEUE", "its own"),
    ({"BRIDGE_CONTROL_QUEUE": "bridge/control"}, "BRIDGE_CONTROL_QUEUE", "letters"),
    ({"BRIDGE_MAX_INFLIGHT": "0"}, "BRIDGE_MAX_INFLIGHT", "positive"),
    ({"BRIDGE_MAX_INFLIGHT": "-3"}, "BRIDGE_MAX_INFLIGHT", "positive"),
    ({"BRIDGE_MAX_INFLIGHT": "ten"}, "BRIDGE_MAX_INFLIGHT", "positive"),
    ({"BRIDGE_MAX_INFLIGHT": "10,mail=0"}, "BRIDGE_MAX_INFLIGHT", "positive"),
    ({"BRIDGE_MAX_INFLIGHT": "10,=5"}, "BRIDGE_MAX_INFLIGHT", "queue=N"),
    ({"BRIDGE_DISPATCH_LEASE": "0"}, "BRIDGE_DISPATCH_LEASE", "positive"),
    ({"BRIDGE_DISPATCH_AHEAD": "0"}, "BRIDGE_DISPATCH_AHEAD", "seconds or `off`"),
    ({"BRIDGE_DISPATCH_AHEAD": "never"}, "BRIDGE_DISPATCH_AHEAD", "seconds or `off`"),
    ({"BRIDGE_DISPATCH_LEASE": "1.5"}, "BRIDGE_DISPATCH_LEASE", "integer"),
    (
        {"BRIDGE_DISPATCH_LEASE": "3", "BRIDGE_POLL_INTERVAL": "2"},
        "BRIDGE_DISPATCH_LEASE",
        "twice BRIDGE_POLL_INTERVAL",
    ),
    ({"BRIDGE_DEFAULT_LEASE": "0"}, "BRIDGE_DEFAULT_LEASE", "positive"),
    ({"BRIDGE_RETRY_BASE": "0"}, "BRIDGE_RETRY_BASE", "positive"),
    ({"BRIDGE_RETRY_MAX": "-60"}, "BRIDGE_RETRY_MAX", "positive"),
    ({"BRIDGE_RETRY_BASE": "120", "BRIDGE_RETRY_MAX": "60"}, "BRIDGE_RETRY_BASE", "RETRY_MAX"),
    ({"BRIDGE_RETRY_JITTER": "1.5"}, "BRIDGE_RETRY_JITTER", "0 to 1"),
    ({"BRIDGE_RETRY_JITTER": "-0.1"}, "BRIDGE_RETRY_JITTER", "0 to 1"),
    ({"BRIDGE_RETRY_JITTER": "nan"}, "BRIDGE_RETRY_JITTER", "0 to 1"),
    ({"BRIDGE_REPORT_ATTEMPTS": "0"}, "BRIDGE_REPORT_ATTEMPTS", "positive"),
    # Room must be left for ":pid:time:host:sequence" in Phorge's varchar(64) leaseOwner.
    ({"BRIDGE_OWNER_PREFIX": "x" * 45}, "BRIDGE_OWNER_PREFIX", "short"),
    ({"BRIDGE_INLINE_DATA_MAX": "0"}, "BRIDGE_INLINE_DATA_MAX", "positive"),
    ({"BRIDGE_BATCH_MAX": "many"}, "BRIDGE_BATCH_MAX", "positive"),
    ({"BRIDGE_TASK_EVENTS": "maybe"}, "BRIDGE_TASK_EVENTS", "true or false"),
    ({"BRIDGE_METRICS_PORT": "0"}, "BRIDGE_METRICS_PORT", "integer"),
    ({"BRIDGE_METRICS_PORT": "http"}, "BRIDGE_METRICS_PORT", "integer"),
    ({"BRIDGE_METRICS_PORT": "99999"}, "BRIDGE_METRICS_PORT", "65535"),
    ({"BRIDGE_METRICS_PORT": "9103-9100"}, "BRIDGE_METRICS_PORT", "LOW-HIGH"),
    ({"BRIDGE_METRICS_PORT": "9100-70000"}, "BRIDGE_METRICS_PORT", "65535"),
    ({"BRIDGE_CONDUIT_URL": "https://phorge.example.com"}, "BRIDGE_CONDUIT_TOKEN", "token"),
    ({"BRIDGE_RUNNER_MAX_TASKS": "0"}, "BRIDGE_RUNNER_MAX_TASKS", "positive"),
    ({"BRIDGE_RUNNER_MAX_AGE": "never"}, "BRIDGE_RUNNER_MAX_AGE", "positive"),
    ({"BRIDGE_RUNNER_MAX_RSS": "1.5G"}, "BRIDGE_RUNNER_MAX_RSS", "positive"),
    ({"BRIDGE_CANARY_DATABASE": "phab-config"}, "BRIDGE_CANARY_DATABASE", "database name"),
    ({"BRIDGE_CANARY": "gray"}, "BRIDGE_CANARY", "true or false"),
    ({"BRIDGE_DAEMON_CONSOLE": "sometimes"}, "BRIDGE_DAEMON_CONSOLE", "true or false"),
    ({"BRIDGE_CANARY_REFRESH": "0"}, "BRIDGE_CANARY_REFRESH", "positive"),
    ({"BRIDGE_CANARY_GUARD_INTERVAL": "soon"}, "BRIDGE_CANARY_GUARD_INTERVAL", "positive"),
    ({"BRIDGE_CANARY_WINDOW": "5m"}, "BRIDGE_CANARY_WINDOW", "positive"),
    ({"BRIDGE_CANARY_WINDOW_RUNS": "0"}, "BRIDGE_CANARY_WINDOW_RUNS", "positive"),
    ({"BRIDGE_CANARY_MIN_RUNS": "-1"}, "BRIDGE_CANARY_MIN_RUNS", "positive"),
    ({"BRIDGE_CANARY_MIN_FAILURES": "1.5"}, "BRIDGE_CANARY_MIN_FAILURES", "positive"),
    ({"BRIDGE_CANARY_MAX_DROP": "2%"}, "BRIDGE_CANARY_MAX_DROP", "0 to 1"),
    ({"BRIDGE_CANARY_SIGNIFICANCE": "0"}, "BRIDGE_CANARY_SIGNIFICANCE", "between 0 and 1"),
    ({"BRIDGE_CANARY_FAILURE_LIMIT": "0"}, "BRIDGE_CANARY_FAILURE_LIMIT", "positive"),
    ({"BRIDGE_CANARY_MAX_SLOWDOWN": "0.5"}, "BRIDGE_CANARY_MAX_SLOWDOWN", "at least 1"),
    ({"BRIDGE_CANARY_SLOWDOWN_FLOOR": "-1"}, "BRIDGE_CANARY_SLOWDOWN_FLOOR", "positive"),
]


def test_the_runner_is_off_without_a_phorge_checkout():
    assert load_settings({"BRIDGE_RUNNER_CLASSES": "*Search*"}).runner is None


def test_the_runner_settings_go_together():
    runner = load_settings(
        {
            "BRIDGE_PHORGE_ROOT": "/srv/phorge",
            "BRIDGE_RUNNER_CLASSES": "*Search*",
            "BRIDGE_RUNNER_PHP": "php8.2",
            "BRIDGE_RUNNER_RELOAD_STAMP": "/srv/deployed",
        }
    ).runner
    assert runner is not None
    assert (runner.php, runner.classes) == ("php8.2", ("*Search*",))
    assert runner.reload_stamp == Path("/srv/deployed")
    assert (runner.max_tasks, runner.max_age, runner.max_rss) == (10_000, 3600.0, 512 * 2**20)


@pytest.mark.parametrize(
    ("env", "setting", "explanation"), REFUSED, ids=[_case_id(env) for env, *_ in REFUSED]
)
def test_a_bad_value_is_refused_naming_its_setting(env, setting, explanation):
    with pytest.raises(ConfigError) as refused:
        load_settings(env)
    assert refused.value.setting == setting
    assert str(refused.value).startswith(f"{setting}: ")
    assert explanation in str(refused.value)


def test_dispatch_ahead_off_turns_the_pace_off():
    assert load_settings({"BRIDGE_DISPATCH_AHEAD": "OFF"}).dispatch_ahead is None


def test_every_setting_is_tested_here_or_beside_the_conduit_client():
    tested = {name for name, *_ in ACCEPTED} | {name for env, *_ in REFUSED for name in env}
    assert {s.name for s in SETTINGS} - tested - CONDUIT_SETTINGS == set()


def test_the_longest_accepted_owner_prefix_still_makes_owners(monkeypatch):
    """What load_settings lets through must not fail later, at every poll."""
    longest = next(n for n in range(64, 0, -1) if _accepted({"BRIDGE_OWNER_PREFIX": "x" * n}))
    monkeypatch.setattr("os.getpid", lambda: 4_194_304)  # Linux's largest pid
    monkeypatch.setattr("bridge.queue.model._owner_sequence", iter([10**9]))
    widest_epoch = 9_999_999_999  # the database clock, as wide as it gets until 2286
    assert new_owner("x" * longest, widest_epoch).startswith("x" * longest + ":4194304:")


def _accepted(env: dict[str, str]) -> bool:
    try:
        load_settings(env)
    except ConfigError:
        return False
    return True


def test_a_url_is_not_repeated_in_the_error():
    with pytest.raises(ConfigError) as refused:
        load_settings({"BRIDGE_DATABASE_URL": "postgresql://phorge:s3cret@db/phorge"})
    assert "s3cret" not in str(refused.value)


def test_a_config_error_is_the_bridges_and_a_value_error():
    with pytest.raises(ConfigError) as refused:
        load_settings({"BRIDGE_RETRY_JITTER": "2"})
    assert isinstance(refused.value, BridgeError) and isinstance(refused.value, ValueError)
    assert refused.value.problem == "expected a number from 0 to 1, got '2'"


RUNTIME_ATTRIBUTES = """database_url broker_url poll_interval router control_queue max_inflight
    dispatch_lease default_lease retry_base retry_max retry_jitter report_attempts
    handlers_include handlers_exclude owner_prefix inline_data_max task_events metrics_port
    metrics_address conduit""".split()  # noqa: SIM905 (a list of names, written as text)


@pytest.mark.parametrize("name", RUNTIME_ATTRIBUTES)
def test_the_attributes_the_runtime_reads_are_all_there(name):
    assert hasattr(load_settings({}), name)


def test_a_secret_stays_out_of_repr():
    token = "api-" + "t" * 28
    settings = load_settings(
        {"BRIDGE_CONDUIT_URL": "https://p.example", "BRIDGE_CONDUIT_TOKEN": token}
    )
    assert token not in repr(settings)
    assert [s.name for s in SETTINGS if s.secret] == ["BRIDGE_CONDUIT_TOKEN"]


def test_the_settings_table_lists_every_setting_with_its_default():
    table = explain()
    for setting in SETTINGS:
        shown = f"`{setting.default}`" if setting.default else "(none)"
        assert f"| `{setting.name}` | {shown} | {setting.help} |" in table
