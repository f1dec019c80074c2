"""Settings: every ``BRIDGE_*`` environment variable, declared once as a field of ``Settings``.

Each field names its variable, default, parser and explanation; ``load_settings``, the
``phorge-bridge settings`` command and docs/settings.md's table are all made from them. A bad
value stops the process at start with a :class:`ConfigError` naming the variable; an
unknown ``BRIDGE_`` name is refused too, since a typo would otherwise be ignored. This is
the only module that reads ``BRIDGE_*`` variables.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

from bridge.errors import ConfigError
from bridge.routing import Router, Rule, parse_queue_name, parse_rules

__all__ = [
    "SETTINGS",
    "ConfigError",
    "MaxInflight",
    "Setting",
    "Settings",
    "current_settings",
    "explain",
    "load_settings",
]


# -- the transports' settings, as their code takes them ---------------------------------

DEFAULT_CONNECT_TIMEOUT = 5.0
# A proxied worker runs inside this one HTTP request; cutting it short while PHP carries on
# invites a second run, so the default is generous (Phorge's own daemons have no limit).
DEFAULT_READ_TIMEOUT = 600.0
# Phorge's PhabricatorConduitToken types: "api-", "cli-", "clr-" and 32 characters in all.
_TOKEN_RE = re.compile(r"\A(?:api|cli|clr)-[A-Za-z0-9]{28}\Z")


def validate_base_url(url: str) -> str:
    """Phorge's base URI without a trailing slash; raises ValueError saying what is wrong."""
    url = url.strip()
    if not url:
        raise ValueError("Phorge's base URI must not be empty")
    parts = urlsplit(url)
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URI of Phorge, got {url!r}")
    if parts.username or parts.password:
        raise ValueError("must not carry credentials; the API token is a setting of its own")
    if parts.query or parts.fragment:
        raise ValueError(f"must not have a query or fragment, got {url!r}")
    path = parts.path.rstrip("/")
    if path.endswith("/api"):
        raise ValueError(
            "give Phorge's base URI (e.g. https://phorge.example.com), not its /api/ endpoint"
        )
    return f"{parts.scheme}://{parts.netloc}{path}"


def validate_token(token: str) -> str:
    """Check the shape Phorge requires of an API token; the message never repeats the token."""
    token = token.strip()
    if not token:
        raise ValueError("the API token must not be empty")
    if not _TOKEN_RE.match(token):
        raise ValueError(
            "not a Phorge API token (expected 32 characters starting with "
            "'api-', 'cli-' or 'clr-'; the value is not shown)"
        )
    return token


@dataclass(frozen=True)
class ConduitSettings:
    """How to reach Phorge's Conduit API (``bridge.config`` reads and checks them)."""

    url: str
    token: str = field(repr=False)
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    read_timeout: float = DEFAULT_READ_TIMEOUT
    verify_tls: bool = True
    # The proxy's: tasks per worker.execute request, and requests in flight per worker.
    batch: int = 16
    max_requests: int = 1
    # The setting the token came from, for messages that ask an operator to fix it.
    token_setting: str = "BRIDGE_CONDUIT_TOKEN"


@dataclass(frozen=True)
class RunnerSettings:
    """The PHP runner's settings (``BRIDGE_PHORGE_ROOT`` and the ``BRIDGE_RUNNER_*`` ones):
    the PHP binary, the Phorge checkout it bootstraps, and the rules retiring a process."""

    php: str
    phorge_root: Path
    classes: tuple[str, ...]
    max_tasks: int
    max_age: float
    max_rss: int
    reload_stamp: Path | None = None


T = TypeVar("T")

DATABASE_SCHEMES = ("mysql", "mysql+mysqldb", "mariadb", "mariadb+mysqldb", "sqlite")
MYSQL_INSTALL = "pip install 'phorge-bridge[mysql]'"
BROKER_SCHEMES = ("amqp", "pyamqp", "amqps", "redis", "rediss", "sqla+sqlite")
# Leases a queue holds at once: enough buffer that workers never wait for the next poll
# (measured: 200 starved four busy children), small enough that a backlog of slow tasks
# is still started within the dispatch lease (concurrency x lease / duration).
DEFAULT_MAX_INFLIGHT = 500
# Leaves room in varchar(64) for ":pid:time:host:sequence" and the ":label" an archive
# row adds (":conduit-fallback"), so every run of this bridge names its implementation.
MAX_OWNER_PREFIX = 15


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One ``BRIDGE_*`` variable: its default as written in the environment, and its parser.

    ``parse`` turns the text into the value and raises ValueError saying what is wrong;
    :meth:`read` adds the variable's name.
    """

    name: str
    default: str
    parse: Callable[[str], T]
    help: str
    secret: bool = False

    def read(self, environ: Mapping[str, str]) -> T:
        """The value in ``environ``; unset or empty means the default."""
        try:
            return self.parse(environ.get(self.name) or self.default)
        except ValueError as exc:
            raise ConfigError(self.name, str(exc)) from None


def setting(
    name: str, default: str, parse: Callable[[str], Any], help: str, *, secret: bool = False
) -> Any:
    """A ``Settings`` field read from the variable ``name`` (a secret is kept out of repr)."""
    return field(repr=not secret, metadata={"setting": Setting(name, default, parse, help, secret)})


# -- parsers: text -> value, or ValueError with what is accepted -----------------------------


def _positive_int(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"expected a positive integer, got {raw!r}")
    return value


def _port(raw: str) -> int:
    port = _positive_int(raw)
    if port > 65535:
        raise ValueError(f"expected a TCP port from 1 to 65535, got {raw!r}")
    return port


def _ports(raw: str) -> range:
    """``9100``, or ``9100-9103``: the ports to try, in order (one per worker on a host)."""
    first, _, last = raw.partition("-")
    low, high = _port(first.strip()), _port(last.strip() or first.strip())
    if high < low:
        raise ValueError(f"expected a port or a range LOW-HIGH, got {raw!r}")
    return range(low, high + 1)


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"expected a positive number of seconds, got {raw!r}")
    return value


def _seconds_or_off(raw: str) -> float | None:
    if raw.strip().lower() == "off":
        return None
    try:
        return _seconds(raw)
    except ValueError:
        raise ValueError(f"expected a positive number of seconds or `off`, got {raw!r}") from None


def _fraction(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise ValueError(f"expected a number from 0 to 1, got {raw!r}")
    return value


def _probability(raw: str) -> float:
    """A chance strictly between 0 and 1: 0 never trips, 1 always does."""
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < 1:
        raise ValueError(f"expected a number between 0 and 1 (exclusive), got {raw!r}")
    return value


def _factor(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not (value >= 1 and math.isfinite(value)):
        raise ValueError(f"expected a number of at least 1, got {raw!r}")
    return value


def _database_name(raw: str) -> str:
    name = raw.strip()
    if not re.fullmatch(r"[A-Za-z0-9_$]{1,64}", name):
        raise ValueError(f"expected a database name (letters, digits, _ or $), got {raw!r}")
    return name


def _boolean(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {raw!r}")


def _url(schemes: tuple[str, ...]) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        scheme = urlsplit(raw).scheme if "://" in raw else ""
        if scheme not in schemes:
            # Only the scheme is repeated: the rest may hold a password.
            shown = raw.split("://")[0] + "://..." if "://" in raw else repr(raw)
            raise ValueError(f"unsupported URL {shown}; accepted schemes: {', '.join(schemes)}")
        return raw

    return parse


def _database_url(raw: str) -> str:
    url = _url(DATABASE_SCHEMES)(raw)
    if not url.startswith("sqlite"):
        _require_mysql_driver()
    return url


def _require_mysql_driver() -> None:
    """Every MySQL scheme accepted uses mysqlclient, an extra since it needs a compiler:
    without it, the process stops at start, not at its first connection."""
    try:
        importlib.import_module("MySQLdb")
    except ImportError as exc:
        if exc.name == "MySQLdb":
            problem = f"the MySQL driver is not installed: {MYSQL_INSTALL}"
        else:  # installed, but it does not load (libmariadb's shared library gone, ...)
            problem = f"the MySQL driver (mysqlclient) does not load: {exc}"
        raise ValueError(problem) from None


def _globs(raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


@dataclass(frozen=True)
class MaxInflight:
    default: int
    per_queue: Mapping[str, int] = field(default_factory=dict)

    def for_queue(self, queue: str) -> int:
        return self.per_queue.get(queue, self.default)


def _max_inflight(raw: str) -> MaxInflight:
    default: int | None = None
    per_queue: dict[str, int] = {}
    for part in _globs(raw):
        queue, sep, number = part.rpartition("=")
        if not sep:
            default = _positive_int(number)
        elif not queue.strip():
            raise ValueError(f"expected 'N' or 'queue=N', got {part!r}")
        else:
            per_queue[queue.strip()] = _positive_int(number)
    return MaxInflight(DEFAULT_MAX_INFLIGHT if default is None else default, per_queue)


def _owner_prefix(raw: str) -> str:
    # No colon: "prefix:" must select this bridge's owners and no other's.
    if len(raw) > MAX_OWNER_PREFIX or ":" in raw:
        raise ValueError(f"must be short (1 to {MAX_OWNER_PREFIX} characters) and hold no ':'")
    return raw


def _megabytes(raw: str) -> int:
    return _positive_int(raw) * 1024 * 1024


def _optional(parse: Callable[[str], T]) -> Callable[[str], T | None]:
    """A parser for a setting that is off when empty."""
    return lambda raw: parse(raw) if raw.strip() else None


# -- the settings ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """This process's settings, one field per variable, checked as a whole on construction.

    ``router`` and ``conduit`` are made from several variables each.
    """

    database_url: str = setting(
        "BRIDGE_DATABASE_URL",
        "sqlite:///phorge-bridge.db",
        _database_url,
        "Phorge's worker database (SQLAlchemy URL), e.g. "
        "`mysql+mysqldb://user:pass@127.0.0.1/phabricator_worker` (MySQL needs "
        f"`{MYSQL_INSTALL}`)",
    )
    broker_url: str = setting(
        "BRIDGE_BROKER_URL",
        "sqla+sqlite:///phorge-bridge-broker.db",
        _url(BROKER_SCHEMES),
        "Celery broker: `amqp://`, `redis://` or the server-less `sqla+sqlite://`",
    )
    poll_interval: float = setting(
        "BRIDGE_POLL_INTERVAL", "0.25", _seconds, "seconds between two polls of the queue"
    )
    routes: tuple[Rule, ...] = setting(
        "BRIDGE_ROUTES",
        "",
        parse_rules,
        "ordered rules `glob=queue,...` from task class to Celery queue; first match wins",
    )
    default_queue: str = setting(
        "BRIDGE_DEFAULT_QUEUE", "phorge", parse_queue_name, "queue of classes no rule matches"
    )
    control_queue: str = setting(
        "BRIDGE_CONTROL_QUEUE",
        "bridge.control",
        parse_queue_name,
        "queue of the `bridge.poll` messages",
    )
    max_inflight: MaxInflight = setting(  # noqa: RUF009 (frozen; setting() returns a field)
        "BRIDGE_MAX_INFLIGHT",
        str(DEFAULT_MAX_INFLIGHT),
        _max_inflight,
        "most leases a queue holds at once (its pace may hold fewer, see "
        "BRIDGE_DISPATCH_AHEAD): `N` for every queue, or `N,queue=M,...`",
    )
    dispatch_ahead: float | None = setting(
        "BRIDGE_DISPATCH_AHEAD",
        "0.25",
        _seconds_or_off,
        "seconds of work a queue dispatches ahead of its workers (its measured pace), so "
        "a backlog waits in the database in priority order; `off`: up to "
        "BRIDGE_MAX_INFLIGHT",
    )
    dispatch_lease: int = setting(
        "BRIDGE_DISPATCH_LEASE",
        "300",
        _positive_int,
        "seconds a dispatched task stays leased before a worker starts it",
    )
    default_lease: int = setting(
        "BRIDGE_DEFAULT_LEASE",
        "7200",
        _positive_int,
        "seconds of lease a running task holds when its handler declares none "
        "(renewed by the heartbeat)",
    )
    retry_base: int = setting(
        "BRIDGE_RETRY_BASE", "15", _positive_int, "first wait (s) after a native handler's failure"
    )
    retry_max: int = setting(
        "BRIDGE_RETRY_MAX",
        "3600",
        _positive_int,
        "longest wait (s) between retries of native handlers",
    )
    retry_jitter: float = setting(
        "BRIDGE_RETRY_JITTER", "0.2", _fraction, "random fraction (0..1) added to each retry wait"
    )
    report_attempts: int = setting(
        "BRIDGE_REPORT_ATTEMPTS",
        "5",
        _positive_int,
        "tries to write an outcome through database errors before the lease is left to expire",
    )
    handlers_include: tuple[str, ...] = setting(
        "BRIDGE_HANDLERS_INCLUDE", "*", _globs, "globs of task classes the bridge may serve"
    )
    handlers_exclude: tuple[str, ...] = setting(
        "BRIDGE_HANDLERS_EXCLUDE", "", _globs, "globs of task classes the bridge never serves"
    )
    owner_prefix: str = setting(
        "BRIDGE_OWNER_PREFIX",
        "bridge",
        _owner_prefix,
        "start of every lease owner this bridge writes",
    )
    daemon_console: bool = setting(
        "BRIDGE_DAEMON_CONSOLE",
        "true",
        _boolean,
        "list each worker and beat in Phorge's Daemons console (rows of "
        "`{namespace}_daemon.daemon_log`, needs INSERT, UPDATE on it)",
    )
    inline_data_max: int = setting(
        "BRIDGE_INLINE_DATA_MAX",
        "8192",
        _positive_int,
        "task data up to this many bytes travels inside the Celery message",
    )
    batch_max: int = setting(
        "BRIDGE_BATCH_MAX",
        "16",
        _positive_int,
        "most tasks one Celery message carries when a poll leases a backlog "
        "(`1`: a message per task)",
    )
    task_events: bool = setting(
        "BRIDGE_TASK_EVENTS",
        "false",
        _boolean,
        "send Celery task events from the start (Flower turns them on over the control "
        "channel when it connects)",
    )
    metrics_port: range | None = setting(
        "BRIDGE_METRICS_PORT",
        "",
        _optional(_ports),
        "serve Prometheus metrics on this port, or on the first free one of a range "
        "`9100-9103` (one per worker on a host); off when empty",
    )
    metrics_address: str = setting(
        "BRIDGE_METRICS_ADDRESS", "127.0.0.1", str, "address the metrics server binds"
    )
    conduit_url: str | None = setting(
        "BRIDGE_CONDUIT_URL",
        "",
        _optional(validate_base_url),
        "Phorge base URL; enables the `worker.execute` proxy (off when empty)",
    )
    conduit_token: str | None = setting(
        "BRIDGE_CONDUIT_TOKEN",
        "",
        _optional(validate_token),
        "Conduit API token of the bridge's bot",
        secret=True,
    )
    conduit_token_file: str | None = setting(
        "BRIDGE_CONDUIT_TOKEN_FILE",
        "",
        _optional(str.strip),
        "file holding the Conduit API token",
    )
    conduit_connect_timeout: float = setting(
        "BRIDGE_CONDUIT_CONNECT_TIMEOUT", "5", _seconds, "seconds to connect to Conduit"
    )
    conduit_read_timeout: float = setting(
        "BRIDGE_CONDUIT_READ_TIMEOUT", "600", _seconds, "seconds to wait for a Conduit answer"
    )
    conduit_verify_tls: bool = setting(
        "BRIDGE_CONDUIT_VERIFY_TLS", "true", _boolean, "verify Conduit's TLS certificate"
    )
    conduit_batch: int = setting(
        "BRIDGE_CONDUIT_BATCH",
        "16",
        _positive_int,
        "tasks of a message one `worker.execute` request runs (its bootstrap and token "
        "check paid once for them); 1 sends each alone",
    )
    conduit_max_requests: int = setting(
        "BRIDGE_CONDUIT_MAX_REQUESTS",
        "1",
        _positive_int,
        "`worker.execute` requests one worker (all its pool's processes and threads) has "
        "in flight at once; a fleet's sum must leave the web tier PHP workers for its users",
    )
    phorge_root: str | None = setting(
        "BRIDGE_PHORGE_ROOT",
        "",
        _optional(str.strip),
        "this host's Phorge checkout; enables the PHP runner: PHP-only classes run in "
        "long-lived PHP processes here, before Conduit (off when empty)",
    )
    runner_classes: tuple[str, ...] = setting(
        "BRIDGE_RUNNER_CLASSES",
        "*",
        _globs,
        "globs of the PHP-only classes the PHP runner runs; the others go to Conduit",
    )
    runner_php: str = setting("BRIDGE_RUNNER_PHP", "php", str.strip, "PHP binary of the PHP runner")
    runner_max_tasks: int = setting(
        "BRIDGE_RUNNER_MAX_TASKS",
        "10000",
        _positive_int,
        "tasks a PHP runner process runs before it is replaced",
    )
    runner_max_age: float = setting(
        "BRIDGE_RUNNER_MAX_AGE",
        "3600",
        _seconds,
        "seconds after which a PHP runner process is replaced, between two tasks (new "
        "Phorge code runs by then)",
    )
    runner_max_rss: int = setting(
        "BRIDGE_RUNNER_MAX_RSS",
        "512",
        _megabytes,
        "megabytes of resident memory past which a PHP runner process is replaced after its task",
    )
    runner_reload_stamp: str | None = setting(
        "BRIDGE_RUNNER_RELOAD_STAMP",
        "",
        _optional(str.strip),
        "a file a deploy touches (`touch` it after new Phorge code is in place): PHP runner "
        "processes older than it are replaced before their next task",
    )
    canary: bool = setting(
        "BRIDGE_CANARY",
        "true",
        _boolean,
        "read the canary's weights from Phorge's config table; false: every class "
        "wholly on the bridge, the table never read (an account not granted it)",
    )
    canary_database: str | None = setting(
        "BRIDGE_CANARY_DATABASE",
        "",
        _optional(_database_name),
        "database of Phorge's config table, where the canary's weights and state "
        "live (default: `{namespace}_config` beside the worker database; SQLite: its file)",
    )
    canary_refresh: float = setting(
        "BRIDGE_CANARY_REFRESH",
        "1",
        _seconds,
        "seconds a process keeps the canary weights before reading them again",
    )
    canary_guard_interval: float = setting(
        "BRIDGE_CANARY_GUARD_INTERVAL",
        "1",
        _seconds,
        "seconds between two runs of the canary guard (beat sends it)",
    )
    canary_window: int = setting(
        "BRIDGE_CANARY_WINDOW",
        "300",
        _positive_int,
        "seconds of archived runs the canary guard and `canary report` judge",
    )
    canary_window_runs: int = setting(
        "BRIDGE_CANARY_WINDOW_RUNS",
        "2000",
        _positive_int,
        "new-side runs at which the canary guard's window is cut short (the old side's "
        "at four times that), for both sides at once",
    )
    canary_history: int = setting(
        "BRIDGE_CANARY_HISTORY",
        "86400",
        _positive_int,
        "seconds of the canary guard's long window (kept per minute in its process), which "
        "small differences at low traffic need, and where the window's old side is taken "
        "from when it holds too few runs",
    )
    canary_min_runs: int = setting(
        "BRIDGE_CANARY_MIN_RUNS",
        "10",
        _positive_int,
        "new-side runs in the window before the canary guard judges a class",
    )
    canary_min_failures: int = setting(
        "BRIDGE_CANARY_MIN_FAILURES",
        "3",
        _positive_int,
        "new-side failures in the window before the canary guard may roll a class back",
    )
    canary_max_drop: float = setting(
        "BRIDGE_CANARY_MAX_DROP",
        "0.01",
        _fraction,
        "how far (0..1) the new side's success ratio may fall below the old side's before "
        "a significant difference counts",
    )
    canary_significance: float = setting(
        "BRIDGE_CANARY_SIGNIFICANCE",
        "1e-6",
        _probability,
        "the chance (Fisher's one-sided test) below which the new side's excess of "
        "failures is taken as real rather than luck",
    )
    canary_failure_limit: int = setting(
        "BRIDGE_CANARY_FAILURE_LIMIT",
        "3",
        _positive_int,
        "consecutive evaluations that must find the new side worse before a rollback",
    )
    canary_max_slowdown: float = setting(
        "BRIDGE_CANARY_MAX_SLOWDOWN",
        "3",
        _factor,
        "how many times the old side's median duration the new side's may reach",
    )
    canary_slowdown_floor: float = setting(
        "BRIDGE_CANARY_SLOWDOWN_FLOOR",
        "1",
        _seconds,
        "seconds the new side's median must exceed the old side's by before it counts as slower",
    )
    canary_max_followup_change: float = setting(
        "BRIDGE_CANARY_MAX_FOLLOWUP_CHANGE",
        "0.5",
        _fraction,
        "how far (0..1 of the old side's) the new side's follow-ups per successful run may "
        "differ from the old side's before a significant difference counts",
    )
    canary_max_yielding: int = setting(
        "BRIDGE_CANARY_MAX_YIELDING",
        "3600",
        _positive_int,
        "seconds since its creation after which a task that yields counts as a yield loop: "
        "a new-side run's yield then falls back, and a row of either side still yielding "
        "counts as its side's failure",
    )

    router: Router = field(init=False)
    conduit: ConduitSettings | None = field(init=False)
    runner: RunnerSettings | None = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "router", Router(self.routes, self.default_queue))
        object.__setattr__(self, "conduit", self._conduit())
        object.__setattr__(self, "runner", self._runner())
        self._check()

    def _runner(self) -> RunnerSettings | None:
        """The PHP runner's settings, or None when it is off (no Phorge checkout set)."""
        if self.phorge_root is None:
            return None
        stamp = self.runner_reload_stamp
        return RunnerSettings(
            php=self.runner_php,
            phorge_root=Path(self.phorge_root),
            classes=self.runner_classes,
            max_tasks=self.runner_max_tasks,
            max_age=self.runner_max_age,
            max_rss=self.runner_max_rss,
            reload_stamp=Path(stamp) if stamp else None,
        )

    def _conduit(self) -> ConduitSettings | None:
        """The Conduit proxy's settings, or None when it is off; URL and token go together."""
        if self.conduit_token and self.conduit_token_file:
            raise ConfigError("BRIDGE_CONDUIT_TOKEN_FILE", "set either it or BRIDGE_CONDUIT_TOKEN")
        token = self.conduit_token
        if self.conduit_token_file:
            token = self._token_from_file(self.conduit_token_file)
        if self.conduit_url is None:
            if token:
                raise ConfigError("BRIDGE_CONDUIT_URL", "required when a Conduit token is set")
            return None
        if token is None:
            raise ConfigError(
                "BRIDGE_CONDUIT_TOKEN",
                "BRIDGE_CONDUIT_URL is set, so a token (or BRIDGE_CONDUIT_TOKEN_FILE) is required",
            )
        return ConduitSettings(
            url=self.conduit_url,
            token=token,
            connect_timeout=self.conduit_connect_timeout,
            read_timeout=self.conduit_read_timeout,
            verify_tls=self.conduit_verify_tls,
            batch=self.conduit_batch,
            max_requests=self.conduit_max_requests,
            token_setting=(
                "BRIDGE_CONDUIT_TOKEN_FILE" if self.conduit_token_file else "BRIDGE_CONDUIT_TOKEN"
            ),
        )

    @staticmethod
    def _token_from_file(path: str) -> str:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                "BRIDGE_CONDUIT_TOKEN_FILE", f"cannot read {path}: {exc.strerror}"
            ) from None
        try:
            return validate_token(text)
        except ValueError as exc:
            raise ConfigError("BRIDGE_CONDUIT_TOKEN_FILE", str(exc)) from None

    def _check(self) -> None:
        """The rules that tie several settings together."""
        if self.control_queue == self.default_queue:
            raise ConfigError("BRIDGE_CONTROL_QUEUE", "needs a queue name of its own")
        if self.control_queue in self.router.queues:
            raise ConfigError(
                "BRIDGE_ROUTES", f"routes a class to the control queue {self.control_queue!r}"
            )
        unknown_queues = sorted(set(self.max_inflight.per_queue) - set(self.router.queues))
        if unknown_queues:
            raise ConfigError(
                "BRIDGE_MAX_INFLIGHT",
                f"no route leads to queue {unknown_queues[0]!r}; "
                f"queues: {', '.join(self.router.queues)}",
            )
        if self.retry_base > self.retry_max:
            raise ConfigError("BRIDGE_RETRY_BASE", "must not be larger than BRIDGE_RETRY_MAX")
        if self.dispatch_lease < 2 * self.poll_interval:
            raise ConfigError(
                "BRIDGE_DISPATCH_LEASE", "must be at least twice BRIDGE_POLL_INTERVAL"
            )


SETTINGS: tuple[Setting[Any], ...] = tuple(
    f.metadata["setting"] for f in fields(Settings) if "setting" in f.metadata
)


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Read and check every setting; raises ConfigError naming the first bad one."""
    env = os.environ if environ is None else environ
    known = {s.name for s in SETTINGS}
    unknown = sorted(name for name in env if name.startswith("BRIDGE_") and name not in known)
    if unknown:
        raise ConfigError(unknown[0], "unknown setting; see docs/settings.md")
    values = {f.name: f.metadata["setting"].read(env) for f in fields(Settings) if f.init}
    return Settings(**values)


def explain() -> str:
    """The settings table (name, default, meaning) in Markdown, as docs/settings.md shows it."""
    rows = ["| setting | default | meaning |", "|---|---|---|"]
    rows += [
        f"| `{s.name}` | {f'`{s.default}`' if s.default else '(none)'} | {s.help} |"
        for s in SETTINGS
    ]
    return "\n".join(rows)


@functools.cache
def current_settings() -> Settings:
    """This process's settings, read once from the environment."""
    return load_settings()
